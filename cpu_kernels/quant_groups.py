"""GGUF quantized tensors decoded to one uniform form: codes plus a scale and an offset per group.

The fast CPU kernels read every quant format the same way: per row n and per group of `group`
consecutive columns, `w[n, k] = scale[n, k // group] * q[n, k] + min[n, k // group]` in float32.
The ternary formats keep unsigned codes as uint8 in [0, 4) (for the LUT kernel); the others become
int8 codes (for the int8 kernel, which reads the narrow ones from fields of 2 or 4 bits plus a zero
code), or, for codebook formats, uint8 indices into 16 int8 codes (the int8 kernel too, which looks
the codes up).

Every mapping below is lossless: `QuantGroups.dequantize` reproduces `dequant.dequantize` bit for
bit, save the sign of zeros in Q4_0, TQ1_0 and TQ2_0. These facts make that hold:
- ggml computes Q4_0 as `(q - 8) * d`; here it is `d * q + (-8 * d)`. `-8 * d` is exact (a
  power-of-two multiple of a float16), `d * q` is exact (11 + 4 significant bits), and so is
  their sum, `d * (q - 8)`, which is the very value ggml rounds to: no rounding anywhere. Only
  where that value is zero can the bits differ: `x + -x` is always +0.0, while ggml gets -0.0
  from a negative d with q = 8 (or a zero d times a code of the other sign). No choice of scale
  and min fixes that with q the raw nibble; a zero of either sign contributes nothing to a dot
  product of finite activations.
- K-quants keep ggml's float32 products as they are: scale = `d * sc` and min = `-(dmin * m)`, so
  `scale * q + min` is ggml's `(d * sc) * q - dmin * m` (negation is exact, `a + -b` is `a - b`).
- The ternary types (`(q - 1) * d`) are Q4_0's case: scale = d and min = -d are exact, d * q is
  exact, and so is the sum, the very value ggml rounds to; the same zeros differ.
- Q3_K is `(d * (s - 32)) * (c - 4)` in ggml: here scale = d * (s - 32), ggml's float32 product,
  and q = c - 4, so `scale * q` is ggml's very product, zeros' signs included.
- Q2_K and IQ4_XS keep ggml's float32 products (`d * (sc & 15)`, `dmin * (sc >> 4)`,
  `d * (ls - 32)`) as scale and min, as the other K-quants do.
- The codebook types (IQ4_NL, IQ4_XS, MXFP4) keep their 4-bit indices with a named codebook
  (CODEBOOKS): the tables hold small integers (MXFP4's are E2M1 values doubled, its E8M0 scale
  halved), so ggml's `scale * table[nibble]` is `scale * q` with q = table[index], the int8 code
  the int8 kernel computes with. MXFP4's scale 2^(e - 128) is exact in float32 for every e.
- Formats without an offset get min = -0.0, not +0.0: `x + -0.0` is `x` for every x, whereas
  `-0.0 + 0.0` would turn ggml's negative zeros (negative scale times a zero code) positive.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from tierflow.cpu_kernels.dequant import (
    _CHUNK_ELEMENTS,
    _GROUP_SHIFTS,
    _Q6_HIGH_SHIFTS,
    IQ4_VALUES,
    MXFP4_VALUES,
    _check_size,
    _five_bit_quants,
    _format_of,
    _half,
    _k_scales_and_mins,
    _low_bits_first,
    _planar_two_bit_codes,
    _two_bit_quants,
    _type_name,
    _unpack_nibbles,
    iq4_xs_scale_codes,
    mxfp4_exponents,
    q2_k_codes,
    q3_k_codes,
    q3_k_scale_codes,
    table_codes,
    tq1_0_codes,
)
from tierflow.errors import UnsupportedModelError
from tierflow.ggml_types import TierflowType

# The codebooks of 4-bit indices, by name; their order is the C kernels' codebook ids (1, 2).
CODEBOOKS: dict[str, np.ndarray] = {"iq4nl": IQ4_VALUES, "mxfp4": MXFP4_VALUES}


@dataclass(frozen=True)
class QuantGroups:
    """w[n, k] = scale[n, k // group] * q[n, k] + min[n, k // group], in float32.

    N rows, K columns, G = K // group groups per row.
    """

    q: np.ndarray  # [N, K]: uint8 codes in [0, 2**bits) when bits <= 4; int8 when bits == 8
    scale: np.ndarray  # [N, G] float32
    min: np.ndarray  # [N, G] float32; -0.0 where the format has no offset (see module docstring)
    group: int  # consecutive columns sharing one scale and min
    bits: int  # 1..4: unsigned codes for the LUT kernels; 8: signed codes for the int8 kernel
    codebook: str | None = None  # bits 8 only: q holds uint8 indices, the codes are CODEBOOKS[name][q]
    width: int = 8  # bits 8: q + zero fits in `width` unsigned bits (2..6: the file's packing)
    zero: int = 0  # the code of a zero weight: LUT min = -zero * scale; int8 stored codes q + zero
    sub: "SubScales | None" = None  # the file's two-level scales, from which scale and min came

    def __post_init__(self) -> None:
        if self.q.ndim != 2 or self.group <= 0 or self.q.shape[1] % self.group:
            raise ValueError(f"q of shape {self.q.shape} is not whole groups of {self.group}")
        groups_shape = (self.q.shape[0], self.q.shape[1] // self.group)
        for name in ("scale", "min"):
            array = getattr(self, name)
            if array.shape != groups_shape or array.dtype != np.float32:
                raise ValueError(
                    f"{name} must be float32 {groups_shape}, got {array.dtype} {array.shape}"
                )
        if self.codebook is not None and (self.codebook not in CODEBOOKS or self.bits != 8):
            raise ValueError(f"codebook {self.codebook!r} with {self.bits}-bit codes; expected 8-bit codes "
                             f"and one of {sorted(CODEBOOKS)}")
        expected = (np.uint8 if self.codebook else np.int8) if self.bits == 8 else (
            np.uint8 if 1 <= self.bits <= 4 else None)
        if expected is None or self.q.dtype != expected:
            raise ValueError(f"{self.bits}-bit codes cannot be {self.q.dtype}")

    def codes(self) -> np.ndarray:
        """The codes [N, K] the kernels multiply: q, or the codebook's entries q selects."""
        return self.q if self.codebook is None else CODEBOOKS[self.codebook][self.q]

    def dequantize(self) -> np.ndarray:
        """The float32 weights [N, K], exactly `scale * code + min` (a new array)."""
        num_rows, row_length = self.q.shape
        weights = self.codes().reshape(num_rows, -1, self.group).astype(np.float32)  # N, G, group
        weights *= self.scale[:, :, None]
        weights += self.min[:, :, None]
        return weights.reshape(num_rows, row_length)


@dataclass(frozen=True)
class SubScales:
    """Two-level scales as the K-quants (and IQ4_XS) hold them: per group an unsigned code of
    `bits` bits, scale = d * (scale_code - offset) and min = -(dmin * min_code), with d and dmin
    float16 values per super block of G / S groups. QuantGroups' scale and min are these products
    in float32, as ggml computes them; the pack keeps the codes instead, the file's own bytes."""

    scale_codes: np.ndarray  # uint8 [N, G]
    min_codes: np.ndarray | None  # uint8 [N, G], or None: min is the zero code's (or -0.0)
    d: np.ndarray  # float32 [N, S]
    dmin: np.ndarray | None  # float32 [N, S] with min_codes
    bits: int  # 4, 6 or 8
    offset: int

    @property
    def groups_per_super(self) -> int:
        return self.scale_codes.shape[1] // self.d.shape[1]

    @property
    def form(self) -> tuple:
        """What two matrices must share to stack."""
        return self.bits, self.offset, self.groups_per_super, self.min_codes is not None


@dataclass(frozen=True)
class SubSpec:
    """A type's sub-scale codes: bits, offset, groups per super block, and whether mins are coded."""

    bits: int
    offset: int
    groups_per_super: int
    with_mins: bool


@dataclass
class BlockSub:
    """Per block (one super block), the arrays a splitter fills with the file's sub-scale codes."""

    scale_codes: np.ndarray  # uint8 [B, groups per block]
    min_codes: np.ndarray | None
    d: np.ndarray  # float32 [B, 1]
    dmin: np.ndarray | None


# (blocks [B], q [B, block_size], scale [B, block_size // group], min [same], sub or None) -> None
Splitter = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, "BlockSub | None"], None]


