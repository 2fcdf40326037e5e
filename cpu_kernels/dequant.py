"""Numpy dequantization of GGUF tensor types to float32: the reference every fast kernel meets.

Each format is one decoder, registered with a structured dtype that names the fields of one block
(so the raw bytes are viewed, never copied, as an array of blocks). A decoder writes the float32
weights of a run of blocks into a [blocks, block_size] slice of the output. `dequantize` feeds it
the tensor in chunks small enough for the temporaries to stay in cache; there is no per-block
Python loop.

Results are bit-exact with ggml's reference dequantizers: every product and sum is done in
float32 in the same order as ggml's C code (e.g. K-quants compute `(d * sc) * q - dmin * m`).
tierflow's own TQ2_1 and TQ3_1 (formats in `tierflow.ggml_types`) follow Q4_1's `d * q + m`.
"""

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import numpy as np
from gguf import GGMLQuantizationType as T

from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.ggml_types import TierflowType, type_name

# Weights decoded per chunk: the output chunk (256 KiB) and its uint8 temporaries fit in L2.
_CHUNK_ELEMENTS = 1 << 16

Decoder = Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class _Format:
    block_dtype: np.dtype  # the fields of one block; itemsize is the bytes per block
    block_size: int  # weights per block
    decode: Decoder  # (blocks [B] of block_dtype, out [B, block_size] float32) -> None


_FORMATS: dict[int, _Format] = {}


def _register(ggml_type: int, block_size: int, fields: list[tuple]) -> Callable[[Decoder], Decoder]:
    def add(decode: Decoder) -> Decoder:
        _FORMATS[ggml_type] = _Format(np.dtype(fields), block_size, decode)
        return decode

    return add


def _half(blocks: np.ndarray, field: str) -> np.ndarray:
    """A float16 field of each block as a float32 column [B, 1], ready to broadcast."""
    return blocks[field].astype(np.float32)[:, None]


def _unpack_nibbles(qs: np.ndarray, low_out: np.ndarray, high_out: np.ndarray) -> None:
    """Low nibbles of `qs` to `low_out`, high nibbles to `high_out` (any dtype: cast on write)."""
    np.bitwise_and(qs, 0x0F, out=low_out)
    np.right_shift(qs, 4, out=high_out)


def _low_bits_first(qh: np.ndarray) -> np.ndarray:
    """Bits of each row of bytes, bit i of byte k at column 8k + i: [B, n] -> [B, 8n] uint8."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


# --- plain floats: one weight per "block" ----------------------------------------------------

@_register(T.F32, 1, [("x", "<f4")])  # 4 bytes
@_register(T.F16, 1, [("x", "<f2")])  # 2 bytes
def _decode_float(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:, 0] = blocks["x"]


@_register(T.BF16, 1, [("x", "<u2")])  # 2 bytes: the upper half of a float32
def _decode_bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    bits = out.view(np.uint32)
    bits[:, 0] = blocks["x"]
    bits <<= 16


# --- 32-weight blocks: weight j < 16 in the low nibble of qs[j], weight j + 16 in the high one --

@_register(T.Q8_0, 32, [("d", "<f2"), ("qs", "i1", 32)])  # 34 bytes: y = d * q
def _decode_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = blocks["qs"]
    out *= _half(blocks, "d")


@_register(T.Q4_0, 32, [("d", "<f2"), ("qs", "u1", 16)])  # 18 bytes: y = d * (q - 8)
def _decode_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    _unpack_nibbles(blocks["qs"], out[:, :16], out[:, 16:])
    out -= 8
    out *= _half(blocks, "d")


@_register(T.Q4_1, 32, [("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])  # 20 bytes: y = d*q + m
def _decode_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    _unpack_nibbles(blocks["qs"], out[:, :16], out[:, 16:])
    out *= _half(blocks, "d")
    out += _half(blocks, "m")


def _five_bit_quants(blocks: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 quants [B, 32] uint8: the nibble plus bit j of the little-endian uint32 qh."""
    q = _low_bits_first(blocks["qh"])
    q <<= 4
    q[:, :16] |= blocks["qs"] & 0x0F
    q[:, 16:] |= blocks["qs"] >> 4
    return q


