"""Turns a dense llama or qwen2 GGUF into a mixture-of-experts one by MoEfication, for real routing
traces.

The expert cache benchmark (benchmarks/moe.py) wants traces of the experts real tokens pick, and no
MoE model may be downloaded. MoEfication (Zhang et al. 2021, "MoEfication: Transformer
Feed-forward Layers are Mixtures of Experts") makes one from a dense model: each layer's FFN
neurons are split into E experts and a router is added, so that routing is driven by real text
through a real model. A `llama` source (the bundled SmolLM2) becomes a Mixtral-style `llama` MoE;
a `qwen2` one (Qwen2.5-Coder, tests/support/real_models.py) a `qwen2moe`, whose shared expert
every token uses beside its routed ones. moefication.py fits the experts and routers; this writes
the file. T calibration tokens, H hidden size, F FFN width, E experts, k used, S the shared
expert's width.

- Calibration: the model runs on `moe_calibration.txt` (~1500 tokens of prose, code, lists,
  dialogue) in float32 (dequantized weights), layer by layer, qwen2's attention with its q, k and
  v biases and its rotary (neox, the file's theta). Layer l is fit on the FFN inputs x [T, H]
  (after ffn_norm) that the MoE layers 0..l-1, already fit and routed to their top-k, give it: fit
  on the dense model's inputs instead, the routers met drifted inputs in the MoE model and some
  deep layers sent up to 97% of the tokens to one expert. a = silu(x @ gate.T) * (x @ up.T)
  [T, F] are the neurons' activations.
- Shared expert (qwen2moe, where llama.cpp requires one): the S neurons of most output energy,
  rms(a[:, n]) * |down[:, n]| over the tokens. On the 0.5B Qwen (top-2 of 8, S = 512, KL from the
  dense model on benchmarks/quality_text.txt) they beat the neurons every token fires (the highest
  10th percentile of |a|: 3.68 nats; median: 3.63), the most mass (mean |a|: 2.68; times |down|:
  2.46) and a random choice (3.93) with 2.09. By default S is at least F/16 (as Qwen1.5-MoE-A2.7B's
  shared expert, 5632 of 90112 neurons), rounded up so that the rest splits into E experts of
  whole Q8_0 blocks: 768 for 64 experts of the 1.5B's 8960 (experts of 128), 512 for 8 of the
  0.5B's 4864.
- Experts: balanced spherical k-means groups the other neurons by firing together: a neuron is its
  unit-norm pattern |a[:, n]| over the tokens, and every cluster gets exactly (F - S)/E neurons.
- Router: per expert, a ridge least-squares fit (no bias: GGUF routers have none) of its mass
  m = sum of |a| over its neurons, divided by mean(m) ** balance over the tokens. balance 0 ranks
  experts by raw mass, which keeps the most of the FFN, but the expert holding the always-on
  neurons then wins nearly every token (in the average layer one expert is in 82% of the tokens'
  top-2); balance 1 (default) ranks them by mass relative to their usual mass, as balanced as
  trained routers (the busiest expert takes 37% of the tokens in the average layer, 56% at most).
  Both on the calibration text, top-2 of 8.
- Weights: llama renormalises the chosen top-k softmax weights to sum to 1; qwen2moe weighs the
  chosen experts by their softmax over all E, not renormalised (llama.cpp's qwen2moe graph). So
  the MoE FFN is sum_j w_j * expert_j(x) where the dense FFN is the plain sum over all experts.
  Router logits are scaled to a standard deviation of ROUTER_LOGIT_STD over the calibration
  tokens, so that w_j is within 0.4% of 1/k (qwen2moe: 1/E) for 99% of the tokens (a positive
  scale keeps the ranking), and each expert's down projection is scaled by k (E): the output
  approximates the plain sum of the chosen experts, and with k = E the dense FFN itself. The
  shared expert is weighed by sigmoid(x @ ffn_gate_inp_shexp): its gate row lies along the
  tokens' mean x, scaled so that its logits stay within SHARED_GATE_LOGIT of 0 on the calibration
  tokens, and its down is scaled by 2. A zero row would give exactly 1/2 in tierflow, but
  llama.cpp computes that sigmoid as silu(g) / g, and its logits were NaN.
- Quantization: gate and up rows are the source's rows of the expert's neurons, copied bit for bit
  (every ggml type packs a row on its own). Down's blocks run along the F neurons, so an expert's
  columns are not whole blocks. Clustering whole 32-neuron blocks would keep them, but the
  source's neuron order is arbitrary: block clusters left 0.74 of the dense FFN output's norm as
  error against neuron clusters' 0.685 (top-2 of 8, the best experts per token, held-out text,
  every third layer). So down is dequantized, sliced, scaled and written as Q8_0, whose rounding
  is ~1/17 of a Q4_1 step; the shared expert is written as the routed ones.
Attention, norms, embeddings and output are copied verbatim (a tied qwen2 source's embedding is
also written as output.weight, which llama.cpp's qwen2moe requires), as are all metadata entries
but these: llama's feed_forward_length (now the expert width); qwen2's keys, renamed qwen2moe.*
(feed_forward_length stays the dense width) with the added expert_feed_forward_length and
expert_shared_feed_forward_length; the added expert_count and expert_used_count; and
general.architecture and general.name (marked as MoEfied).

Quality: the SwiGLU activations are dense, so without fine-tuning such a model is no language
model any more. Perplexity of benchmarks/quality_text.txt (tierflow): SmolLM2 dense 28.0; top-8
of 8 28.0; top-4 925 (balance 0: 210); top-2 33000 (balance 0: 2800). Qwen2.5-Coder-1.5B dense
19.1; 64 experts, top-8 with the default shared expert (20% of the neurons a token) 319, a KL of
3.2 nats and the dense model's top token at 28% of the positions; with all 64 used it is the
dense model (0.098 mean |logit difference|, where tierflow and llama.cpp differ by 0.093 on the
dense file). Routing balance, the busiest
expert's share of the tokens per layer (uniform: 12.5%): 23% on average and 35% at most on the
calibration text, but 51% and 83% on that held-out text, all plain prose (a 100 times stronger
ridge made it 68% and 91%). Traces come from real text through real weights, but a deep layer's
inputs are those of a broken model.

    write_moe_from_dense(bundled_model_path(), tmp_path / "moe.gguf", num_experts=8, experts_used=2)
    write_moe_from_dense(fetch(QWEN_CODER_15B), "/tmp/qwen-64e8.gguf", num_experts=64, experts_used=8)

    python -m tests.support.make_moe_from_dense OUT.gguf [--experts 8] [--experts-used 2] [--balance 1]
                                                 [--source SRC] [--shared-width S]
                                                 [--calibration TEXT_FILE]

On one core: about 16 s for SmolLM2, 45 s for the 0.5B Qwen, 200 s for the 1.5B (1.27 GB written
from its 1.12 GB Q4_K_M, 1.8 GB of memory at most).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from tests.support.gguf_bytes import STRING, UINT32, Typed, pack_kv, pack_string
from tests.support.gguf_writing import TensorEntry, encoded_kvs, write_gguf
from tests.support.model_spec import MAX_EXPERTS
from tests.support.moefication import MoELayer, dequantized, fit_experts
from tierflow.errors import TierflowError
from tierflow.offload.gguf.model_file import read_config
from tierflow.offload.gguf.reader import GGUFFile, TensorInfo, read_gguf
from tierflow.offload.store.model_path import bundled_model_path
from tierflow.runtime.text.tokenizer import Tokenizer

__all__ = ["CALIBRATION_TEXT", "main", "write_moe_from_dense"]

CALIBRATION_TEXT = Path(__file__).with_name("moe_calibration.txt")
MOE_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2moe"}  # a dense source's -> its MoE file's
SHARED_SHARE = 16        # the default shared expert holds at least 1/16 of the FFN's neurons
DOWN_TYPE = GGMLQuantizationType.Q8_0
BLOCK = GGML_QUANT_SIZES[DOWN_TYPE][0]  # down rows are whole Q8_0 blocks of neurons
F32 = GGMLQuantizationType.F32


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The MoE file's layout: its architecture, E experts of `expert_width` neurons of which each
    token uses k, and a shared expert of `shared_width` neurons that every token uses (0: none)."""

    arch: str
    num_experts: int
    experts_used: int
    expert_width: int
    shared_width: int

    @property
    def down_scale(self) -> int:
        """What the routed experts' down is multiplied by: the inverse of a chosen expert's router
        weight, ~1/k where llama renormalises the top-k softmax weights, ~1/E where qwen2moe keeps
        the softmax over all E."""
        return self.experts_used if self.arch == "llama" else self.num_experts


