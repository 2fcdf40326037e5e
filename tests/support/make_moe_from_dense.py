"""Turns a dense llama GGUF into a Mixtral-style MoE one by MoEfication, for real routing traces.

The expert cache benchmark (benchmarks/moe.py) wants traces of the experts real tokens pick, and no
MoE model may be downloaded. MoEfication (Zhang et al. 2021, "MoEfication: Transformer
Feed-forward Layers are Mixtures of Experts") makes one from the bundled dense SmolLM2: each
layer's FFN neurons are split into E experts and a router is added, so that routing is driven by
real text through a real model. T calibration tokens, H hidden size, F FFN width, E experts, k used.

- Calibration: the model runs on `moe_calibration.txt` (~1500 tokens of prose, code, lists,
  dialogue) in float32 (dequantized weights), layer by layer. Layer l is fit on the FFN inputs
  x [T, H] (after ffn_norm) that the MoE layers 0..l-1, already fit and routed to their top-k,
  give it: fit on the dense model's inputs instead, the routers met drifted inputs in the MoE
  model and some deep layers sent up to 97% of the tokens to one expert. a = silu(x @ gate.T) *
  (x @ up.T) [T, F] are the neurons' activations.
- Experts: balanced spherical k-means groups neurons that fire together: a neuron is its
  unit-norm pattern |a[:, n]| over the tokens, and every cluster gets exactly F/E neurons.
- Router: per expert, a ridge least-squares fit (no bias: GGUF routers have none) of its mass
  m = sum of |a| over its neurons, divided by mean(m) ** balance over the tokens. balance 0 ranks
  experts by raw mass, which keeps the most of the FFN, but the expert holding the always-on
  neurons then wins nearly every token (in the average layer one expert is in 82% of the tokens'
  top-2); balance 1 (default) ranks them by mass relative to their usual mass, as balanced as
  trained routers (the busiest expert takes 37% of the tokens in the average layer, 56% at most).
  Both on the calibration text, top-2 of 8.
- Weights: llama renormalises the chosen top-k softmax weights to sum to 1, so the MoE FFN is
  sum_j w_j * expert_j(x) where the dense FFN is the plain sum over all experts. Router logits
  are scaled to a standard deviation of ROUTER_LOGIT_STD over the calibration tokens, so that
  w_j is within 0.4% of 1/k for 99% of the tokens (a positive scale keeps the ranking), and
  each expert's down projection is scaled by k: the output approximates the plain sum of the
  chosen experts, and with k = E the dense FFN itself.
- Quantization: gate and up rows are the source's rows of the expert's neurons, copied bit for bit
  (every ggml type packs a row on its own). Down's blocks run along the F neurons, so an expert's
  columns are not whole blocks. Clustering whole 32-neuron blocks would keep them, but the
  source's neuron order is arbitrary: block clusters left 0.74 of the dense FFN output's norm as
  error against neuron clusters' 0.685 (top-2 of 8, the best experts per token, held-out text,
  every third layer). So down is dequantized, sliced, scaled by k and written as Q8_0, whose
  rounding is ~1/17 of a Q4_1 step.
Attention, norms, embeddings and output are copied verbatim, as are all metadata entries but
feed_forward_length (now the expert width), the added expert_count and expert_used_count, and
general.name (marked as MoEfied).

Quality: SmolLM2's SwiGLU activations are dense, so without fine-tuning a top-2 of 8 model is no
language model any more. Perplexity of benchmarks/quality_text.txt (tierflow): dense 28.0; top-8
of 8 28.0; top-4 925 (balance 0: 210); top-2 33000 (balance 0: 2800). Traces come from real text
through real weights, but a deep layer's inputs are those of a broken model.

    write_moe_from_dense(bundled_model_path(), tmp_path / "moe.gguf", num_experts=8, experts_used=2)

    python -m tests.support.make_moe_from_dense OUT.gguf [--experts 8] [--experts-used 2] [--balance 1]
                                                 [--source SRC] [--calibration TEXT_FILE]

About 16 s for SmolLM2 on one core.
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
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from tests.support.gguf_bytes import STRING, UINT32, Typed, pack_kv
from tests.support.gguf_writing import TensorEntry, encoded_kvs, write_gguf
from tests.support.model_spec import MAX_EXPERTS
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.cpu_kernels.torch_ops import apply_rope, rms_norm_reference
from tierflow.errors import TierflowError
from tierflow.offload.gguf.model_file import read_config
from tierflow.offload.gguf.reader import GGUFFile, TensorInfo, read_gguf
from tierflow.offload.store.model_path import bundled_model_path
from tierflow.runtime.decoder.rope import rope_tables
from tierflow.runtime.models.config import ModelConfig
from tierflow.runtime.text.tokenizer import Tokenizer

__all__ = ["CALIBRATION_TEXT", "MoELayer", "fit_experts", "main", "write_moe_from_dense"]

CALIBRATION_TEXT = Path(__file__).with_name("moe_calibration.txt")
ROUTER_LOGIT_STD = 1e-3  # w_j within 0.4% of 1/k. At 1e-2 they spread 3% and moved a k = E
                         # model's first token (massive activations) by 11 logits; at 1e-4 top-k
                         # gaps neared float32 rounding, and tierflow and llama.cpp (both float32)
                         # routed a token of 64 apart
RIDGE = 1e-2             # router fit: ridge strength relative to the mean eigenvalue of x.T @ x
KMEANS_ROUNDS = 20       # at most; the clusters usually settle in under 10
DOWN_TYPE = GGMLQuantizationType.Q8_0
F32 = GGMLQuantizationType.F32


def write_moe_from_dense(source: str | os.PathLike, dest: str | os.PathLike, num_experts: int = 8,
                         experts_used: int = 2, calibration_text: str | None = None,
                         threads: int = 1, balance: float = 1.0) -> Path:
    """Write the MoEfied version of the dense llama GGUF `source` to `dest` (see the module doc).

    calibration_text defaults to moe_calibration.txt (a few thousand tokens at most: attention
    runs over all of it at once); threads is torch's thread count while the experts are fit;
    balance (0 to 1) trades how much of the FFN the chosen experts keep for balanced routing.
    The same inputs give the same bytes."""
    source, dest = Path(source), Path(dest)
    if dest.resolve() == source.resolve():
        raise ValueError(f"{source}: the MoE file cannot overwrite its source")
    if not 0 <= balance <= 1:
        raise ValueError(f"balance must be between 0 and 1, got {balance}")
    with read_gguf(source) as model:
        expert_width = _check_source(model, num_experts, experts_used)
        with Tokenizer.from_gguf(source) as tokenizer:
            ids = tokenizer.encode(CALIBRATION_TEXT.read_text() if calibration_text is None
                                   else calibration_text)
        layers = fit_experts(model, ids, num_experts, experts_used, balance, threads)
        kvs = _moe_kvs(model, num_experts, experts_used, expert_width)
        tensors = list(_moe_tensors(model, layers, experts_used))
        return write_gguf(dest, kvs, [entry for entry, _ in tensors], (data() for _, data in tensors),
                          model.alignment)


def _check_source(model: GGUFFile, num_experts: int, experts_used: int) -> int:
    """The expert width, once the source is a dense llama whose FFN splits into num_experts."""
    arch = model.metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{model.path}: MoEfication needs a dense 'llama' model, not {arch!r}")
    _, config = read_config(model)
    if config.num_experts or "blk.0.ffn_gate_inp.weight" in model.tensors:
        raise ValueError(f"{model.path}: already a mixture-of-experts model, not a dense one")
    if not 2 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be between 2 and {MAX_EXPERTS}, got {num_experts}")
    if not 1 <= experts_used <= num_experts:
        raise ValueError(f"experts_used must be between 1 and num_experts {num_experts}, "
                         f"got {experts_used}")
    ffn_size = config.ffn_size
    block_size = GGML_QUANT_SIZES[DOWN_TYPE][0]
    if ffn_size % num_experts or (ffn_size // num_experts) % block_size:
        raise ValueError(f"num_experts {num_experts} must split the FFN width {ffn_size} into "
                         f"experts of a multiple of {block_size} neurons (Q8_0 down rows)")
    return ffn_size // num_experts


# ---------------------------------------------------------------------------------------------
# Calibration: the model, layer by layer, on real text


@dataclasses.dataclass(frozen=True)
class MoELayer:
    experts: np.ndarray  # int64 [E, F/E]: each expert's neurons, ascending
    router: np.ndarray   # float32 [E, H]: logits = x @ router.T


@torch.inference_mode()
def fit_experts(model: GGUFFile, ids: list[int], num_experts: int, experts_used: int,
                balance: float = 1.0, threads: int = 1) -> list[MoELayer]:
    """Each layer's experts and router, fit on the tokens `ids` layer by layer as the MoE model
    built so far computes them (see the module doc): one float32 torch pass, all tokens at once."""
    config, previous_threads = read_config(model)[1], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h = _embedding_rows(model, ids)  # [T, H], the residual stream
        freq_factors = _tensor(model, "rope_freqs.weight") if "rope_freqs.weight" in model.tensors else None
        cos, sin = rope_tables(config, len(ids), freq_factors)
        eps, layers = config.rms_norm_eps, []
        for layer_idx in range(config.num_layers):
            prefix = f"blk.{layer_idx}."
            h += _attention(model, config, prefix, h, cos, sin)
            x = rms_norm_reference(h, _tensor(model, prefix + "ffn_norm.weight"), eps)  # [T, H]
            gate, up = _tensor(model, prefix + "ffn_gate.weight"), _tensor(model, prefix + "ffn_up.weight")
            acts = F.silu(x @ gate.T) * (x @ up.T)  # [T, F]
            layers.append(_fit_layer(x.numpy(), acts.abs().numpy(), num_experts, balance, seed=layer_idx))
            h += _routed(x, acts, layers[-1], experts_used) @ _tensor(model, prefix + "ffn_down.weight").T
        return layers
    finally:
        torch.set_num_threads(previous_threads)


def _tensor(model: GGUFFile, name: str) -> torch.Tensor:
    return torch.from_numpy(_dequantized(model, name))  # float32, numpy order ([out, in])


def _embedding_rows(model: GGUFFile, ids: list[int]) -> torch.Tensor:
    """token_embd's rows for `ids` [T, H], dequantizing only those."""
    info = model.tensors["token_embd.weight"]
    rows = model.tensor_data(info.name).reshape(info.shape[1], -1)[ids]  # [T, row bytes]
    return torch.from_numpy(dequantize(rows.ravel(), info.ggml_type, (info.shape[0], len(ids))))


