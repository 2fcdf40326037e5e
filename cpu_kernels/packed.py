"""The packed weight format: the bytes the CPU kernels read directly, one layout for every tier.

A weight matrix W [N rows, K columns] with, per row and per group of `group` columns,
`w = scale * q + min` (see quant_groups.py) is stored as codes plus the scales that turn them
into weights. Rows are padded with zero weights to whole tiles of 64 (TILE_ROWS); T = ceil(N / 64)
tiles, G = K / group groups. Every format holds no more bytes than the GGUF type it comes from
(TQ1_0, whose base-3 packing is 1.6 bits a weight, is the one exception: 2 bits here).

Codes, `data`, in one of four layouts:

bits 1..4, the LUT kernel (codes unsigned, 0 .. 2**bits - 1), uint8 [T, K / 8, bits, 64]:
    byte (t, o, p, r) holds bit p of the codes of row 64t + r in the 8 columns 8o .. 8o+7:
    bit j of the byte is bit p of column 8o + j. So each byte is two 4-bit table indices (low
    nibble: columns 8o..8o+3, high nibble: 8o+4..8o+7), and a tile is read front to back once.
    Requires group % 8 == 0 and group <= the kernel's int16 overflow limit (LUT_MAX_GROUP: 1032,
    344, 144 and 64 columns at 1, 2, 3 and 4 bits).

bits 8, width 8, the int8 kernel (codes signed), int8 [T, K / 4, 64, 4]:
    byte (t, c, r, j) is the code of row 64t + r, column 4c + j. Requires group % 4 == 0.

bits 8, width 2..6 (Q2_K, Q3_K, Q4_x, Q5_x, Q6_K), the int8 kernel on unsigned codes u = q + zero of
`width` bits, their low f bits (f = 4 from width 4 on, else 2) in fields of data, uint8
[T, K * f / 32, 64, 4], and for h = width - f > 0 (widths 3, 5, 6) the rest in `high`, uint8
[T, K * h / 32, 64, 4]:
    data byte (t, o, r, j) holds at bits f*i .. f*i + f - 1 column 4 (8 / f * o + i) + j of row 64t + r:
    a 256-byte block of data holds the int8 layout's quads 8/f * o .. 8/f * o + 8/f - 1 (nibbles: quad
    2o in the low nibbles, 2o + 1 in the high ones). High byte (t, b, r, j) holds at bits h*i ..
    h*i + h - 1 the high bits of quad (8 / h) * b + i. The kernel assembles u in registers and subtracts
    zero: exactly the int8 layout's arithmetic on the same codes, from width / 8 of its bytes.
    Requires group % (32 / f) == 0 and K % (32 / h) == 0.

bits 8 with a codebook (IQ4_NL, IQ4_XS: "iq4nl"; MXFP4: "mxfp4"), the int8 kernel on 4-bit
indices into the codebook's 16 int8 codes (quant_groups.CODEBOOKS): the nibble layout above,
each nibble an index, looked up in registers.

Scales, in one of two forms:

    scales  float16 [T, G, 64]    scale of (tile t, group g, row r)
    mins    float16 [T, G, 64]    min of the same; None when the format has no offset: then the
                                  min is the zero code's, -zero * scale (LUT codes; int8 codes
                                  subtract zero instead and need no min)

or, for the K-quants and IQ4_XS, the file's own two-level scales (`sub`, a SubPacking): per super
block of S groups a float16 d (and dmin) per row, and per group a `sub.bits`-bit unsigned code,
scale = d * (code - offset) and min = -(dmin * min code), ggml's float32 products exactly:

    sub.supers  float16 [T, K / (S * group), 1 or 2, 64]   d (and dmin) of each row
    sub.codes   uint8   [T, K / (S * group), B, 64]        each row's V = S (or 2S, with mins)
                                                           codes, scale then min per group:
        bits 8: byte v is code v (B = V); bits 4: byte i holds codes 2i (low nibble) and 2i + 1
        (B = V / 2); bits 6: as bits 4 for their low nibbles, then V / 4 bytes whose byte i holds
        the top 2 bits of codes 4i + k at bits 2k (B = 3V / 4).

How GGUF types land here (quant_groups.py does the decoding), bytes per 256 weights as the file's:
    Q4_0, Q5_0          width 4, 5, zero 8, 16; float16 scales, no mins       144, 176
    Q4_1, Q5_1          width 4, 5; float16 scales and mins                   160, 192
    Q8_0                width 8; float16 scales                               272
    Q4_K, Q5_K          width 4, 5; sub: 6-bit scale and min per 32, d, dmin  144, 176
    Q6_K                width 6, zero 32; sub: 8-bit scale (int8 + 128) per 16, d     210
    Q2_K                width 2; sub: 4-bit scale and min per 16, d, dmin            84
    Q3_K                width 3, zero 4; sub: 6-bit scale (s, offset 32) per 16, d   110
    TQ2_0, TQ1_0        2 bits (LUT), group 256, zero 1; float16 scales       66 (TQ1_0's file: 54)
    IQ4_NL              codebook iq4nl; float16 scales                        144
    IQ4_XS              codebook iq4nl; sub: 6-bit scale (ls, offset 32) per 32, d    136
    MXFP4               codebook mxfp4; float16 scales 2^(e-128), exact from 2^-24 to 2^15 (a
                        matrix with a larger scale becomes int8 codes, exact up to 2^18 by folding
                        powers of two into them: quant_groups.py); one outside that is refused
                        here, never rounded to 0 or inf                       144 (the file's: 136)
Every mapping is exact: the kernels compute with the file's own codes and ggml's own scales.

Packing is vectorised numpy: a 4096 x 4096 matrix packs in well under a second. The legacy types
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), Q4_K, Q5_K and Q6_K, most files' bulk, and IQ4_NL, IQ4_XS and
MXFP4 (gpt-oss's experts) go straight from their GGUF blocks to this layout in C (pack_blocks,
transcode_blocks), bit for bit what packing their quant groups gives.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
from gguf import GGMLQuantizationType as T

from tierflow.cpu_kernels import _kernels
from tierflow.cpu_kernels.quant_groups import CODEBOOKS, QuantGroups, SubScales, group_layout

TILE_ROWS = 64
# The C kernels' codebook ids (kernels.h's codebook_t): 0 is none, the int8 layout.
CODEBOOK_IDS = {name: index + 1 for index, name in enumerate(CODEBOOKS)}
LUT_BITS = (1, 2, 3, 4)
NARROW_WIDTHS = (2, 3, 4, 5, 6)  # unsigned codes in fields (+ high), see field_bits
SUB_BITS = (4, 6, 8)
# Per group, a row's int16 accumulator sums group/8 look-up pairs of up to 2*127, times 2^bits - 1.
LUT_MAX_GROUP = {bits: 8 * (32767 // (254 * ((1 << bits) - 1))) for bits in LUT_BITS}


@dataclass(frozen=True)
class SubPacking:
    """Two-level scales in the packed layout (see the module docstring)."""

    codes: np.ndarray  # uint8 [T, S', B, 64]
    supers: np.ndarray  # float16 [T, S', 1 or 2, 64]
    bits: int  # 4, 6 or 8
    offset: int
    groups_per_super: int
    with_mins: bool

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.supers.nbytes


def sub_code_bytes(bits: int, groups_per_super: int, with_mins: bool) -> int:
    """B: the bytes of a row's sub-scale codes in one super block."""
    values = groups_per_super * (2 if with_mins else 1)
    return values if bits == 8 else values // 2 + (values // 4 if bits == 6 else 0)


