"""Writes GGUF models that llama.cpp loads and runs: random ones, and F32 copies of real ones.

Tests and benchmarks need models other than the bundled SmolLM2: a `qwen2` one for the oracle
test, `llama` ones of several GB for streaming, mixture-of-experts ones (Mixtral-style `llama`,
`qwen2moe`, `olmoe`) for expert offloading. Nothing may be downloaded, so this writes them:
the SmolLM2 tokenizer (all `tokenizer.*` keys, 49152 tokens and its chat template), the
architecture metadata llama.cpp reads, and random but numerically sane weights, so a forward
pass gives finite logits with a clear argmax and llama.cpp can serve as the oracle.

`write_f32_copy` dequantizes every tensor of a GGUF file to F32. On such a file llama.cpp keeps
activations in F32 (it rounds them to 8 bits only to meet quantized weights), and with an F32 KV
cache (`Llama(..., type_k=0, type_v=0)`; the default is F16) it is an exact oracle for a decoder
that dequantizes the original's weights.

    spec = ModelSpec(arch="qwen2", num_layers=2, hidden_size=64)
    write_model(tmp_path / "m.gguf", spec)
    write_model("big.gguf", spec_for_size(2 * 10**9))
    write_model(tmp_path / "moe.gguf", ModelSpec(arch="olmoe", num_experts=4, num_kv_heads=4))
    write_model("moe.gguf", spec_for_size(2 * 10**9, num_experts=8, experts_used=2))
    write_f32_copy(bundled_model_path(), tmp_path / "smollm2-f32.gguf")

    python -m tests.support.make_model OUT.gguf --arch qwen2 --layers 4 --hidden 256
    python -m tests.support.make_model OUT.gguf --size 2GB
    python -m tests.support.make_model OUT.gguf --arch qwen2moe --experts 8 --expert-ffn 64
    python -m tests.support.make_model OUT.gguf --arch gemma3 --layers 6 --sliding-window 32
    python -m tests.support.make_model OUT.gguf --arch gemma3 --hidden 640 --weight-type Q4_K_M
    python -m tests.support.make_model OUT.gguf --size 2GB --experts 8 --experts-used 2
    python -m tests.support.make_model OUT.gguf --f32-copy-of SRC.gguf

Files are written tensor by tensor: peak memory is a few times the largest tensor (the
embedding, or a layer's stack of experts), never the whole model; a 2 GB Q8_0 model takes
~10 s. The same spec and seed always give the same bytes. `file_bytes` gives a spec's file
size without writing it.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from tests.support.gguf_bytes import UINT32, Typed, pack_kv
from tests.support.gguf_writing import TensorEntry, encoded_kvs, file_size, write_gguf
from tests.support.model_spec import ARCHS, FILE_TYPES, MIXES, ModelSpec, architecture_metadata, tensor_plan
from tests.support.random_weights import random_tensor_bytes
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.errors import TierflowError
from tierflow.offload.gguf.reader import read_gguf
from tierflow.offload.store.model_path import bundled_model_path
from tierflow.units import format_size, parse_size

__all__ = ["ModelSpec", "file_bytes", "main", "spec_for_size", "write_f32_copy", "write_model"]


@functools.cache
def _tokenizer() -> tuple[tuple[bytes, ...], int]:
    """The bundled model's tokenizer.* entries, encoded, and its vocabulary size."""
    path = bundled_model_path()
    with read_gguf(path) as model:
        vocab_size = len(model.metadata["tokenizer.ggml.tokens"])
    entries = tuple(entry for key, entry in encoded_kvs(path).items()
                    if key.startswith("tokenizer."))
    return entries, vocab_size


def _vocab_size(spec: ModelSpec) -> int:
    """The embedding's rows: spec.vocab_size, or the tokenizer's tokens."""
    tokens = _tokenizer()[1]
    if spec.vocab_size is None:
        return tokens
    if spec.vocab_size < tokens:
        raise ValueError(f"vocab_size {spec.vocab_size} cannot hold the tokenizer's {tokens} tokens")
    return spec.vocab_size


def _kvs(spec: ModelSpec) -> list[bytes]:
    tokenizer = _tokenizer()[0]
    return [pack_kv(key, value) for key, value in architecture_metadata(spec, _vocab_size(spec))
            ] + list(tokenizer)


