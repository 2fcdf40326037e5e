"""Numpy encoders: float32 weights to ggml's Q2_K, Q3_K, IQ4_XS and IQ4_NL blocks (what llama.cpp reads).

`tierflow convert --type` writes these. The layouts are dequant.py's decoders read backwards. Each
encoder fits the small groups first and the block's shared scale after, as llama.cpp's reference
quantizers do, without their importance matrix:

1. Per sub-block (16 weights in Q2_K/Q3_K, 32 in the IQ4 types) a scale search: candidate steps
   around the one that maps the largest weight to the last level, the nearest level for every
   weight, the least-squares scale (and offset, Q2_K) for those levels, the lowest squared error.
   The IQ4 levels are the non-uniform table (-127 .. 113), Q3_K's the integers -4 .. 3, Q2_K's
   0 .. 3 above an offset that is at most zero (its stored min is subtracted).
2. The sub-block scales (and Q2_K's offsets) are quantized to the block's 4- or 6-bit integers
   times one float16 (the largest one maps to the last integer), and each weight is given the
   nearest level of its sub-block's final scale.

Everything is vectorised over sub-blocks, in chunks (a candidate costs a few passes over its chunk).
"""

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from tierflow.cpu_kernels.dequant import IQ4_VALUES, _format_of
from tierflow.cpu_kernels.quantize import _groups
from tierflow.errors import InvalidArgumentError
from tierflow.ggml_types import type_name

_CHUNK_BLOCKS = 512  # 256-weight blocks per chunk: [candidates, 131072] float32 temporaries
_STEP_FACTORS = np.linspace(0.8, 1.2, 9, dtype=np.float32)[:, None, None]  # around the max step
_IQ4_LEVELS = IQ4_VALUES.astype(np.float32)
_Q3_LEVELS = np.arange(-4, 4, dtype=np.float32)

Encoder = Callable[[np.ndarray, np.ndarray], None]  # (weights [B, block], blocks [B]) -> None


def _nearest(y: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Index of the level nearest each y (levels ascending)."""
    return np.searchsorted((levels[1:] + levels[:-1]) / 2, y)


def _fit_symmetric(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Per sub-block of x [S, n], the scale s minimising |x - s * levels[i]|^2: [S] float32.

    The candidates map the largest-magnitude weight to one end of the levels (either end, for the
    asymmetric tables), times a few factors; each is refined by least squares for its levels."""
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)  # [S, 1], signed
    ends = np.array([levels[0], levels[-1]], np.float32)[:, None, None, None]
    steps = (peak / ends / _STEP_FACTORS).reshape(-1, len(x), 1)  # [C, S, 1]
    safe = np.where(steps == 0, np.float32(1), steps)
    values = levels[_nearest(x / safe, levels)]  # [C, S, n]
    fitted = (values * x).sum(-1) / np.maximum((values * values).sum(-1), np.float32(1e-30))  # [C, S]
    error = ((x - fitted[..., None] * values) ** 2).sum(-1)
    return fitted[error.argmin(axis=0), np.arange(len(x))]