# 22 bytes: y = d * (q - 16)
@_register(T.Q5_0, 32, [("d", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)])
def _decode_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = _five_bit_quants(blocks)
    out -= 16
    out *= _half(blocks, "d")


# 24 bytes: y = d * q + m
@_register(T.Q5_1, 32, [("d", "<f2"), ("m", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)])
def _decode_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = _five_bit_quants(blocks)
    out *= _half(blocks, "d")
    out += _half(blocks, "m")


# --- 256-weight super-blocks ----------------------------------------------------------------

def _k_scales_and_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins [B, 8] packed in Q4_K/Q5_K's 12 bytes.

    Bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; scales and mins 4-7
    take their low 4 bits from the nibbles of bytes 8-11 and their top 2 bits from the top 2
    bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    low, mid, high = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mins


def _apply_k_scales(blocks: np.ndarray, out: np.ndarray) -> None:
    """out [B, 256] holding quants q becomes (d * scale) * q - dmin * min per 32-weight group."""
    sc, mins = _k_scales_and_mins(blocks["scales"])
    groups = out.reshape(-1, 8, 32)
    groups *= (_half(blocks, "d") * sc)[:, :, None]
    groups -= (_half(blocks, "dmin") * mins)[:, :, None]


# 144 bytes. Groups 2c and 2c+1 (32 weights each) are the low and high nibbles of qs[32c:32c+32].
@_register(T.Q4_K, 256, [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])
def _decode_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    nibbles = out.reshape(-1, 4, 2, 32)  # B, chunk c, low/high, 32
    _unpack_nibbles(blocks["qs"].reshape(-1, 4, 32), nibbles[:, :, 0], nibbles[:, :, 1])
    _apply_k_scales(blocks, out)


_GROUP_SHIFTS = np.arange(8, dtype=np.uint8)[:, None]  # bit g of qh[l] belongs to group g


# 176 bytes. As Q4_K, plus weight l of group g takes its fifth bit from bit g of qh[l].
@_register(
    T.Q5_K, 256,
    [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)],
)
def _decode_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    num_blocks = len(blocks)
    q = blocks["qh"][:, None, :] >> _GROUP_SHIFTS  # B, group g, l
    q &= 0x01
    q <<= 4
    nibbles = q.reshape(num_blocks, 4, 2, 32)
    qs = blocks["qs"].reshape(-1, 4, 32)
    nibbles[:, :, 0] |= qs & 0x0F
    nibbles[:, :, 1] |= qs >> 4
    out[:] = q.reshape(num_blocks, 256)
    _apply_k_scales(blocks, out)


# Q6_K: for weight l (0-31) of group g (0-3) in each 128-weight half h, the low 4 bits are the
# low (g < 2) or high (g >= 2) nibble of ql[64h + 32(g % 2) + l], the top 2 bits are bits 2g, 2g+1
# of qh[32h + l]; each 16 weights share one int8 scale.
_Q6_HIGH_SHIFTS = np.array([0, 2, 4, 6], np.uint8)[:, None]  # per group g, broadcast over l