def write_moe_from_dense(source: str | os.PathLike, dest: str | os.PathLike, num_experts: int = 8,
                         experts_used: int = 2, calibration_text: str | None = None,
                         threads: int = 1, balance: float = 1.0, shared_width: int | None = None) -> Path:
    """Write the MoEfied version of the dense llama or qwen2 GGUF `source` to `dest` (see the
    module doc).

    calibration_text defaults to moe_calibration.txt (a few thousand tokens at most: attention
    runs over all of it at once); threads is torch's thread count while the experts are fit;
    balance (0 to 1) trades how much of the FFN the chosen experts keep for balanced routing;
    shared_width is the qwen2moe shared expert's neurons (None: at least 1/SHARED_SHARE of the
    FFN, so that the rest splits into experts of whole Q8_0 blocks; llama MoEs have none).
    The same inputs give the same bytes with the same BLAS threads (torch's count changes nothing;
    numpy's OPENBLAS_NUM_THREADS=1 gave another 0.5B Qwen file)."""
    source, dest = Path(source), Path(dest)
    if dest.resolve() == source.resolve():
        raise ValueError(f"{source}: the MoE file cannot overwrite its source")
    if not 0 <= balance <= 1:
        raise ValueError(f"balance must be between 0 and 1, got {balance}")
    with read_gguf(source) as model:
        shape = _moe_shape(model, num_experts, experts_used, shared_width)
        with Tokenizer.from_gguf(source) as tokenizer:
            ids = tokenizer.encode(CALIBRATION_TEXT.read_text() if calibration_text is None
                                   else calibration_text)
        layers = fit_experts(model, ids, num_experts, experts_used, balance, threads,
                             shape.shared_width)
        tensors = list(_moe_tensors(model, layers, shape))
        return write_gguf(dest, _moe_kvs(model, shape), [entry for entry, _ in tensors],
                          (data() for _, data in tensors), model.alignment)