def _attention(model: GGUFFile, config: ModelConfig, prefix: str, h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of a llama block, attn_norm included: h [T, H] -> [T, H]."""
    x = rms_norm_reference(h, _tensor(model, prefix + "attn_norm.weight"), config.rms_norm_eps)
    heads = {}  # name -> [heads, T, D]
    for name, count in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads)):
        projected = x @ _tensor(model, f"{prefix}attn_{name}.weight").T  # [T, heads * D]
        heads[name] = projected.unflatten(-1, (count, -1)).transpose(0, 1)
    q, k = (apply_rope(heads[name], cos, sin, config.rope_style) for name in ("q", "k"))
    out = F.scaled_dot_product_attention(q, k, heads["v"], is_causal=True, enable_gqa=True)  # [H, T, D]
    return out.transpose(0, 1).flatten(1) @ _tensor(model, prefix + "attn_output.weight").T


def _routed(x: torch.Tensor, acts: torch.Tensor, layer: MoELayer, experts_used: int) -> torch.Tensor:
    """acts [T, F] with every neuron outside the token's top-k experts zeroed: what the MoE file
    computes, its chosen weights (~1/k) times k aside."""
    chosen = (x @ torch.from_numpy(layer.router).T).topk(experts_used).indices  # [T, k]
    picked = torch.zeros(len(x), len(layer.experts), dtype=torch.bool).scatter_(1, chosen, True)  # [T, E]
    owner = np.empty(layer.experts.size, np.int64)  # [F]: each neuron's expert
    owner[layer.experts] = np.arange(len(layer.experts))[:, None]
    return acts * picked[:, torch.from_numpy(owner)]


def _fit_layer(x: np.ndarray, acts: np.ndarray, num_experts: int, balance: float, seed: int) -> MoELayer:
    """Experts and router from a layer's FFN inputs x [T, H] and neuron activations |a| [T, F]."""
    experts = _cluster_neurons(acts, num_experts, seed)
    mass = acts[:, experts].sum(axis=-1)  # [T, E]
    return MoELayer(experts, _fit_router(x, mass / mass.mean(axis=0) ** balance))


def _cluster_neurons(acts: np.ndarray, num_experts: int, seed: int) -> np.ndarray:
    """Balanced spherical k-means of the neurons' activation patterns acts [T, F]: neuron ids
    [E, F/E], so that an expert's neurons fire for similar tokens."""
    patterns = acts.T / (np.linalg.norm(acts.T, axis=1, keepdims=True) + 1e-12)  # [F, T]
    rng = np.random.default_rng(seed)
    centroids = patterns[rng.choice(len(patterns), num_experts, replace=False)]  # [E, T]
    labels = None
    for _ in range(KMEANS_ROUNDS):
        new_labels = _balanced_assign(patterns @ centroids.T)
        if labels is not None and np.array_equal(new_labels, labels):
            break
        labels = new_labels
        centroids = np.eye(num_experts, dtype=np.float32)[labels].T @ patterns  # [E, T], summed
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return np.argsort(labels, kind="stable").reshape(num_experts, -1)


def _balanced_assign(scores: np.ndarray) -> np.ndarray:
    """Each of F neurons to one of E clusters, F/E per cluster, from similarities [F, E]: neurons
    propose to their preferred clusters in turn and a full cluster keeps its most similar ones
    (deferred acceptance, so no neuron and cluster would both rather be together)."""
    num_neurons, num_clusters = scores.shape
    capacity = num_neurons // num_clusters
    preferences = np.argsort(-scores, axis=1)  # [F, E]
    proposals = np.zeros(num_neurons, np.int64)  # how many clusters each neuron has asked
    labels = np.full(num_neurons, -1)
    while (free := np.flatnonzero(labels < 0)).size:
        labels[free] = preferences[free, proposals[free]]
        proposals[free] += 1
        for cluster in np.unique(labels[free]):
            members = np.flatnonzero(labels == cluster)
            labels[members[np.argsort(-scores[members, cluster])[capacity:]]] = -1
    return labels


def _fit_router(x: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Router [E, H] whose logits x @ router.T rank experts as target [T, E] does, at
    ROUTER_LOGIT_STD. Softmax ignores a token's common shift, so the fit is to target centred
    per token; there is no bias (GGUF routers have none)."""
    target = target - target.mean(axis=1, keepdims=True)
    gram = x.T.astype(np.float64) @ x  # [H, H]
    ridge = RIDGE * np.trace(gram) / len(gram)
    weights = np.linalg.solve(gram + ridge * np.eye(len(gram)), x.T @ target)  # [H, E]
    logits = x @ weights
    logits -= logits.mean(axis=1, keepdims=True)
    return (weights.T * (ROUTER_LOGIT_STD / logits.std())).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The file


def _moe_kvs(model: GGUFFile, num_experts: int, experts_used: int, expert_width: int) -> list[bytes]:
    """The source's entries verbatim, but the FFN width, the expert counts after it, and the name."""
    kvs = {}
    for key, entry in encoded_kvs(model.path).items():
        if key == "llama.feed_forward_length":
            kvs[key] = pack_kv(key, Typed(UINT32, expert_width))
            for name, value in (("expert_count", num_experts), ("expert_used_count", experts_used)):
                kvs[f"llama.{name}"] = pack_kv(f"llama.{name}", Typed(UINT32, value))
        else:
            kvs[key] = entry
    name = f"{model.metadata.get('general.name', model.path.stem)} MoEfied {num_experts}e{experts_used}"
    kvs["general.name"] = pack_kv("general.name", Typed(STRING, name))
    return list(kvs.values())


TensorMaker = tuple[TensorEntry, Callable[[], np.ndarray]]  # a header entry, and its data on demand


def _moe_tensors(model: GGUFFile, layers: list[MoELayer], experts_used: int) -> Iterator[TensorMaker]:
    """The source's tensors in its order, each dense FFN matrix replaced by its expert stack (and
    the gate by the router, then the gate stack). Data is made as the writer asks: one tensor at
    a time in memory."""
    for info in model.tensors.values():
        prefix, _, kind = info.name.rpartition(".ffn_")
        if kind in ("gate.weight", "up.weight", "down.weight"):
            yield from _expert_tensors(model, info, layers[int(prefix.removeprefix("blk."))], experts_used)
        else:
            yield TensorEntry(info.name, info.shape, info.ggml_type), partial(model.tensor_data, info.name)


def _expert_tensors(model: GGUFFile, info: TensorInfo, layer: MoELayer, experts_used: int
                    ) -> list[TensorMaker]:
    """What replaces the dense FFN matrix `info` (GGUF shapes: gate, up (H, F); down (F, H))."""
    num_experts, width = layer.experts.shape
    prefix, _, kind = info.name.removesuffix(".weight").rpartition(".ffn_")
    if kind == "down":
        entry = TensorEntry(f"{prefix}.ffn_down_exps.weight", (width, info.shape[1], num_experts), DOWN_TYPE)
        return [(entry, partial(_down_stack, model, info.name, layer.experts, experts_used))]
    entry = TensorEntry(f"{prefix}.ffn_{kind}_exps.weight", (info.shape[0], width, num_experts),
                        info.ggml_type)
    stack = (entry, partial(_row_stack, model, info.name, layer.experts))
    if kind == "up":
        return [stack]
    router = TensorEntry(f"{prefix}.ffn_gate_inp.weight", layer.router.shape[::-1], F32)
    return [(router, lambda: layer.router), stack]


def _row_stack(model: GGUFFile, name: str, experts: np.ndarray) -> np.ndarray:
    """Gate or up [F, H] as the stack [E, F/E, H] of its experts' rows, bit for bit: uint8
    [E, F/E, row bytes] (every ggml type packs each row on its own)."""
    rows = model.tensor_data(name).reshape(model.tensors[name].shape[1], -1)  # [F, row bytes]
    return rows[experts]


def _down_stack(model: GGUFFile, name: str, experts: np.ndarray, experts_used: int) -> np.ndarray:
    """Down [H, F] as the Q8_0 stack [E, H, F/E] of its experts' columns times k."""
    down = _dequantized(model, name)  # [H, F]
    stack = np.stack([down[:, neurons] for neurons in experts]) * np.float32(experts_used)
    return quantize(stack, DOWN_TYPE)


def _dequantized(model: GGUFFile, name: str) -> np.ndarray:
    info = model.tensors[name]
    return dequantize(model.tensor_data(name), info.ggml_type, info.shape)


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a Mixtral-style MoE GGUF made from a dense "
                                     "llama one by MoEfication.")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--source", type=Path, help="the dense llama GGUF (default: the bundled SmolLM2)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    parser.add_argument("--experts-used", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--balance", type=float, default=1.0, help="0: route by the experts' raw "
                        "activation mass; 1 (default): by mass relative to their mean, balanced")
    parser.add_argument("--calibration", type=Path, help="a text file to calibrate on (default: "
                        f"{CALIBRATION_TEXT.name})")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        text = args.calibration.read_text() if args.calibration else None
        path = write_moe_from_dense(args.source or bundled_model_path(), args.out, args.experts,
                                    args.experts_used, text, balance=args.balance)
    except (OSError, ValueError, TierflowError) as error:
        sys.exit(f"make_moe_from_dense: {error}")
    print(f"{path} {path.stat().st_size} bytes, {args.experts} experts, top-{args.experts_used}, "
          f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