def write_model(path: str | os.PathLike, spec: ModelSpec) -> Path:
    """Write the GGUF file for `spec` to `path`, one tensor in memory at a time."""
    plan = tensor_plan(spec, _vocab_size(spec))
    rng = np.random.default_rng(spec.seed)
    data = (random_tensor_bytes(rng, t.qtype, t.shape, t.std, t.mean, t.values) for t in plan)
    return write_gguf(path, _kvs(spec), [tensor.entry for tensor in plan], data)


def file_bytes(spec: ModelSpec) -> int:
    """The exact size of write_model's file for `spec`, without writing it."""
    return file_size(_kvs(spec), [tensor.entry for tensor in tensor_plan(spec, _vocab_size(spec))])


def write_f32_copy(source: str | os.PathLike, dest: str | os.PathLike,
                   change: Callable[[str, np.ndarray], np.ndarray] | None = None) -> Path:
    """Copy the GGUF file `source` to `dest` with every tensor dequantized to F32 (and passed
    through `change(name, values)` when given: values as numpy holds them, ne0 last).

    Metadata entries are copied byte for byte, types included, except general.file_type, which
    becomes ALL_F32 (added if missing); tensors keep their names, shapes, order and the source's
    alignment. Peak memory is about one tensor in float32."""
    if Path(dest).resolve() == Path(source).resolve():
        raise ValueError(f"{source}: an F32 copy cannot overwrite its source")
    with read_gguf(source) as model:
        kvs = encoded_kvs(source)
        kvs["general.file_type"] = pack_kv("general.file_type",
                                           Typed(UINT32, LlamaFileType.ALL_F32))
        infos = list(model.tensors.values())
        entries = [TensorEntry(info.name, info.shape, GGMLQuantizationType.F32) for info in infos]
        data = (dequantize(model.tensor_data(info.name), info.ggml_type, info.shape) for info in infos)
        if change is not None:
            data = (change(info.name, values).astype(np.float32) for info, values in zip(infos, data))
        return write_gguf(dest, list(kvs.values()), entries, data, model.alignment)


# ---------------------------------------------------------------------------------------------
# Sizing

_WIDTHS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192)
_MIN_LAYERS = 16  # streaming work wants many layers; widen only while this many still fit
_FFN_STEP = 256   # keeps ffn_size a multiple of every block size, K-quants included
_SHAPE_FIELDS = {"num_layers", "hidden_size", "ffn_size", "num_heads", "num_kv_heads", "head_size",
                 "expert_ffn_size", "shared_expert_ffn_size"}


def _ffn_step(spec: ModelSpec) -> int:
    """ffn_size's step. MoE layers grow num_experts times faster with it, so theirs is finer:
    32 (every legacy block size), or a K-quant's 256."""
    if not spec.num_experts or spec.weight_type in MIXES:
        return _FFN_STEP
    return max(32, GGML_QUANT_SIZES[GGMLQuantizationType[spec.weight_type]][0])