def _moe_shape(model: GGUFFile, num_experts: int, experts_used: int, shared_width: int | None) -> MoEShape:
    """The MoE file's layout, once the source is a dense model of an architecture MoEfication
    takes, whose FFN splits as asked."""
    arch = model.metadata.get("general.architecture")
    if arch not in MOE_ARCHITECTURES:
        names = " or ".join(repr(name) for name in MOE_ARCHITECTURES)
        raise ValueError(f"{model.path}: MoEfication needs a dense {names} model, not {arch!r}")
    _, config = read_config(model)
    if config.num_experts or "blk.0.ffn_gate_inp.weight" in model.tensors:
        raise ValueError(f"{model.path}: already a mixture-of-experts model, not a dense one")
    if not 2 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be between 2 and {MAX_EXPERTS}, got {num_experts}")
    if not 1 <= experts_used <= num_experts:
        raise ValueError(f"experts_used must be between 1 and num_experts {num_experts}, "
                         f"got {experts_used}")
    moe_arch, ffn_size = MOE_ARCHITECTURES[arch], config.ffn_size
    shared = _shared_width(moe_arch, ffn_size, num_experts, shared_width)
    routed = ffn_size - shared
    if routed % (num_experts * BLOCK):
        what = f"the FFN width {ffn_size}"
        if shared:
            what += f" less the shared expert's {shared} neurons, {routed},"
        raise ValueError(f"num_experts {num_experts} must split {what} into experts of a multiple of "
                         f"{BLOCK} neurons (Q8_0 down rows)")
    return MoEShape(moe_arch, num_experts, experts_used, routed // num_experts, shared)


def _shared_width(moe_arch: str, ffn_size: int, num_experts: int, asked: int | None) -> int:
    """The shared expert's width: none in a llama MoE; a qwen2moe file must have one (llama.cpp
    requires its tensors), by default what is left once E experts of whole Q8_0 blocks take as
    many neurons as leave it at least 1/SHARED_SHARE of them (where they cannot, _moe_shape says
    so)."""
    if moe_arch == "llama":
        if asked:
            raise ValueError(f"a llama MoE has no shared expert: shared_width must be 0, got {asked}")
        return 0
    if asked is None:
        step = num_experts * BLOCK
        routed = (ffn_size - ffn_size // SHARED_SHARE) // step * step
        return ffn_size - routed if routed else ffn_size // SHARED_SHARE
    if not 0 < asked < ffn_size or asked % BLOCK:
        raise ValueError(f"a {moe_arch} file needs a shared expert (llama.cpp requires one) of a multiple "
                         f"of {BLOCK} neurons (Q8_0 down rows) narrower than the FFN width {ffn_size}, "
                         f"got {asked}")
    return asked


# ---------------------------------------------------------------------------------------------
# The file


def _moe_kvs(model: GGUFFile, shape: MoEShape) -> list[bytes]:
    """The source's entries verbatim, under the MoE architecture's prefix, with the expert counts
    and widths after the FFN width, and the name."""
    source_arch = model.metadata["general.architecture"]
    kvs = {}
    for key, entry in encoded_kvs(model.path).items():
        if key.startswith(f"{source_arch}."):  # its type and value bytes as they were
            renamed = shape.arch + key.removeprefix(source_arch)
            key, entry = renamed, pack_string(renamed) + entry[len(pack_string(key)):]
        kvs[key] = entry
        if key == f"{shape.arch}.feed_forward_length":
            for name, value in _expert_entries(shape).items():
                kvs[f"{shape.arch}.{name}"] = pack_kv(f"{shape.arch}.{name}", Typed(UINT32, value))
    name = (f"{model.metadata.get('general.name', model.path.stem)} MoEfied "
            f"{shape.num_experts}e{shape.experts_used}")
    kvs["general.name"] = pack_kv("general.name", Typed(STRING, name))
    kvs["general.architecture"] = pack_kv("general.architecture", Typed(STRING, shape.arch))
    return list(kvs.values())


def _expert_entries(shape: MoEShape) -> dict[str, int]:
    """The expert keys: a llama MoE's experts are feed_forward_length wide; qwen2moe's width and
    its shared expert's have keys of their own (feed_forward_length stays the dense width)."""
    counts = {"expert_count": shape.num_experts, "expert_used_count": shape.experts_used}
    if shape.arch == "llama":
        return {"feed_forward_length": shape.expert_width, **counts}
    return {**counts, "expert_feed_forward_length": shape.expert_width,
            "expert_shared_feed_forward_length": shape.shared_width}


TensorMaker = tuple[TensorEntry, Callable[[], np.ndarray]]  # a header entry, and its data on demand


def _moe_tensors(model: GGUFFile, layers: list[MoELayer], shape: MoEShape) -> Iterator[TensorMaker]:
    """The source's tensors in its order, each dense FFN matrix replaced by its expert stack and
    shared expert (and the gate by the router, then the stack, the shared gate and its gate row).
    Data is made as the writer asks: one tensor at a time in memory. A qwen2moe file without
    output.weight is refused by llama.cpp, so a tied source's embedding is copied to it."""
    untie = shape.arch == "qwen2moe" and "output.weight" not in model.tensors
    for info in model.tensors.values():
        prefix, _, kind = info.name.rpartition(".ffn_")
        if kind in ("gate.weight", "up.weight", "down.weight"):
            yield from _expert_tensors(model, info, layers[int(prefix.removeprefix("blk."))], shape)
            continue
        copy = partial(model.tensor_data, info.name)
        yield TensorEntry(info.name, info.shape, info.ggml_type), copy
        if info.name == "token_embd.weight" and untie:
            yield TensorEntry("output.weight", info.shape, info.ggml_type), copy


def _expert_tensors(model: GGUFFile, info: TensorInfo, layer: MoELayer, shape: MoEShape
                    ) -> list[TensorMaker]:
    """What replaces the dense FFN matrix `info` (GGUF shapes: gate, up (H, F); down (F, H))."""
    num_experts, width, shared = shape.num_experts, shape.expert_width, shape.shared_width
    prefix, _, kind = info.name.removesuffix(".weight").rpartition(".ffn_")
    if kind == "down":
        hidden = info.shape[1]
        makers = [(TensorEntry(f"{prefix}.ffn_down_exps.weight", (width, hidden, num_experts), DOWN_TYPE),
                   partial(_down_stack, model, info.name, layer.experts, shape.down_scale))]
        if shared:  # its gate's sigmoid is 1/2
            makers.append((TensorEntry(f"{prefix}.ffn_down_shexp.weight", (shared, hidden), DOWN_TYPE),
                           partial(_down_stack, model, info.name, layer.shared[None], 2)))
        return makers
    hidden = info.shape[0]
    makers = [(TensorEntry(f"{prefix}.ffn_{kind}_exps.weight", (hidden, width, num_experts), info.ggml_type),
               partial(_row_stack, model, info.name, layer.experts))]
    if shared:
        makers.append((TensorEntry(f"{prefix}.ffn_{kind}_shexp.weight", (hidden, shared), info.ggml_type),
                       partial(_row_stack, model, info.name, layer.shared)))
    if kind == "gate":
        makers.insert(0, (TensorEntry(f"{prefix}.ffn_gate_inp.weight", (hidden, num_experts), F32),
                          lambda: layer.router))
        if shared:
            makers.append((TensorEntry(f"{prefix}.ffn_gate_inp_shexp.weight", (hidden,), F32),
                           lambda: layer.shared_gate))
    return makers


def _row_stack(model: GGUFFile, name: str, neurons: np.ndarray) -> np.ndarray:
    """Gate or up [F, H] as the rows of `neurons` (int64 [E, F/E] or [S]), bit for bit: uint8
    [..., row bytes] (every ggml type packs each row on its own)."""
    rows = model.tensor_data(name).reshape(model.tensors[name].shape[1], -1)  # [F, row bytes]
    return rows[neurons]


def _down_stack(model: GGUFFile, name: str, experts: np.ndarray, scale: int) -> np.ndarray:
    """Down [H, F] as the Q8_0 stack [E, H, F/E] of its experts' columns times `scale`."""
    down = dequantized(model, name)  # [H, F]
    stack = np.stack([down[:, neurons] for neurons in experts]) * np.float32(scale)
    return quantize(stack, DOWN_TYPE)


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a mixture-of-experts GGUF made from a dense "
                                     "llama (Mixtral-style) or qwen2 (qwen2moe) one by MoEfication.")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--source", type=Path, help="the dense llama or qwen2 GGUF (default: the "
                        "bundled SmolLM2)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    parser.add_argument("--experts-used", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--shared-width", type=int, help="qwen2 sources: the shared expert's neurons "
                        f"(default: at least 1/{SHARED_SHARE} of the FFN, so that the rest splits "
                        f"into experts of a multiple of {BLOCK})")
    parser.add_argument("--balance", type=float, default=1.0, help="0: route by the experts' raw "
                        "activation mass; 1 (default): by mass relative to their mean, balanced")
    parser.add_argument("--calibration", type=Path, help="a text file to calibrate on (default: "
                        f"{CALIBRATION_TEXT.name})")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        text = args.calibration.read_text() if args.calibration else None
        path = write_moe_from_dense(args.source or bundled_model_path(), args.out, args.experts,
                                    args.experts_used, text, balance=args.balance,
                                    shared_width=args.shared_width)
    except (OSError, ValueError, TierflowError) as error:
        sys.exit(f"make_moe_from_dense: {error}")
    print(f"{path} {path.stat().st_size} bytes, {args.experts} experts, top-{args.experts_used}, "
          f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