def _fit_offset(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block of x [S, n]: a >= 0 and b <= 0 minimising |x - (a * q + b)|^2, q in 0..3."""
    low = np.minimum(x.min(axis=1, keepdims=True), 0)  # [S, 1]
    span = x.max(axis=1, keepdims=True) - low
    steps = span / (3 * _STEP_FACTORS)  # [C, S, 1]
    q = np.clip(np.rint((x - low) / np.where(steps == 0, np.float32(1), steps)), 0, 3)  # [C, S, n]
    n, sq, sqq = np.float32(x.shape[1]), q.sum(-1), (q * q).sum(-1)
    sx, sqx = x.sum(-1), (q * x).sum(-1)
    det = n * sqq - sq * sq
    a = np.where(det > 0, (n * sqx - sq * sx) / np.where(det > 0, det, 1), 0)
    b = np.minimum((sx - a * sq) / n, 0)
    a = np.maximum(np.where(sqq > 0, (sqx - b * sq) / np.where(sqq > 0, sqq, 1), 0), 0)  # refit for b
    error = ((x - (a[..., None] * q + b[..., None])) ** 2).sum(-1)
    best = error.argmin(axis=0), np.arange(len(x))
    return a[best], b[best]


def _half(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, np.float32).astype(np.float16)


def _shared_scale(sub: np.ndarray, top: int, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block scales [B, k] as d [B] float16 times integers [B, k]: in -32..31 (signed, the
    largest-magnitude scale mapped to -32) or 0..top."""
    if signed:
        peak = np.take_along_axis(sub, np.abs(sub).argmax(axis=1)[:, None], axis=1)[:, 0]
        d, low, high = _half(peak / -32), -32, 31
    else:
        d, low, high = _half(sub.max(axis=1) / top), 0, top
    d32 = d.astype(np.float32)[:, None]
    integers = np.clip(np.rint(sub / np.where(d32 == 0, np.float32(1), d32)), low, high)
    return d, integers.astype(np.int32)


def _codes_for(x: np.ndarray, scales: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Nearest level index per weight, x [S, n] with final sub-block scales [S] (index of 0 where
    the scale is 0)."""
    safe = np.where(scales == 0, np.float32(1), scales)[:, None]
    return np.where(scales[:, None] == 0, _nearest(np.zeros(1, np.float32), levels)[0],
                    _nearest(x / safe, levels)).astype(np.uint8)


def _planar_two_bit(codes: np.ndarray) -> np.ndarray:
    """Codes [B, 256] (0..3) to 64 bytes: weight 128h + 32j + l in bits 2j, 2j+1 of byte 32h + l."""
    q = codes.reshape(len(codes), 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    return np.bitwise_or.reduce(q, axis=2).reshape(len(codes), 64)


def _nibble_pairs(codes: np.ndarray) -> np.ndarray:
    """Codes [B, 32m] (0..15) to 16m bytes: per 32, weight j low and weight j + 16 high in byte j."""
    q = codes.reshape(len(codes), -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(codes), -1)


def pack_q3_k_scales(six_bit: np.ndarray) -> np.ndarray:
    """Sixteen six-bit scales [B, 16] to Q3_K's 12 bytes: low nibbles in bytes 0-7 (scales 8-15
    in the high nibbles), the top 2 bits of scale j at bits 2(j // 4) of byte 8 + j % 4."""
    s = six_bit.astype(np.uint8)
    low = (s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4)
    top = (s >> 4).reshape(len(s), 4, 4)  # block, j // 4, j % 4
    return np.concatenate([low, top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)], axis=1)


def pack_iq4_xs_scales(six_bit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eight six-bit scales [B, 8] to IQ4_XS's scales_h [B] (u16) and scales_l [B, 4]."""
    s = six_bit.astype(np.uint16)
    high = np.bitwise_or.reduce((s >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
    return high, ((s[:, 0::2] & 0x0F) | ((s[:, 1::2] & 0x0F) << 4)).astype(np.uint8)


def _encode_q2_k(x: np.ndarray, blocks: np.ndarray) -> None:
    sub = x.reshape(-1, 16)
    a, b = _fit_offset(sub)
    d, sc = _shared_scale(a.reshape(-1, 16), 15, signed=False)
    dmin, m = _shared_scale(-b.reshape(-1, 16), 15, signed=False)
    scale = (d.astype(np.float32)[:, None] * sc).reshape(-1)
    offset = (dmin.astype(np.float32)[:, None] * m).reshape(-1)
    codes = _codes_for(sub + offset[:, None], scale, np.arange(4, dtype=np.float32))
    blocks["d"], blocks["dmin"] = d, dmin
    blocks["scales"] = sc | (m << 4)
    blocks["qs"] = _planar_two_bit(codes.reshape(-1, 256))


def _encode_q3_k(x: np.ndarray, blocks: np.ndarray) -> None:
    sub = x.reshape(-1, 16)
    d, s = _shared_scale(_fit_symmetric(sub, _Q3_LEVELS).reshape(-1, 16), 31, signed=True)
    codes = _codes_for(sub, (d.astype(np.float32)[:, None] * s).reshape(-1), _Q3_LEVELS).reshape(-1, 256)
    blocks["d"] = d
    blocks["scales"] = pack_q3_k_scales(s + 32)
    blocks["qs"] = _planar_two_bit(codes & 0x03)
    high = (codes >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]  # bit 4h + j
    blocks["hmask"] = np.bitwise_or.reduce(high, axis=1)


def _encode_iq4_xs(x: np.ndarray, blocks: np.ndarray) -> None:
    sub = x.reshape(-1, 32)
    d, s = _shared_scale(_fit_symmetric(sub, _IQ4_LEVELS).reshape(-1, 8), 31, signed=True)
    codes = _codes_for(sub, (d.astype(np.float32)[:, None] * s).reshape(-1), _IQ4_LEVELS)
    blocks["d"] = d
    blocks["scales_h"], blocks["scales_l"] = pack_iq4_xs_scales(s + 32)
    blocks["qs"] = _nibble_pairs(codes.reshape(-1, 256))


def _encode_iq4_nl(x: np.ndarray, blocks: np.ndarray) -> None:
    d = _half(_fit_symmetric(x, _IQ4_LEVELS))
    blocks["d"] = d
    blocks["qs"] = _nibble_pairs(_codes_for(x, d.astype(np.float32), _IQ4_LEVELS))


ENCODERS: dict[int, Encoder] = {T.Q2_K: _encode_q2_k, T.Q3_K: _encode_q3_k, T.IQ4_XS: _encode_iq4_xs,
                                T.IQ4_NL: _encode_iq4_nl}


def quantize_ggml(weights: np.ndarray, ggml_type: int) -> np.ndarray:
    """Encode float32 weights [N, K] (finite, K a multiple of the type's block) as `ggml_type`
    blocks (a key of ENCODERS): the tensor's bytes, 1-D uint8, as `quantize.quantize` returns."""
    fmt = _format_of(ggml_type)
    groups = _groups(weights)  # 2-D, whole groups of 32, finite within float16: else refused
    if np.shape(weights)[1] % fmt.block_size:
        raise InvalidArgumentError(f"{type_name(ggml_type)} needs rows a multiple of {fmt.block_size} long, "
                                   f"got shape {np.shape(weights)}")
    rows = groups.reshape(-1, fmt.block_size)
    blocks = np.zeros(len(rows), fmt.block_dtype)
    step = max(1, _CHUNK_BLOCKS * 256 // fmt.block_size)
    for start in range(0, len(rows), step):
        ENCODERS[ggml_type](rows[start:start + step], blocks[start:start + step])
    return blocks.view(np.uint8)