def _num_kv_heads(num_heads: int, overrides: dict[str, Any]) -> int:
    """A quarter of the heads, or all of them where llama.cpp allows no GQA (olmoe)."""
    traits = ARCHS.get(overrides.get("arch", ModelSpec.arch))
    return num_heads if traits and traits.no_gqa else max(1, num_heads // 4)


def _spec_of_width(num_bytes: int, width: int, overrides: dict[str, Any]) -> ModelSpec:
    """The `width`-wide spec closest to `num_bytes`: layers first, then ffn_size for the rest.

    File size is linear in num_layers and, per layer, in ffn_size (up to a few bytes of layer
    numbers in tensor names), so three small files' sizes give the coefficients. MoE experts
    are ffn_size wide, so ffn_size scales them (and qwen2moe's shared expert) too."""
    head_dim = 64 if width < 2048 else 128
    num_heads = width // head_dim
    spec = ModelSpec(**overrides, hidden_size=width, num_heads=num_heads,
                     num_kv_heads=_num_kv_heads(num_heads, overrides), num_layers=1,
                     ffn_size=_FFN_STEP * max(1, round(8 * width / 3 / _FFN_STEP)))
    step = _ffn_step(spec)
    one_layer = file_bytes(spec)
    layer_bytes = file_bytes(replace(spec, num_layers=2)) - one_layer
    step_bytes = file_bytes(replace(spec, ffn_size=spec.ffn_size + step)) - one_layer
    fixed_bytes = one_layer - layer_bytes
    num_layers = max(1, round((num_bytes - fixed_bytes) / layer_bytes))
    steps = round((num_bytes - fixed_bytes - num_layers * layer_bytes) / (num_layers * step_bytes))
    return replace(spec, num_layers=num_layers, ffn_size=max(step, spec.ffn_size + steps * step))


def spec_for_size(num_bytes: int, **overrides: Any) -> ModelSpec:
    """A spec (llama unless `overrides` say otherwise) whose file is about `num_bytes` (within
    ~2% from ~20 MB up): the widest of _WIDTHS that still gets _MIN_LAYERS layers. `overrides`
    set any field but the shape; num_experts and experts_used make it a MoE model."""
    if _SHAPE_FIELDS & overrides.keys():
        raise ValueError(f"spec_for_size chooses {sorted(_SHAPE_FIELDS & overrides.keys())} "
                         "itself")
    specs = [_spec_of_width(num_bytes, width, overrides) for width in _WIDTHS]
    deep_enough = [spec for spec in specs if spec.num_layers >= _MIN_LAYERS]
    return deep_enough[-1] if deep_enough else specs[0]


# ---------------------------------------------------------------------------------------------
# Command line

_OPTIONS = {  # flag -> (ModelSpec field, argparse keywords)
    "--arch": ("arch", {"choices": sorted(ARCHS)}),
    "--layers": ("num_layers", {"type": int}),
    "--hidden": ("hidden_size", {"type": int}),
    "--ffn": ("ffn_size", {"type": int}),
    "--experts": ("num_experts", {"type": int}),
    "--experts-used": ("experts_used", {"type": int}),
    "--expert-ffn": ("expert_ffn_size", {"type": int}),
    "--shared-expert-ffn": ("shared_expert_ffn_size", {"type": int}),
    "--heads": ("num_heads", {"type": int}),
    "--kv-heads": ("num_kv_heads", {"type": int}),
    "--head-size": ("head_size", {"type": int}),
    "--context": ("context_length", {"type": int}),
    "--rope-theta": ("rope_theta", {"type": float}),
    "--rope-scaling": ("rope_scaling", {"choices": ["linear", "yarn"]}),
    "--rope-scaling-factor": ("rope_scaling_factor", {"type": float}),
    "--llama3-rope-freqs": ("llama3_rope_freqs", {"action": "store_const", "const": True}),
    "--untied": ("tied_embeddings", {"action": "store_const", "const": False}),
    "--sliding-window": ("sliding_window", {"type": int}),
    "--attn-softcap": ("attn_logit_softcap", {"type": float}),
    "--final-softcap": ("final_logit_softcap", {"type": float}),
    "--weight-type": ("weight_type", {"choices": sorted(FILE_TYPES | MIXES)}),
    "--embedding-type": ("embedding_type", {"choices": sorted(FILE_TYPES | MIXES)}),
    "--seed": ("seed", {"type": int}),
}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Write a GGUF model with random weights, or "
                                     "an F32 copy of a GGUF model.")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--size", help="pick a shape whose file has about this size (e.g. "
                        "2GB); excludes the shape options but --experts and --experts-used")
    parser.add_argument("--f32-copy-of", type=Path, metavar="SRC", help="write SRC with every "
                        "tensor dequantized to F32; excludes all other options")
    for flag, (field, keywords) in _OPTIONS.items():
        parser.add_argument(flag, dest=field, default=None, **keywords)
    return parser.parse_args(argv)


def _write(args: argparse.Namespace) -> tuple[Path, ModelSpec | None]:
    """The file the arguments ask for, and its spec (None for an F32 copy)."""
    given = {field: getattr(args, field) for field, _ in _OPTIONS.values()
             if getattr(args, field) is not None}
    if args.f32_copy_of is not None:
        if given or args.size:
            raise ValueError("--f32-copy-of takes no other option")
        return write_f32_copy(args.f32_copy_of, args.out), None
    spec = spec_for_size(parse_size(args.size), **given) if args.size else ModelSpec(**given)
    return write_model(args.out, spec), spec


def main(argv: list[str] | None = None) -> None:
    try:
        path, spec = _write(_parse_args(argv))
    except (ValueError, TierflowError) as error:  # bad options, size or source file
        sys.exit(f"make_model: {error}")
    size = path.stat().st_size
    print(f"{path} {size} bytes ({format_size(size)})")
    if spec is not None:
        print(spec)


if __name__ == "__main__":
    main()
