"""Random tensor contents in any GGUF weight type, with a chosen mean and standard deviation.

Small tensors are normal floats quantized with gguf.quants, as a real converter would. That runs
at ~30M weights/s, so a 2 GB model would take minutes: tensors above _QUANTIZE_MAX_ELEMENTS
weights get random but valid quant blocks instead (~0.7 GB/s), and so do the K-quants and IQ4
types always, since gguf.quants has no quantizer for them. Block scales are chosen so that both paths give
dequantized values of the same spread.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tierflow.cpu_kernels.quantize_ggml import pack_iq4_xs_scales, pack_q3_k_scales

Q = GGMLQuantizationType
_QUANTIZE_MAX_ELEMENTS = 1 << 22
_NOT_QUANTIZABLE = {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS}  # by gguf.quants


class _BlockLayout(NamedTuple):
    d_offset: int             # byte offset of the f16 block scale d
    unit_rms: float           # RMS of the dequantized values for d = 1 and random quant bits
    min_offset: int | None = None
    min_ratio: float = 0.0    # the min field as a multiple of d, chosen to centre the values
    scales: str | None = None  # sub-block scales: "k4" (Q4_K/Q5_K packing), "i8" (Q6_K), "q2k",
                               # "q3k", "iq4xs"; "e8m0": MXFP4's exponent byte stands for d;
                               # "ternary": TQ2_0's codes kept to 0..2
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
    # Q2_K: scale and min nibbles equal, 8..15 (E[s^2] = 137.5), dmin = 1.5 d centres q in 0..3.
    Q.Q2_K: _BlockLayout(80, math.sqrt(137.5 * 15 / 12), min_offset=82, min_ratio=1.5, scales="q2k"),
    # Q3_K, IQ4_XS: sub-scales s - 32 of either sign, |s - 32| in 16..31 (E = 573.5); Q3_K's c - 4
    # in -4..3 has E[(c - 4)^2] = 5.5, the IQ4 table's values E[v^2] = 4548.
    Q.Q3_K: _BlockLayout(108, math.sqrt(573.5 * 5.5), scales="q3k"),
    Q.IQ4_NL: _BlockLayout(0, math.sqrt(4548.0), signed=True),
    Q.IQ4_XS: _BlockLayout(0, math.sqrt(573.5 * 4548.0), scales="iq4xs"),
    Q.MXFP4: _BlockLayout(0, math.sqrt(34.25), scales="e8m0"),  # its doubled E2M1 table: E[v^2]
    Q.TQ2_0: _BlockLayout(64, math.sqrt(2 / 3), scales="ternary"),  # q - 1 uniform on -1, 0, 1
    Q.TQ1_0: _BlockLayout(52, math.sqrt(2 / 3)),  # random bytes: base-3 digits about uniform
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


def _signed_six_bit(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Six-bit sub-scales s with s - 32 = +-(16..31): uint8 in 1..63."""
    return (32 + rng.choice([-1, 1], shape) * rng.integers(16, 32, shape)).astype(np.uint8)


def _q3k_scales(rng: np.random.Generator, num_blocks: int) -> np.ndarray:
    return pack_q3_k_scales(_signed_six_bit(rng, (num_blocks, 16)))


def _iq4xs_scales(rng: np.random.Generator, num_blocks: int) -> np.ndarray:
    """IQ4_XS's scales_h (u16) and scales_l[4], as 6 bytes."""
    high, low = pack_iq4_xs_scales(_signed_six_bit(rng, (num_blocks, 8)))
    return np.concatenate([high.astype("<u2").view(np.uint8).reshape(num_blocks, 2), low], axis=1)


def _ternary_codes(rng: np.random.Generator, num_blocks: int) -> np.ndarray:
    """TQ2_0's 64 bytes of four 2-bit codes each, every code 0, 1 or 2."""
    codes = rng.integers(0, 3, (num_blocks, 4, 64), dtype=np.uint8)
    return codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)


def _q2k_scales(rng: np.random.Generator, num_blocks: int) -> np.ndarray:
    """Q2_K's 16 bytes: per 16 weights a scale nibble (low) and an equal min nibble, 8..15."""
    s = rng.integers(8, 16, (num_blocks, 16), dtype=np.uint8)
    return s | (s << 4)


_SCALE_FIELDS = {  # sub-block scales: (first byte, how they are made)
    "k4": (4, _k4_scales), "q2k": (0, _q2k_scales), "q3k": (96, _q3k_scales),
    "iq4xs": (2, _iq4xs_scales), "ternary": (0, _ternary_codes),
}


def _random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, num_blocks: int,
                   std: float) -> np.ndarray:
    """Valid blocks of a quantized type whose dequantized values have mean ~0 and std ~std."""
    layout, type_size = _LAYOUTS[qtype], GGML_QUANT_SIZES[qtype][1]
    blocks = _random_bytes(rng, num_blocks * type_size).reshape(num_blocks, type_size)
    d = std / (layout.unit_rms * _D_JITTER_RMS) * rng.uniform(*_D_JITTER, num_blocks)
    if layout.signed and layout.scales is None:
        d *= rng.choice([-1.0, 1.0], num_blocks)
    if layout.scales == "e8m0":  # the scale 2^(e - 128) nearest d
        blocks[:, 0] = 128 + np.round(np.log2(d)).astype(np.int64)
    else:
        _put_f16(blocks, layout.d_offset, d)
    if layout.min_offset is not None:
        _put_f16(blocks, layout.min_offset, layout.min_ratio * d)
    if layout.scales in _SCALE_FIELDS:
        start, make = _SCALE_FIELDS[layout.scales]
        scales = make(rng, num_blocks)
        blocks[:, start:start + scales.shape[1]] = scales
    elif layout.scales == "i8":
        scales = rng.integers(32, 64, (num_blocks, 16), dtype=np.int8)
        blocks[:, 192:208] = (scales * rng.choice(np.int8([-1, 1]), scales.shape)).view(np.uint8)
    if qtype == Q.Q8_0:  # like the reference quantizer, never emit -128
        quants = blocks[:, 2:]
        quants[quants == 0x80] = 0x81
    return blocks


def random_tensor_bytes(rng: np.random.Generator, qtype: GGMLQuantizationType,
                        shape: tuple[int, ...], std: float, mean: float = 0.0,
                        values: np.ndarray | None = None) -> np.ndarray:
    """The bytes of a `qtype` tensor of numpy `shape` (row length last) holding `values`, or
    else random values of about this `std` and `mean` (quantized types: mean 0 past the
    quantize limit). A uint8 array of shape (rows, row_bytes)."""
    rows, size = math.prod(shape[:-1]), math.prod(shape)
    too_big = qtype in _LAYOUTS and size > _QUANTIZE_MAX_ELEMENTS
    if values is None and (too_big or qtype in _NOT_QUANTIZABLE):
        num_blocks = size // GGML_QUANT_SIZES[qtype][0]
        return _random_blocks(rng, qtype, num_blocks, std).reshape(rows, -1)
    if values is None:
        values = rng.standard_normal(shape, dtype=np.float32) * std + mean
    encoded = gguf.quants.quantize(values.reshape(rows, -1), qtype)
    return np.ascontiguousarray(encoded).view(np.uint8)