# 210 bytes: y = (d * scale) * (q - 32)
@_register(T.Q6_K, 256, [("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])
def _decode_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    num_blocks = len(blocks)
    q = np.empty((num_blocks, 2, 4, 32), np.uint8)  # B, half h, group g, l
    ql = blocks["ql"].reshape(-1, 2, 2, 32)
    _unpack_nibbles(ql, q[:, :, 0:2], q[:, :, 2:4])
    high = blocks["qh"].reshape(-1, 2, 1, 32) >> _Q6_HIGH_SHIFTS
    high &= 0x03
    high <<= 4
    q |= high
    out[:] = q.reshape(num_blocks, 256)
    out -= 32
    sixteens = out.reshape(-1, 16, 16)  # B, scale index, weight
    sixteens *= (_half(blocks, "d") * blocks["scales"])[:, :, None]


# --- ggml's 2- and 3-bit K-quants, and ternary (TQ1_0, TQ2_0) -------------------------------------

_TWO_BIT_PLANES = np.array([0, 2, 4, 6], np.uint8)[:, None]  # per plane j, broadcast over l


def _planar_two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """[B, 32n] bytes -> codes [B, 128n] uint8 in ggml's K-quant order: weight 128h + 32j + l is
    bits 2j and 2j+1 of qs[32h + l] (Q2_K, Q3_K's low bits, TQ2_0)."""
    q = qs.reshape(len(qs), -1, 1, 32) >> _TWO_BIT_PLANES  # B, h, j, l
    q &= 0x03
    return q.reshape(len(qs), -1)


def q2_k_codes(blocks: np.ndarray) -> np.ndarray:
    return _planar_two_bit_codes(blocks["qs"])


# 84 bytes: y = (d * (sc & 15)) * q - dmin * (sc >> 4), one scale byte per 16 weights
@_register(T.Q2_K, 256, [("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2"), ("dmin", "<f2")])
def _decode_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = q2_k_codes(blocks)
    sixteens = out.reshape(-1, 16, 16)  # B, scale index, weight
    sixteens *= (_half(blocks, "d") * (blocks["scales"] & 0x0F))[:, :, None]
    sixteens -= (_half(blocks, "dmin") * (blocks["scales"] >> 4))[:, :, None]


def q3_k_codes(blocks: np.ndarray) -> np.ndarray:
    """Codes c [B, 256] uint8 in [0, 8) with value c - 4: two low bits as Q2_K's, the third from
    bit 4h + j of hmask[l] for weight 128h + 32j + l (a set bit means "no -4")."""
    high = blocks["hmask"][:, None, :] >> _GROUP_SHIFTS  # B, 32-weight run 4h + j, l
    high &= 0x01
    high <<= 2
    q = high.reshape(len(blocks), 256)
    q |= _planar_two_bit_codes(blocks["qs"])
    return q


def q3_k_scale_codes(blocks: np.ndarray) -> np.ndarray:
    """The sixteen six-bit sub-block scale codes s [B, 16] uint8: low nibble from byte j (j < 8) or
    the high nibble of byte j - 8; top 2 bits from bits 2(j // 4) of byte 8 + j % 4."""
    scales = blocks["scales"]
    low = np.concatenate([scales[:, :8] & 0x0F, scales[:, :8] >> 4], axis=1)
    high = scales[:, None, 8:] >> _TWO_BIT_PLANES  # B, j // 4, j % 4
    high &= 0x03
    return low | (high.reshape(-1, 16) << 4)


def q3_k_scales(blocks: np.ndarray) -> np.ndarray:
    """The sixteen sub-block scales d * (s - 32) [B, 16] float32, ggml's product."""
    return _half(blocks, "d") * (q3_k_scale_codes(blocks).astype(np.float32) - 32)


# 110 bytes: y = (d * (s - 32)) * (c - 4), one six-bit s per 16 weights
@_register(T.Q3_K, 256, [("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2")])
def _decode_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = q3_k_codes(blocks)
    out -= 4
    out.reshape(-1, 16, 16)[:] *= q3_k_scales(blocks)[:, :, None]


# 66 bytes: y = (q - 1) * d, codes in K-quant order
@_register(T.TQ2_0, 256, [("qs", "u1", 64), ("d", "<f2")])
def _decode_tq2_0(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = _planar_two_bit_codes(blocks["qs"])
    out -= 1
    out *= _half(blocks, "d")


_POWERS_OF_THREE = np.array([1, 3, 9, 27, 81], np.uint8)[:, None]


def _ternary_digits(packed: np.ndarray, num_digits: int) -> np.ndarray:
    """[B, n] bytes of base-3 digits stored as ceil(x * 256 / 243) -> digits [B, num_digits * n]
    in {0, 1, 2}, digit i of every byte before digit i + 1: (byte * 3^i mod 256) * 3 >> 8."""
    shifted = packed[:, None, :] * _POWERS_OF_THREE[:num_digits]  # uint8: wraps mod 256
    return ((shifted.astype(np.uint16) * 3) >> 8).astype(np.uint8).reshape(len(packed), -1)


def tq1_0_codes(blocks: np.ndarray) -> np.ndarray:
    """Codes [B, 256] in {0, 1, 2}: five digits of qs[0:32], five of qs[32:48], four of qh."""
    qs = blocks["qs"]
    return np.concatenate([_ternary_digits(qs[:, :32], 5), _ternary_digits(qs[:, 32:], 5),
                           _ternary_digits(blocks["qh"], 4)], axis=1)


# 54 bytes: y = (q - 1) * d
@_register(T.TQ1_0, 256, [("qs", "u1", 48), ("qh", "u1", 4), ("d", "<f2")])
def _decode_tq1_0(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = tq1_0_codes(blocks)
    out -= 1
    out *= _half(blocks, "d")


# --- codebook types: small integers from a 16-entry table, times a scale ----------------------

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # E2M1 x 2


def table_codes(qs: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[B, 16n] bytes -> int8 codes [B, 32n]: per 16 bytes, the low nibbles' table values then the
    high nibbles'."""
    nibbles = np.empty((len(qs), qs.shape[1] // 16, 2, 16), np.uint8)
    _unpack_nibbles(qs.reshape(len(qs), -1, 16), nibbles[:, :, 0], nibbles[:, :, 1])
    return table[nibbles.reshape(len(qs), -1)]


# 18 bytes: y = d * table[nibble]
@_register(T.IQ4_NL, 32, [("d", "<f2"), ("qs", "u1", 16)])
def _decode_iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = table_codes(blocks["qs"], IQ4_VALUES)
    out *= _half(blocks, "d")


def iq4_xs_scale_codes(blocks: np.ndarray) -> np.ndarray:
    """The six-bit ls [B, 8] uint8 per 32 weights: the low nibble from scales_l[i // 2] (low
    nibble first), the top 2 bits from bits 2i of scales_h."""
    low = np.empty((len(blocks), 4, 2), np.uint8)
    _unpack_nibbles(blocks["scales_l"], low[:, :, 0], low[:, :, 1])
    high = (blocks["scales_h"][:, None] >> (2 * np.arange(8, dtype=np.uint16))) & 0x03
    return low.reshape(-1, 8) | (high.astype(np.uint8) << 4)


def iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """d * (ls - 32) [B, 8] float32 per 32 weights, ggml's product."""
    return _half(blocks, "d") * (iq4_xs_scale_codes(blocks).astype(np.float32) - 32)


# 136 bytes: y = (d * (ls - 32)) * table[nibble], one six-bit ls per 32 weights
@_register(T.IQ4_XS, 256, [("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", 4), ("qs", "u1", 128)])
def _decode_iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = table_codes(blocks["qs"], IQ4_VALUES)
    out.reshape(-1, 8, 32)[:] *= iq4_xs_scales(blocks)[:, :, None]


def mxfp4_exponents(blocks: np.ndarray) -> np.ndarray:
    """x [B] int32 with the block's scale 2^x: ggml halves the E8M0 scale 2^(e - 127) because its
    table doubles the E2M1 values; e = 255 is 2^127, not NaN."""
    return blocks["e"].astype(np.int32) - 128


# 17 bytes: y = table[nibble] * 2^(e - 128)
@_register(T.MXFP4, 32, [("e", "u1"), ("qs", "u1", 16)])
def _decode_mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = table_codes(blocks["qs"], MXFP4_VALUES)
    with np.errstate(over="ignore"):  # 12 x 2^127 is inf in ggml too
        out *= np.ldexp(np.float32(1), mxfp4_exponents(blocks))[:, None]


# --- tierflow's 2- and 3-bit types (formats in tierflow.ggml_types): y = d * q + m -------------

_TWO_BIT_SHIFTS = np.array([0, 2, 4, 6], np.uint8)  # weight j is bits 2*(j%4).. of qs[j // 4]


def _two_bit_quants(qs: np.ndarray) -> np.ndarray:
    """[B, n] bytes of four 2-bit codes each, lowest bits first, to codes [B, 4n] uint8."""
    q = qs[:, :, None] >> _TWO_BIT_SHIFTS
    q &= 0x03
    return q.reshape(len(qs), -1)


# 12 bytes: y = d * q + m, q in 0..3
@_register(TierflowType.TQ2_1, 32, [("d", "<f2"), ("m", "<f2"), ("qs", "u1", 8)])
def _decode_tq2_1(blocks: np.ndarray, out: np.ndarray) -> None:
    out[:] = _two_bit_quants(blocks["qs"])
    out *= _half(blocks, "d")
    out += _half(blocks, "m")


# 16 bytes: y = d * q + m, q in 0..7; the third bit of weight j is bit j % 8 of qh[j // 8]
@_register(TierflowType.TQ3_1, 32, [("d", "<f2"), ("m", "<f2"), ("qh", "u1", 4), ("qs", "u1", 8)])
def _decode_tq3_1(blocks: np.ndarray, out: np.ndarray) -> None:
    q = _low_bits_first(blocks["qh"])
    q <<= 2
    q |= _two_bit_quants(blocks["qs"])
    out[:] = q
    out *= _half(blocks, "d")
    out += _half(blocks, "m")


SUPPORTED_TYPES: frozenset[int] = frozenset(_FORMATS)


_type_name = type_name  # kept for the modules that import it from here


def _format_of(ggml_type: int) -> _Format:
    fmt = _FORMATS.get(ggml_type)
    if fmt is None:
        supported = ", ".join(type_name(t) for t in sorted(_FORMATS))
        raise UnsupportedModelError(
            f"tensor type {type_name(ggml_type)} is not supported; supported: {supported}"
        )
    return fmt


def _check_size(data: np.ndarray, fmt: _Format, ggml_type: int, shape: tuple[int, ...]) -> int:
    """The number of blocks, after checking the shape is whole blocks and the bytes match it."""
    name = type_name(ggml_type)
    if any(dim < 0 for dim in shape):
        raise ModelFileError(f"tensor shape {list(shape)} has a negative dimension")
    row_length = shape[0] if shape else 1
    if row_length % fmt.block_size:
        raise ModelFileError(
            f"tensor row length {row_length} is not a multiple of the {name} block size "
            f"{fmt.block_size}"
        )
    num_blocks = prod(shape) // fmt.block_size
    expected_bytes = num_blocks * fmt.block_dtype.itemsize
    if data.nbytes != expected_bytes:
        raise ModelFileError(
            f"{name} tensor of shape {list(shape)} needs {expected_bytes} bytes, got {data.nbytes}"
        )
    return num_blocks


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode one tensor's raw bytes to float32 weights.

    `data` is the tensor's bytes, 1-D uint8 (typically a read-only memmap view; it is only read).
    `shape` is in GGUF order (shape[0] = ne0, the innermost dimension). Returns a new, writable,
    C-contiguous float32 array of numpy shape `tuple(reversed(shape))`: a GGUF weight
    [ne0=in, ne1=out] comes back as [out, in], the nn.Linear layout.
    Peak memory is the output plus about one chunk of temporaries.
    """
    data = np.asarray(data)  # a plain ndarray view, so ufuncs do not return memmaps
    if data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError(f"expected 1-D uint8 bytes, got {data.dtype} of shape {data.shape}")
    shape = tuple(int(dim) for dim in shape)
    fmt = _format_of(ggml_type)
    num_blocks = _check_size(data, fmt, ggml_type, shape)
    out = np.empty(tuple(reversed(shape)), np.float32)
    rows = out.reshape(num_blocks, fmt.block_size)
    blocks = np.ascontiguousarray(data).view(fmt.block_dtype)
    step = max(1, _CHUNK_ELEMENTS // fmt.block_size)
    for start in range(0, num_blocks, step):
        fmt.decode(blocks[start:start + step], rows[start:start + step])
    return out