@dataclass(frozen=True)
class GroupLayout:
    group: int
    bits: int
    has_min: bool  # False: min is -0.0 throughout, or the zero code's -zero * scale
    split: Splitter
    codebook: str | None = None  # q holds indices into CODEBOOKS[codebook]
    width: int = 8  # bits 8: the unsigned bits q + zero fits in
    zero: int = 0  # the code of a zero weight (see QuantGroups)
    sub: SubSpec | None = None  # the file's two-level scales, which the pack keeps

    @property
    def form(self) -> tuple:
        """What decides a packed matrix's layout: parts of one form stack into one matrix."""
        return self.group, self.bits, self.codebook, self.width, self.zero, self.has_min, self.sub


_LAYOUTS: dict[int, GroupLayout] = {}


def _register(ggml_type: T, group: int, bits: int, has_min: bool = True, codebook: str | None = None,
              width: int = 8, zero: int = 0, sub: SubSpec | None = None) -> Callable[[Splitter], Splitter]:
    def add(split: Splitter) -> Splitter:
        _LAYOUTS[ggml_type] = GroupLayout(group, bits, has_min, split, codebook, width, zero, sub)
        return split

    return add


# --- 32-weight blocks, one group each ---------------------------------------------------------

# Lossless: q = nibble - 8 in [-8, 8), scale = d, no offset (ggml's (q - 8) * d); packed as nibbles.
@_register(T.Q4_0, group=32, bits=8, has_min=False, width=4, zero=8)
def _split_q4_0(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    _unpack_nibbles(blocks["qs"], q[:, :16], q[:, 16:])
    q -= 8
    scale[:] = _half(blocks, "d")
    min_[:] = -0.0


@_register(T.Q4_1, group=32, bits=8, width=4)  # lossless: q = nibble, scale = d, min = m
def _split_q4_1(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    _unpack_nibbles(blocks["qs"], q[:, :16], q[:, 16:])
    scale[:] = _half(blocks, "d")
    min_[:] = _half(blocks, "m")


@_register(T.Q8_0, group=32, bits=8, has_min=False)  # lossless: q = qs, scale = d, no offset
def _split_q8_0(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    q[:] = blocks["qs"]
    scale[:] = _half(blocks, "d")
    min_[:] = -0.0


# lossless: q = q5 - 16 in [-16, 16), scale = d, no offset
@_register(T.Q5_0, group=32, bits=8, has_min=False, width=5, zero=16)
def _split_q5_0(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    q[:] = _five_bit_quants(blocks)
    q -= 16
    scale[:] = _half(blocks, "d")
    min_[:] = -0.0


@_register(T.Q5_1, group=32, bits=8, width=5)  # lossless: q = q5 in [0, 32), scale = d, min = m
def _split_q5_1(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    q[:] = _five_bit_quants(blocks)
    scale[:] = _half(blocks, "d")
    min_[:] = _half(blocks, "m")


# --- 256-weight super-blocks: the sub-blocks become the groups ----------------------------------
# Each keeps its sub-scale codes and d (dmin) as well (BlockSub): the pack holds those, not the products.

def _sub_scales(blocks: np.ndarray, sub: BlockSub, scale_codes: np.ndarray, scale: np.ndarray,
                offset: int = 0, min_codes: np.ndarray | None = None, min_: np.ndarray | None = None) -> None:
    """scale = d * (code - offset) and min = -(dmin * min code), ggml's float32 products, and the
    codes and d, dmin themselves into `sub`."""
    d = _half(blocks, "d")
    sub.d[:], sub.scale_codes[:] = d, scale_codes
    np.multiply(d, scale_codes.astype(np.float32) - offset if offset else scale_codes, out=scale)
    if min_codes is not None:
        dmin = _half(blocks, "dmin")
        sub.dmin[:], sub.min_codes[:] = dmin, min_codes
        np.multiply(dmin, min_codes, out=min_)
        np.negative(min_, out=min_)


_K_SUB = SubSpec(bits=6, offset=0, groups_per_super=8, with_mins=True)


# Lossless: q = 4-bit code, scale = d * sc, min = -(dmin * m). Groups 2c and 2c+1 are the low and
# high nibbles of qs[32c:32c+32].
@_register(T.Q4_K, group=32, bits=8, width=4, sub=_K_SUB)
def _split_q4_k(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    nibbles = q.reshape(-1, 4, 2, 32)  # B, chunk c, low/high, 32
    _unpack_nibbles(blocks["qs"].reshape(-1, 4, 32), nibbles[:, :, 0], nibbles[:, :, 1])
    sc, mins = _k_scales_and_mins(blocks["scales"])
    _sub_scales(blocks, sub, sc, scale, min_codes=mins, min_=min_)


# Lossless: q = 5-bit code in [0, 32), scale = d * sc, min = -(dmin * m). As Q4_K, plus weight l
# of group g takes its fifth bit from bit g of qh[l].
@_register(T.Q5_K, group=32, bits=8, width=5, sub=_K_SUB)
def _split_q5_k(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    codes = blocks["qh"][:, None, :] >> _GROUP_SHIFTS  # B, group g, l
    codes &= 0x01
    codes <<= 4
    nibbles = codes.reshape(-1, 4, 2, 32)  # B, chunk c, low/high, 32
    qs = blocks["qs"].reshape(-1, 4, 32)
    nibbles[:, :, 0] |= qs & 0x0F
    nibbles[:, :, 1] |= qs >> 4
    q[:] = codes.reshape(-1, 256)
    sc, mins = _k_scales_and_mins(blocks["scales"])
    _sub_scales(blocks, sub, sc, scale, min_codes=mins, min_=min_)


# Lossless: q = q6 - 32 in [-32, 32), scale = d * sc (sc int8, one per 16 weights: its code is
# sc + 128), no offset. The bit layout is dequant.py's _decode_q6_k.
@_register(T.Q6_K, group=16, bits=8, has_min=False, width=6, zero=32,
           sub=SubSpec(bits=8, offset=128, groups_per_super=16, with_mins=False))
def _split_q6_k(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    codes = np.empty((len(blocks), 2, 4, 32), np.uint8)  # B, half h, group g, l
    _unpack_nibbles(blocks["ql"].reshape(-1, 2, 2, 32), codes[:, :, 0:2], codes[:, :, 2:4])
    high = blocks["qh"].reshape(-1, 2, 1, 32) >> _Q6_HIGH_SHIFTS
    high &= 0x03
    high <<= 4
    codes |= high
    q[:] = codes.reshape(-1, 256)
    q -= 32
    _sub_scales(blocks, sub, (blocks["scales"].view(np.int8).astype(np.int16) + 128).astype(np.uint8),
                scale, offset=128)
    min_[:] = -0.0


# Lossless: q = 2-bit code, scale = d * (sc & 15), min = -(dmin * (sc >> 4)), ggml's products.
@_register(T.Q2_K, group=16, bits=8, width=2,
           sub=SubSpec(bits=4, offset=0, groups_per_super=16, with_mins=True))
def _split_q2_k(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    q[:] = q2_k_codes(blocks)
    _sub_scales(blocks, sub, blocks["scales"] & 0x0F, scale, min_codes=blocks["scales"] >> 4, min_=min_)


# Lossless: q = c - 4 in [-4, 4), scale = d * (s - 32), no offset (ggml's (d * (s - 32)) * (c - 4)).
@_register(T.Q3_K, group=16, bits=8, has_min=False, width=3, zero=4,
           sub=SubSpec(bits=6, offset=32, groups_per_super=16, with_mins=False))
def _split_q3_k(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                sub: BlockSub | None) -> None:
    q[:] = q3_k_codes(blocks)
    q -= 4
    _sub_scales(blocks, sub, q3_k_scale_codes(blocks), scale, offset=32)
    min_[:] = -0.0


# Lossless but for the sign of zero weights: q = ternary code in {0, 1, 2}, scale = d, min = -d,
# one group per 256-weight block (the LUT kernel's widest 2-bit group is 344).
@_register(T.TQ2_0, group=256, bits=2, has_min=False, zero=1)
def _split_tq2_0(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                 sub: BlockSub | None) -> None:
    q[:] = _planar_two_bit_codes(blocks["qs"])
    _ternary_scale_and_min(blocks, scale, min_)


@_register(T.TQ1_0, group=256, bits=2, has_min=False, zero=1)  # as TQ2_0
def _split_tq1_0(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                 sub: BlockSub | None) -> None:
    q[:] = tq1_0_codes(blocks)
    _ternary_scale_and_min(blocks, scale, min_)


def _ternary_scale_and_min(blocks: np.ndarray, scale: np.ndarray, min_: np.ndarray) -> None:
    scale[:] = _half(blocks, "d")
    np.negative(scale, out=min_)


# --- codebook types: 4-bit indices into the table of small integers ------------------------------

def _nibble_indices(qs: np.ndarray) -> np.ndarray:
    """[B, 16n] bytes -> indices [B, 32n], in table_codes' order (per 16 bytes: low nibbles, then high)."""
    nibbles = np.empty((len(qs), qs.shape[1] // 16, 2, 16), np.uint8)
    _unpack_nibbles(qs.reshape(len(qs), -1, 16), nibbles[:, :, 0], nibbles[:, :, 1])
    return nibbles.reshape(len(qs), -1)


# lossless: q = nibble, codes = table[q], scale = d
@_register(T.IQ4_NL, group=32, bits=8, has_min=False, codebook="iq4nl")
def _split_iq4_nl(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                  sub: BlockSub | None) -> None:
    q[:] = _nibble_indices(blocks["qs"])
    scale[:] = _half(blocks, "d")
    min_[:] = -0.0


# lossless: q = nibble, codes = table[q], scale = d * (ls - 32) per 32 weights, ggml's product
@_register(T.IQ4_XS, group=32, bits=8, has_min=False, codebook="iq4nl",
           sub=SubSpec(bits=6, offset=32, groups_per_super=8, with_mins=False))
def _split_iq4_xs(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                  sub: BlockSub | None) -> None:
    q[:] = _nibble_indices(blocks["qs"])
    _sub_scales(blocks, sub, iq4_xs_scale_codes(blocks), scale, offset=32)
    min_[:] = -0.0


_HALF_MAX_EXPONENT = 15  # 2^15 is the largest power of two float16 holds
# Per largest |code| p of a group (0..12): the most doublings that keep p * 2^k within int8.
_FOLD_HEADROOM = np.array([0] + [(127 // peak).bit_length() - 1 for peak in range(1, 13)], np.int32)


class _ScaleNeedsFolding(Exception):
    """An MXFP4 block scale above float16's 2^15: the matrix needs int8 codes (see _split_mxfp4_codes)."""


# Lossless: q = nibble, codes = table[q], scale = 2^(e - 128), a power of two float16 holds exactly
# from 2^-24 to 2^15. A group of zero codes gets the scale 1 (any scale gives its +0.0). A larger
# scale (a weight of magnitude 2^16 or more: no trained model has one) sends the whole matrix to
# _split_mxfp4_codes; a scale below 2^-24 is left for `packed.pack` to refuse.
@_register(T.MXFP4, group=32, bits=8, has_min=False, codebook="mxfp4")
def _split_mxfp4(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                 sub: BlockSub | None) -> None:
    q[:] = _nibble_indices(blocks["qs"])
    exponent = np.where((q & 7).any(axis=1), mxfp4_exponents(blocks), 0)  # indices 0 and 8 are zeros
    if exponent.max(initial=0) > _HALF_MAX_EXPONENT:
        raise _ScaleNeedsFolding
    scale[:, 0] = np.ldexp(np.float32(1), exponent)
    min_[:] = -0.0


# Lossless: q = 2^k * table[nibble], scale = 2^(e - 128 - k): k moves powers of two from a scale
# above 2^15 into the codes (as far as int8 allows: 3 doublings for a code of 12), so the packed
# float16 scale stays exact up to 2^18. A scale below 2^-24 cannot move the other way (the codes
# 1 and 3 are odd): it and any scale still above 2^15 are left for `packed.pack` to refuse.
def _split_mxfp4_codes(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                       sub: BlockSub | None) -> None:
    codes = table_codes(blocks["qs"], MXFP4_VALUES)  # [B, 32] int8
    peak = np.abs(codes).max(axis=1)
    exponent = mxfp4_exponents(blocks)
    fold = np.clip(exponent - _HALF_MAX_EXPONENT, 0, _FOLD_HEADROOM[peak])
    q[:] = codes << fold[:, None].astype(np.int8)
    scale[:, 0] = np.ldexp(np.float32(1), np.where(peak == 0, 0, exponent - fold))
    min_[:] = -0.0


_FOLDED_MXFP4 = GroupLayout(32, 8, False, _split_mxfp4_codes)


# --- tierflow's own low-bit types (tierflow.ggml_types): y = d * q + m, lossless -----------------

@_register(TierflowType.TQ2_1, group=32, bits=2)
def _split_tq2_1(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                 sub: BlockSub | None) -> None:
    q[:] = _two_bit_quants(blocks["qs"])
    scale[:] = _half(blocks, "d")
    min_[:] = _half(blocks, "m")


@_register(TierflowType.TQ3_1, group=32, bits=3)
def _split_tq3_1(blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, min_: np.ndarray,
                 sub: BlockSub | None) -> None:
    q[:] = _low_bits_first(blocks["qh"])
    q <<= 2
    q |= _two_bit_quants(blocks["qs"])
    scale[:] = _half(blocks, "d")
    min_[:] = _half(blocks, "m")


GROUPED_TYPES: frozenset[int] = frozenset(_LAYOUTS)


def group_layout(ggml_type: int) -> GroupLayout:
    """Group size, code bits and whether mins exist, for a group-quantized type."""
    layout = _LAYOUTS.get(ggml_type)
    if layout is None:
        supported = ", ".join(_type_name(t) for t in sorted(_LAYOUTS))
        raise UnsupportedModelError(
            f"tensor type {_type_name(ggml_type)} is not group-quantized; supported: {supported}"
        )
    return layout


def to_quant_groups(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> QuantGroups:
    """Decode a 2-D quantized tensor's raw bytes to codes, scales and offsets per group.

    Arguments are those of `dequant.dequantize`: 1-D uint8 bytes (only read), the GGML type, and
    the GGUF-order shape (K = shape[0] columns, N = shape[1] rows). Float types are not
    group-quantized and raise UnsupportedModelError, as does a tensor that is not 2-D.
    Peak memory is the result (K bytes per row for q, plus 8 bytes per group) plus about one
    chunk of temporaries.
    """
    data = np.asarray(data)  # a plain ndarray view, so ufuncs do not return memmaps
    if data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError(f"expected 1-D uint8 bytes, got {data.dtype} of shape {data.shape}")
    shape = tuple(int(dim) for dim in shape)
    layout = group_layout(ggml_type)
    if len(shape) != 2:
        raise UnsupportedModelError(
            f"{_type_name(ggml_type)} tensor of shape {list(shape)} is not a 2-D matrix"
        )
    try:
        return _split_blocks(data, ggml_type, shape, layout)
    except _ScaleNeedsFolding:
        return _split_blocks(data, ggml_type, shape, _FOLDED_MXFP4)


def _split_blocks(data: np.ndarray, ggml_type: int, shape: tuple[int, int],
                  layout: GroupLayout) -> QuantGroups:
    fmt = _format_of(ggml_type)
    num_blocks = _check_size(data, fmt, ggml_type, shape)
    row_length, num_rows = shape
    groups_per_block = fmt.block_size // layout.group
    q = np.empty((num_rows, row_length), np.int8 if layout.bits == 8 and not layout.codebook else np.uint8)
    scale = np.empty((num_rows, row_length // layout.group), np.float32)
    min_ = np.empty_like(scale)
    sub = _empty_sub(layout.sub, scale.shape, num_blocks)
    # A row is whole blocks and a block whole groups, so all three views run block by block.
    block_q = q.reshape(num_blocks, fmt.block_size)
    block_scale = scale.reshape(num_blocks, groups_per_block)
    block_min = min_.reshape(num_blocks, groups_per_block)
    blocks = np.ascontiguousarray(data).view(fmt.block_dtype)
    step = max(1, _CHUNK_ELEMENTS // fmt.block_size)
    for start in range(0, num_blocks, step):
        chunk = slice(start, start + step)
        layout.split(blocks[chunk], block_q[chunk], block_scale[chunk], block_min[chunk],
                     None if sub is None else _block_sub(sub, chunk, num_blocks))
    return QuantGroups(q, scale, min_, layout.group, layout.bits, layout.codebook, layout.width, layout.zero,
                       sub)


def _empty_sub(spec: SubSpec | None, groups_shape: tuple[int, int], num_blocks: int) -> SubScales | None:
    """The arrays the splitters fill with the file's two-level scales (one super block per block)."""
    if spec is None:
        return None
    rows, supers = groups_shape[0], num_blocks // groups_shape[0]
    codes = lambda: np.empty(groups_shape, np.uint8)  # noqa: E731
    halves = lambda: np.empty((rows, supers), np.float32)  # noqa: E731
    return SubScales(codes(), codes() if spec.with_mins else None, halves(),
                     halves() if spec.with_mins else None, spec.bits, spec.offset)


def _block_sub(sub: SubScales, chunk: slice, num_blocks: int) -> BlockSub:
    def blocks(array: np.ndarray | None, per_block: int) -> np.ndarray | None:
        return None if array is None else array.reshape(num_blocks, per_block)[chunk]

    per_block = sub.scale_codes.size // num_blocks
    return BlockSub(blocks(sub.scale_codes, per_block), blocks(sub.min_codes, per_block),
                    blocks(sub.d, 1), blocks(sub.dmin, 1))


def stack_rows(parts: list[QuantGroups]) -> QuantGroups:
    """One matrix of the parts' rows in order (e.g. Q, K and V as one projection)."""
    first = parts[0]

    def key(p: QuantGroups) -> tuple:
        return p.group, p.bits, p.codebook, p.q.shape[1], p.width, p.zero, p.sub and p.sub.form

    if any(key(p) != key(first) for p in parts):
        raise ValueError("only matrices with the same columns, group, bits, codebook and scales stack")

    def rows(name: str, of=lambda p: p) -> np.ndarray | None:
        arrays = [getattr(of(p), name) for p in parts]
        return None if arrays[0] is None else np.concatenate(arrays)

    sub = None if first.sub is None else SubScales(
        *(rows(name, lambda p: p.sub) for name in ("scale_codes", "min_codes", "d", "dmin")),
        first.sub.bits, first.sub.offset)
    return QuantGroups(rows("q"), rows("scale"), rows("min"), first.group, first.bits, first.codebook,
                       first.width, first.zero, sub)
