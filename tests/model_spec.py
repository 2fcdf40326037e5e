"""What make_model generates: the spec, and the tensors and architecture metadata it stands for.

Pure layout, no I/O: the vocabulary size comes in as an argument (make_model takes it, with the
tokenizer, from the bundled SmolLM2 file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf_bytes import FLOAT32, STRING, UINT32, Typed
from gguf_writing import TensorEntry

Q = GGMLQuantizationType
FILE_TYPES = {  # weight type name -> general.file_type
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}


@dataclass(frozen=True)
class _ArchTraits:
    qkv_bias: bool    # attn_q/k/v carry a bias (qwen2)
    rope_freqs: bool  # llama.cpp accepts a rope_freqs.weight tensor for this arch


ARCHS = {"llama": _ArchTraits(qkv_bias=False, rope_freqs=True),
         "qwen2": _ArchTraits(qkv_bias=True, rope_freqs=False)}


@dataclass(frozen=True)
class ModelSpec:
    """What to generate. Validated so that every spec gives a file llama.cpp loads."""

    arch: str = "llama"              # a key of ARCHS
    num_layers: int = 2
    hidden_size: int = 64
    ffn_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    context_length: int = 256
    rope_theta: float = 10000.0
    rope_scaling: str | None = None  # None, "linear" or "yarn" (writes {arch}.rope.scaling.*)
    rope_scaling_factor: float = 1.0
    llama3_rope_freqs: bool = False  # add rope_freqs.weight with llama3-style factors (llama)
    tied_embeddings: bool = True     # no output.weight: llama.cpp reuses token_embd
    weight_type: str = "Q8_0"        # every 2-D matrix, output.weight included; see FILE_TYPES
    embedding_type: str = "Q8_0"     # token_embd.weight
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, not {self.arch!r}")
        for name in ("num_layers", "hidden_size", "ffn_size", "num_heads", "num_kv_heads",
                     "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.head_dim % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must split into {self.num_heads} "
                             "heads of even size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        self._check_rope()
        for field, row_lengths in (("weight_type", (self.hidden_size, self.ffn_size)),
                                   ("embedding_type", (self.hidden_size,))):
            self._check_type(field, row_lengths)

    def _check_rope(self) -> None:
        if self.rope_scaling not in (None, "linear", "yarn"):
            raise ValueError(f"rope_scaling must be None, 'linear' or 'yarn', not "
                             f"{self.rope_scaling!r}")
        if self.rope_scaling is None and self.rope_scaling_factor != 1.0:
            raise ValueError("rope_scaling_factor needs rope_scaling set")
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"rope_scaling_factor must be positive, got "
                             f"{self.rope_scaling_factor}")
        if self.llama3_rope_freqs and not ARCHS[self.arch].rope_freqs:
            raise ValueError(f"llama.cpp reads no rope_freqs tensor for arch {self.arch!r}")

    def _check_type(self, field: str, row_lengths: tuple[int, ...]) -> None:
        name = getattr(self, field)
        if name not in FILE_TYPES:
            raise ValueError(f"{field} must be one of {sorted(FILE_TYPES)}, not {name!r}")
        block_size = GGML_QUANT_SIZES[Q[name]][0]
        if any(length % block_size for length in row_lengths):
            raise ValueError(f"{field} {name} packs rows in blocks of {block_size}: row lengths "
                             f"{row_lengths} do not divide")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_size(self) -> int:
        """Width of the K and V projections (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim


# Matrices get std gain/sqrt(fan_in), so that with unit-RMS inputs their outputs have std ~gain.
# token_embd/output: logits std ~_LOGIT_GAIN, tied or not, so the top logits stand apart.
# attn_output/ffn_down write into the residual stream _RESIDUAL_GAIN times louder, so that by the
# final norm a token's own embedding is a small part of the stream: with tied embeddings its
# logit would otherwise win by ~sqrt(hidden) standard deviations, every argmax would echo the
# input token, and an oracle comparing argmaxes would pass even with broken layers.
_LOGIT_GAIN = 8.0
_RESIDUAL_GAIN = 3.0
_NORM_STD = 0.1       # norm weights are 1 + N(0, _NORM_STD)
_BIAS_STD = 0.5       # large enough that a dropped q/k/v bias changes the argmax


class PlannedTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order, (rows, row_length); GGUF lists it reversed
    qtype: GGMLQuantizationType
    std: float
    mean: float = 0.0
    values: np.ndarray | None = None  # fixed contents instead of random ones

    @property
    def entry(self) -> TensorEntry:
        return TensorEntry(self.name, self.shape[::-1], self.qtype)


def _matrix(name: str, rows: int, row_length: int, type_name: str, gain: float = 1.0
            ) -> PlannedTensor:
    return PlannedTensor(name, (rows, row_length), Q[type_name], gain / math.sqrt(row_length))


def _norm(name: str, size: int) -> PlannedTensor:
    return PlannedTensor(name, (size,), Q.F32, _NORM_STD, mean=1.0)


def _layer_plan(spec: ModelSpec, layer_idx: int) -> list[PlannedTensor]:
    h, w, prefix = spec.hidden_size, spec.weight_type, f"blk.{layer_idx}."
    plan = [_norm(prefix + "attn_norm.weight", h)]
    for name, rows in (("attn_q", h), ("attn_k", spec.kv_size), ("attn_v", spec.kv_size)):
        plan.append(_matrix(f"{prefix}{name}.weight", rows, h, w))
        if ARCHS[spec.arch].qkv_bias:
            plan.append(PlannedTensor(f"{prefix}{name}.bias", (rows,), Q.F32, _BIAS_STD))
    return plan + [
        _matrix(prefix + "attn_output.weight", h, h, w, _RESIDUAL_GAIN),
        _norm(prefix + "ffn_norm.weight", h),
        _matrix(prefix + "ffn_gate.weight", spec.ffn_size, h, w),
        _matrix(prefix + "ffn_up.weight", spec.ffn_size, h, w),
        _matrix(prefix + "ffn_down.weight", h, spec.ffn_size, w, _RESIDUAL_GAIN),
    ]


def _llama3_rope_factors(spec: ModelSpec) -> np.ndarray:
    """Llama 3.1's per-frequency divisors (factor 8, low 1, high 4), with the spec's context as
    the original one so that small test models get a mix of scaled and unscaled frequencies."""
    factor, low_freq_factor, high_freq_factor = 8.0, 1.0, 4.0
    exponents = np.arange(0, spec.head_dim, 2, dtype=np.float64) / spec.head_dim
    wavelengths = 2 * np.pi * spec.rope_theta ** exponents
    smooth = (spec.context_length / wavelengths - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelengths < spec.context_length / high_freq_factor, 1.0,
                       np.where(wavelengths > spec.context_length / low_freq_factor, factor,
                                blended))
    return factors.astype(np.float32)


def tensor_plan(spec: ModelSpec, vocab_size: int) -> list[PlannedTensor]:
    """The model's tensors in file order, with llama.cpp's names."""
    plan = [_matrix("token_embd.weight", vocab_size, spec.hidden_size, spec.embedding_type,
                    _LOGIT_GAIN)]
    if spec.llama3_rope_freqs:
        factors = _llama3_rope_factors(spec)
        plan.append(PlannedTensor("rope_freqs.weight", factors.shape, Q.F32, 0.0, values=factors))
    for layer_idx in range(spec.num_layers):
        plan += _layer_plan(spec, layer_idx)
    plan.append(_norm("output_norm.weight", spec.hidden_size))
    if not spec.tied_embeddings:
        plan.append(_matrix("output.weight", vocab_size, spec.hidden_size, spec.weight_type,
                            _LOGIT_GAIN))
    return plan


def architecture_metadata(spec: ModelSpec, vocab_size: int) -> list[tuple[str, Typed]]:
    """The general.* and {arch}.* keys llama.cpp reads (the tokenizer keys come separately)."""
    arch = spec.arch

    def u32(value: int) -> Typed:
        return Typed(UINT32, value)

    def f32(value: float) -> Typed:
        return Typed(FLOAT32, value)

    metadata = [
        ("general.architecture", Typed(STRING, arch)),
        ("general.name", Typed(STRING, f"tierflow-random-{arch}-{spec.num_layers}x"
                                       f"{spec.hidden_size}")),
        ("general.file_type", u32(FILE_TYPES[spec.weight_type])),
        ("general.quantization_version", u32(gguf.GGML_QUANT_VERSION)),
        (f"{arch}.vocab_size", u32(vocab_size)),
        (f"{arch}.block_count", u32(spec.num_layers)),
        (f"{arch}.context_length", u32(spec.context_length)),
        (f"{arch}.embedding_length", u32(spec.hidden_size)),
        (f"{arch}.feed_forward_length", u32(spec.ffn_size)),
        (f"{arch}.attention.head_count", u32(spec.num_heads)),
        (f"{arch}.attention.head_count_kv", u32(spec.num_kv_heads)),
        (f"{arch}.attention.layer_norm_rms_epsilon", f32(1e-5)),
        (f"{arch}.rope.freq_base", f32(spec.rope_theta)),
        (f"{arch}.rope.dimension_count", u32(spec.head_dim)),
    ]
    if spec.rope_scaling is not None:
        metadata += [(f"{arch}.rope.scaling.type", Typed(STRING, spec.rope_scaling)),
                     (f"{arch}.rope.scaling.factor", f32(spec.rope_scaling_factor))]
    if spec.rope_scaling == "yarn":
        original = int(spec.context_length / spec.rope_scaling_factor)
        metadata.append((f"{arch}.rope.scaling.original_context_length", u32(original)))
    return metadata