@dataclass(frozen=True)
class PackedMatrix:
    rows: int  # N, before padding
    cols: int  # K
    bits: int  # 1..4 (LUT kernel) or 8 (int8 kernel)
    group: int
    data: np.ndarray  # see the module docstring
    scales: np.ndarray | None  # float16 [T, G, 64]; None with sub
    mins: np.ndarray | None  # float16 [T, G, 64]
    codebook: str | None = None  # bits 8: data holds 4-bit indices into CODEBOOKS[codebook]
    width: int = 8  # bits 8: 2..6 for unsigned codes in fields (+ high), 8 for int8 codes
    zero: int = 0  # the code of a zero weight (LUT: min = -zero * scale without mins)
    high: np.ndarray | None = None  # widths 3, 5, 6: the codes' high bits
    sub: SubPacking | None = None  # two-level scales instead of scales and mins

    @property
    def tiles(self) -> int:
        return -(-self.rows // TILE_ROWS)

    @property
    def codebook_id(self) -> int:
        """The codebook as the C kernels name it (0: none)."""
        return 0 if self.codebook is None else CODEBOOK_IDS[self.codebook]

    @cached_property
    def kernel_arguments(self) -> tuple[tuple, tuple]:
        """The C matmul's arguments that name this matrix, those before x and y and those after
        `accumulate`, all positional (a call with keywords took twice as long to parse), made once: a
        decode step passes hundreds of matrices."""
        sub = self.sub
        two_level = (None, None, 0, 0, 0, False) if sub is None else (
            sub.codes, sub.supers, sub.bits, sub.offset, sub.groups_per_super, sub.with_mins)
        return ((self.bits, self.group, self.rows, self.data, self.scales, self.mins),
                (self.codebook_id, self.width, self.zero, self.high, *two_level))

    @property
    def field(self) -> int:
        """The bits of each code's field in data (int8 layout)."""
        return field_bits(self.width, self.codebook is not None)

    @property
    def centre(self) -> int:
        """What the int8 kernel subtracts from unsigned codes that have mins (and adds back through
        them): their middle code, so the rounding of the activations meets codes of half the size,
        as the LUT kernel's centred tables do."""
        has_mins = self.mins is not None or (self.sub is not None and self.sub.with_mins)
        plain = self.bits == 8 and self.codebook is None and self.width < 8
        return 1 << (self.width - 1) if plain and has_mins else 0

    @property
    def nbytes(self) -> int:
        return sum(0 if a is None else a.nbytes for a in (self.data, self.scales, self.mins, self.high)) + (
            0 if self.sub is None else self.sub.nbytes)

    def copy(self, empty: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty) -> "PackedMatrix":
        """The matrix in arrays of its own, each made by `empty(shape, dtype)` and filled."""
        def copied(a: np.ndarray | None) -> np.ndarray | None:
            if a is None:
                return None
            out = empty(a.shape, a.dtype)
            out[...] = a
            return out

        sub = self.sub and replace(self.sub, codes=copied(self.sub.codes), supers=copied(self.sub.supers))
        return replace(self, data=copied(self.data), scales=copied(self.scales), mins=copied(self.mins),
                       high=copied(self.high), sub=sub)

    def codes(self) -> np.ndarray:
        """The codes q [N, K] (uint8 for LUT bits, int8 for 8: a codebook's entries), undoing the layout."""
        if self.bits == 8:
            q = self.int8_data().transpose(0, 2, 1, 3).reshape(self.tiles * TILE_ROWS, self.cols)
        else:
            q = _plane_codes(self.data, self.bits).transpose(0, 2, 1, 3).reshape(-1, self.cols)
        return q[: self.rows]

    def int8_data(self) -> np.ndarray:
        """The data in the int8 layout, int8 [T, K/4, 64, 4]: the codes the kernel multiplies."""
        return self._int8_quads(self.data, self.high)

    def _int8_quads(self, data: np.ndarray, high: np.ndarray | None) -> np.ndarray:
        """[..., K/4 or K/8, R, 4] bytes of the data (and high) layout -> int8 quads [..., K/4, R, 4]."""
        field = self.field
        if self.bits != 8 or field == 8:
            return data
        quads = np.moveaxis(_split_fields(data, field), -2, -3)  # [..., K*f/32, 8/f, R, 4]
        quads = quads.reshape(*quads.shape[:-4], self.cols // 4, *quads.shape[-2:])
        if self.codebook is not None:
            return CODEBOOKS[self.codebook][quads]
        if high is not None:
            quads = quads | (_high_bits(high, self.width - field) << field)
        return (quads.astype(np.int16) - self.zero).astype(np.int8)

    def group_params(self) -> tuple[np.ndarray, np.ndarray]:
        """Float32 scales and mins [N, G] (mins the zero code's, or zero, where absent)."""
        scales, mins = self._params(self.scales, self.mins, self.sub and (self.sub.codes, self.sub.supers))
        return _rows_first(scales)[: self.rows], _rows_first(mins)[: self.rows]

    def _params(self, scales: np.ndarray | None, mins: np.ndarray | None,
                sub: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
        """Float32 scales and mins [..., G, R] from the arrays of the scales' form."""
        if sub is not None:
            scales, mins = _sub_params(self.sub, *sub)
            if mins is not None:
                return scales, mins
        else:
            scales = scales.astype(np.float32)
            if mins is not None:
                return scales, mins.astype(np.float32)
        zero = self.zero if self.bits != 8 else 0
        return scales, (scales * np.float32(-zero) if zero else np.zeros_like(scales))

    def sub_integers(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
        """Two-level scales as the int8 kernel multiplies them: each group's scale code less the
        offset and min code, int64 [N, G] (None without mins), and each super block's d and dmin,
        float32 [N, G / groups_per_super]."""
        sub = self.sub
        v = _sub_values(sub, sub.codes).astype(np.int64)  # [T, S', gps, 1|2, R]
        merged = lambda a: _rows_first(a.reshape(a.shape[0], -1, TILE_ROWS))[: self.rows]  # noqa: E731
        supers = lambda i: _rows_first(sub.supers[:, :, i, :].astype(np.float32))[: self.rows]  # noqa: E731
        mins = merged(v[..., 1, :]) if sub.with_mins else None
        return merged(v[..., 0, :] - sub.offset), mins, supers(0), supers(1) if sub.with_mins else None

    def dequantize(self) -> np.ndarray:
        """The float32 weights [N, K] the kernels compute with."""
        scales, mins = self.group_params()
        q = self.codes().astype(np.float32).reshape(self.rows, -1, self.group)
        return (q * scales[..., None] + mins[..., None]).reshape(self.rows, self.cols)

    def row_slice(self, ids: np.ndarray) -> np.ndarray:
        """Float32 weights of the rows `ids` [n] -> [n, K]: an embedding look-up."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise IndexError(f"row ids must be in 0..{self.rows - 1}")
        tile, row = np.divmod(ids, TILE_ROWS)

        def rows(array: np.ndarray | None, row_axis: int) -> np.ndarray | None:
            """array's rows (tile, row), each as a tile of one row: [n, ..., 1, ...]."""
            if array is None:
                return None
            index = [tile] + [slice(None)] * (array.ndim - 1)
            index[row_axis] = row
            picked = array[tuple(index)]  # [n, ...] with the row axis gone, advanced index first
            return np.expand_dims(picked, row_axis)

        if self.bits == 8:
            q = self._int8_quads(rows(self.data, 2), rows(self.high, 2))  # [n, K/4, 1, 4]
        else:
            q = _plane_codes(rows(self.data, 3), self.bits)  # [n, K/8, 1, 8]
        q = q.reshape(len(ids), self.cols).astype(np.float32)
        sub = self.sub and (rows(self.sub.codes, 3), rows(self.sub.supers, 3))
        scales, mins = (a[..., 0] for a in self._params(rows(self.scales, 2), rows(self.mins, 2), sub))
        q = q.reshape(len(ids), -1, self.group) * scales[..., None] + mins[..., None]
        return q.reshape(len(ids), self.cols)


def _rows_first(params: np.ndarray) -> np.ndarray:
    """[T, G, 64] -> [T * 64, G]."""
    return params.transpose(0, 2, 1).reshape(-1, params.shape[1])


def _plane_codes(planes: np.ndarray, bits: int) -> np.ndarray:
    """LUT bit planes [..., K/8, bits, R] -> codes [..., K/8, R, 8]."""
    unpacked = np.unpackbits(planes[..., None], axis=-1, bitorder="little")  # [..., K/8, b, R, 8]
    weights = (1 << np.arange(bits, dtype=np.uint8))[:, None, None]
    return (unpacked * weights).sum(axis=-3, dtype=np.uint8)


def _high_bits(high: np.ndarray, h: int) -> np.ndarray:
    """High bytes [..., K*h/32, R, 4] -> each quad's h high bits [..., K/4, R, 4]."""
    per_byte = 8 // h
    shifts = (h * np.arange(per_byte, dtype=np.uint8))[:, None, None]
    bits = (high[..., None, :, :] >> shifts) & ((1 << h) - 1)  # [..., K*h/32, 8/h, R, 4]
    return bits.reshape(*high.shape[:-3], -1, *high.shape[-2:])


def _sub_values(sub: "SubPacking", codes: np.ndarray) -> np.ndarray:
    """Sub codes [..., S', B, R] -> each group's scale code (and min code) [..., S', gps, 1|2, R]."""
    values = sub.groups_per_super * (2 if sub.with_mins else 1)
    if sub.bits == 8:
        v = codes
    else:
        low = codes[..., : values // 2, :]  # [..., S', V/2, R]
        v = np.stack([low & 0x0F, low >> 4], axis=-2).reshape(*low.shape[:-2], values, low.shape[-1])
        if sub.bits == 6:
            top = codes[..., values // 2:, :][..., None, :]  # [..., S', V/4, 1, R]
            shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]
            v = v | (((top >> shifts) & 3) << 4).reshape(v.shape)
    return v.reshape(*v.shape[:-2], sub.groups_per_super, 2 if sub.with_mins else 1, v.shape[-1])


def _sub_params(sub: "SubPacking", codes: np.ndarray, supers: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales and mins [..., G, R] float32 from sub codes [..., S', B, R] and supers [..., S', 1|2, R]:
    d * (code - offset) and -(dmin * min code), ggml's float32 products."""
    v = _sub_values(sub, codes)
    d = supers[..., :1, :].astype(np.float32)  # [..., S', 1, R]
    scale_codes = v[..., 0, :].astype(np.float32)
    scales = d * (scale_codes - np.float32(sub.offset)) if sub.offset else d * scale_codes
    merge = lambda a: a.reshape(*a.shape[:-3], -1, a.shape[-1])  # noqa: E731  [..., S', gps, R] -> G
    if not sub.with_mins:
        return merge(scales), None
    mins = -(supers[..., 1:2, :].astype(np.float32) * v[..., 1, :].astype(np.float32))
    return merge(scales), merge(mins)


def field_bits(width: int, codebook: bool = False) -> int:
    """The bits of each field of data for int8-kernel codes `width` bits wide: 8, 4 (4..6, or a
    codebook's indices) or 2 (2..3)."""
    return 4 if codebook else 8 if width == 8 else 4 if width >= 4 else 2


def _split_fields(data: np.ndarray, field: int) -> np.ndarray:
    """Bytes of `field`-bit fields [..., 4] -> the fields [..., 8 / field, 4], lowest bits first."""
    shifts = (field * np.arange(8 // field, dtype=np.uint8))[:, None]
    return (data[..., None, :] >> shifts) & ((1 << field) - 1)


def _to_half(values: np.ndarray, what: str) -> np.ndarray:
    """Rounded to float16; a value that would become infinite, or zero when it is not, is refused
    (an MXFP4 scale can be 2^127 or 2^-128), so no weight silently turns into inf or 0."""
    with np.errstate(over="ignore", under="ignore"):
        half = values.astype(np.float16)
    if not np.isfinite(half).all():
        raise ValueError(f"a {what} of {np.max(np.abs(values)):g} is outside the float16 range")
    flushed = (half == 0) & (values != 0)
    if flushed.any():
        raise ValueError(f"a {what} of {np.min(np.abs(values[flushed])):g} is outside the float16 range "
                         f"(it would round to zero)")
    return half


def _tiled_params(values: np.ndarray, tiles: int) -> np.ndarray:
    """[N, G] -> [T, G, 64], padded rows zero."""
    return np.ascontiguousarray(_tile_rows(values, tiles).reshape(tiles, TILE_ROWS, -1).transpose(0, 2, 1))


def pack(groups: QuantGroups, with_mins: bool | None = None) -> PackedMatrix:
    """Lays out codes and scales for the kernels. Float16 mins are kept when with_mins, or when None,
    when the format has them: LUT codes without a zero code, int8 codes whose mins are not all zero
    (two-level scales code their mins, if any, with the scales)."""
    rows, cols = groups.q.shape
    tiles = -(-rows // TILE_ROWS)
    high = None
    if groups.bits == 8:
        if groups.codebook is not None:
            data = _nibble_data(groups.q, groups.group, tiles)
        elif groups.width in NARROW_WIDTHS:
            data, high = _fields_and_high(groups, tiles)
        elif groups.width == 8:
            if groups.group % 4:
                raise ValueError(f"int8 codes need a group that is a multiple of 4, not {groups.group}")
            data = _tile_rows(groups.q, tiles).reshape(tiles, TILE_ROWS, cols // 4, 4).transpose(0, 2, 1, 3)
        else:
            raise ValueError(f"int8 codes are 2..6 or 8 bits wide, not {groups.width}")
    elif groups.bits in LUT_BITS:
        if groups.group % 8 or groups.group > LUT_MAX_GROUP[groups.bits]:
            raise ValueError(f"{groups.bits}-bit codes need a group that is a multiple of 8 and at most "
                             f"{LUT_MAX_GROUP[groups.bits]}, not {groups.group}")
        q = _tile_rows(groups.q, tiles).reshape(tiles, TILE_ROWS, cols // 8, 8).transpose(0, 2, 1, 3)
        planes = (q[:, :, None] >> np.arange(groups.bits, dtype=np.uint8)[None, None, :, None, None]) & 1
        data = np.packbits(planes, axis=-1, bitorder="little")[..., 0]  # [T, K/8, bits, 64]
    else:
        raise ValueError(f"cannot pack {groups.bits}-bit codes")
    fields = dict(codebook=groups.codebook, width=groups.width if groups.bits == 8 else 8, zero=groups.zero,
                  high=high)
    if groups.sub is not None:
        return PackedMatrix(rows, cols, groups.bits, groups.group, np.ascontiguousarray(data), None, None,
                            sub=_sub_packing(groups.sub, tiles), **fields)
    scales = _tiled_params(_to_half(groups.scale, "scale"), tiles)
    mins = _tiled_params(_to_half(groups.min, "min"), tiles) if _keeps_mins(groups, with_mins) else None
    return PackedMatrix(rows, cols, groups.bits, groups.group, np.ascontiguousarray(data), scales, mins,
                        **fields)


# The GGUF types pack_blocks lays out from their blocks (transcode.c).
BLOCK_PACKED_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL,
                                T.IQ4_XS, T.MXFP4})


class UnpackableBlocks(ValueError):
    """A tensor given to pack_blocks has a block scale the layout cannot hold: one that is not a
    finite number, or an MXFP4 scale float16 does not hold exactly (packing its quant groups says
    which, and why)."""

    def __init__(self, part: int):
        super().__init__(f"part {part} has a block scale the packed layout cannot hold")
        self.part = part


# The arrays transcode fills, in its argument order.
BLOCK_ARRAYS = ("data", "high", "sub_codes", "supers", "scales", "mins")


def block_array_shapes(ggml_type: int, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """The arrays a BLOCK_PACKED_TYPES matrix [rows, cols] packs into, by name (BLOCK_ARRAYS' order),
    each's shape and dtype; the arrays the type's form lacks are left out."""
    layout = group_layout(ggml_type)
    spec = layout.sub
    tiles, field = -(-rows // TILE_ROWS), field_bits(layout.width, layout.codebook is not None)
    h = layout.width - field if layout.width < 8 else 0
    shapes = {"data": ((tiles, cols * field // 32, TILE_ROWS, 4), np.int8 if field == 8 else np.uint8)}
    if h:
        shapes["high"] = ((tiles, cols * h // 32, TILE_ROWS, 4), np.uint8)
    if spec is None:
        shapes["scales"] = ((tiles, cols // layout.group, TILE_ROWS), np.float16)
        if layout.has_min:
            shapes["mins"] = shapes["scales"]
    else:
        supers = cols // layout.group // spec.groups_per_super
        code_bytes = sub_code_bytes(spec.bits, spec.groups_per_super, spec.with_mins)
        shapes["sub_codes"] = ((tiles, supers, code_bytes, TILE_ROWS), np.uint8)
        shapes["supers"] = ((tiles, supers, 2 if spec.with_mins else 1, TILE_ROWS), np.float16)
    return shapes


def transcode_blocks(parts: list[tuple[np.ndarray, tuple[int, int]]], ggml_type: int,
                     arrays: dict[str, np.ndarray], first: int = 0, end: int | None = None) -> None:
    """Writes rows first .. end (default: all) of the parts' stacked rows (GGUF bytes, GGUF-order
    shape [K, N]) into `arrays` (block_array_shapes'), from their GGUF blocks (transcode.c). `first`
    starts a tile; a range that ends at the last row zeroes the last tile's padding rows first, so
    the arrays need not start zeroed, and ranges that share no tile may be written by concurrent
    threads. UnpackableBlocks names the part with a scale the layout cannot hold."""
    if first % TILE_ROWS:
        raise ValueError(f"a range of rows starts a tile of {TILE_ROWS} rows, not at row {first}")
    rows = sum(shape[1] for _, shape in parts)
    end = rows if end is None else end
    if end == rows and rows % TILE_ROWS:
        for array in arrays.values():
            array[-1] = 0
    cols, start = parts[0][1][0], 0
    for index, (raw, shape) in enumerate(parts):
        low, stop = max(first, start), min(end, start + shape[1])
        if low < stop:
            row_bytes = raw.nbytes // shape[1]
            src = np.ascontiguousarray(raw[(low - start) * row_bytes: (stop - start) * row_bytes])
            outputs = (arrays.get(name) for name in BLOCK_ARRAYS)
            if _kernels.transcode(ggml_type, src, cols, low, *outputs) >= 0:
                raise UnpackableBlocks(index)
        start += shape[1]


def pack_blocks(parts: list[tuple[np.ndarray, tuple[int, int]]], ggml_type: int) -> PackedMatrix:
    """GGUF tensors of one BLOCK_PACKED_TYPES type (raw bytes, GGUF-order shape [K, N]), their rows
    stacked in order, laid out for the kernels: pack(stack_rows([to_quant_groups(...)])) to the bit,
    without the byte per weight in between. UnpackableBlocks names the part with a scale the layout
    cannot hold."""
    layout = group_layout(ggml_type)
    cols, rows = parts[0][1][0], sum(shape[1] for _, shape in parts)
    shapes = block_array_shapes(ggml_type, rows, cols)
    arrays = {name: np.empty(shape, dtype) for name, (shape, dtype) in shapes.items()}
    transcode_blocks(parts, ggml_type, arrays)
    spec = layout.sub
    sub = None if spec is None else SubPacking(arrays["sub_codes"], arrays["supers"], spec.bits, spec.offset,
                                               spec.groups_per_super, spec.with_mins)
    return PackedMatrix(rows, cols, layout.bits, layout.group, arrays["data"], arrays.get("scales"),
                        arrays.get("mins"), codebook=layout.codebook, width=layout.width, zero=layout.zero,
                        high=arrays.get("high"), sub=sub)


def _keeps_mins(groups: QuantGroups, with_mins: bool | None) -> bool:
    if groups.bits != 8:
        return groups.zero == 0 if with_mins is None else with_mins
    nonzero = bool(np.any(groups.min != 0))
    if with_mins is False and nonzero:
        raise ValueError("int8 codes with nonzero mins cannot be packed without them")
    return nonzero if with_mins is None else with_mins


def _tile_rows(q: np.ndarray, tiles: int) -> np.ndarray:
    """q [N, K] padded with zero rows to whole tiles [T * 64, K]."""
    padded = np.zeros((tiles * TILE_ROWS, q.shape[1]), q.dtype)
    padded[: len(q)] = q
    return padded


def _nibble_data(nibbles: np.ndarray, group: int, tiles: int) -> np.ndarray:
    """4-bit values [N, K] -> uint8 [T, K/8, 64, 4], two quads per byte (see the docstring)."""
    if group % 8:
        raise ValueError(f"4-bit codes need a group that is a multiple of 8, not {group}")
    q = _tile_rows(nibbles, tiles)
    pairs = q.reshape(tiles, TILE_ROWS, -1, 2, 4).transpose(0, 2, 1, 3, 4)  # [T, K/8, 64, 2, 4]
    return pairs[..., 0, :] | (pairs[..., 1, :] << 4)


def _fields_and_high(groups: QuantGroups, tiles: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Unsigned codes q + zero of `width` bits -> their low bits in fields and, above the field, the
    high plane (in C: numpy's strided shuffles made packing most of a first load)."""
    rows, cols = groups.q.shape
    field = field_bits(groups.width)
    h = groups.width - field
    blocks = 32 // field  # columns of a 256-byte block of fields
    if groups.group % blocks or (h and cols % (32 // h)):
        columns = 32 // h if h else blocks
        raise ValueError(f"{groups.width}-bit codes need a group that is a multiple of {blocks} and a "
                         f"multiple of {columns} columns, not group {groups.group} of {cols}")
    data = np.empty((tiles, cols * field // 32, TILE_ROWS, 4), np.uint8)
    high = np.empty((tiles, cols * h // 32, TILE_ROWS, 4), np.uint8) if h else None
    if not _kernels.pack_fields(np.ascontiguousarray(groups.q), groups.zero, groups.width, data, high):
        raise ValueError(f"codes plus zero {groups.zero} do not fit {groups.width} unsigned bits")
    return data, high


def _sub_packing(sub: SubScales, tiles: int) -> SubPacking:
    """The two-level scales [N, G] codes and [N, S] halves -> the packed sub codes and supers."""
    if sub.bits not in SUB_BITS:
        raise ValueError(f"sub-scale codes are 4, 6 or 8 bits, not {sub.bits}")
    gps, with_mins = sub.groups_per_super, sub.min_codes is not None
    values = np.stack([sub.scale_codes, sub.min_codes], axis=-1) if with_mins else sub.scale_codes[..., None]
    values = _tile_rows(values.reshape(len(values), -1), tiles)  # [T*64, S * V]
    values = values.reshape(tiles, TILE_ROWS, -1, gps * (2 if with_mins else 1)).transpose(0, 2, 3, 1)
    if sub.bits == 8:
        codes = values
    else:
        low = values & 0x0F
        codes = low[..., 0::2, :] | (low[..., 1::2, :] << 4)  # [T, S, V/2, 64]
        if sub.bits == 6:
            top = (values >> 4).reshape(tiles, values.shape[1], -1, 4, TILE_ROWS)
            shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]
            codes = np.concatenate([codes, np.bitwise_or.reduce(top << shifts, axis=-2)], axis=-2)
    halves = [sub.d] if not with_mins else [sub.d, sub.dmin]
    supers = np.stack([_tile_rows(_to_half(h, "super-block scale"), tiles) for h in halves], axis=-1)
    supers = supers.reshape(tiles, TILE_ROWS, -1, len(halves)).transpose(0, 2, 3, 1)
    return SubPacking(np.ascontiguousarray(codes, dtype=np.uint8), np.ascontiguousarray(supers), sub.bits,
                      sub.offset, gps, with_mins)
