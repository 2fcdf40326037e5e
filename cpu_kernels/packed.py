"""The packed weight format: the bytes the CPU kernels read directly, one layout for every tier.

A weight matrix W [N rows, K columns] with, per row and per group of `group` columns,
`w = scale * q + min` (see quant_groups.py) is stored as three arrays. Rows are padded with zero
weights to whole tiles of 64 (TILE_ROWS); T = ceil(N / 64) tiles, G = K / group groups.

    scales  float16 [T, G, 64]    scale of (tile t, group g, row r)
    mins    float16 [T, G, 64]    min of the same; absent (None) for int8 codes with no offset
    data    one of two layouts, chosen by `bits`:

bits 1..4, the LUT kernel (codes unsigned, 0 .. 2**bits - 1), uint8 [T, K / 8, bits, 64]:
    byte (t, o, p, r) holds bit p of the codes of row 64t + r in the 8 columns 8o .. 8o+7:
    bit j of the byte is bit p of column 8o + j. So each byte is two 4-bit table indices (low
    nibble: columns 8o..8o+3, high nibble: 8o+4..8o+7), and a tile is read front to back once.
    Requires group % 8 == 0 and group <= the kernel's int16 overflow limit (LUT_MAX_GROUP: 1032,
    344, 144 and 64 columns at 1, 2, 3 and 4 bits).

bits 8, the int8 kernel (codes signed), int8 [T, K / 4, 64, 4]:
    byte (t, c, r, j) is the code of row 64t + r, column 4c + j. Requires group % 4 == 0.

bits 8 with a codebook (IQ4_NL, IQ4_XS: "iq4nl"; MXFP4: "mxfp4"), the int8 kernel on 4-bit
indices into the codebook's 16 int8 codes (quant_groups.CODEBOOKS), uint8 [T, K / 8, 64, 4]:
    byte (t, o, r, j) holds in its low nibble the index of row 64t + r, column 8o + j, in its high
    nibble that of column 8o + 4 + j. So the low nibbles of a 256-byte block are the int8
    layout's quad 2o and the high nibbles its quad 2o + 1: the kernel looks the codes up in
    registers and computes exactly as on the int8 layout of the same codes, from half the bytes.
    Requires group % 8 == 0.

How GGUF types land here (quant_groups.py does the decoding):
    Q4_0, Q4_1          4 bits, group 32: lossless
    Q4_K                4 bits, group 32: scales d*sc and mins dmin*m rounded to float16
    Q8_0, Q5_0          int8, group 32, no mins: lossless
    Q5_1                int8, group 32, with mins: lossless
    Q5_K                int8, group 32, with mins: d*sc and dmin*m rounded to float16
    Q6_K                int8, group 16, no mins: d*sc rounded to float16
    Q2_K                2 bits, group 16: scales d*(sc&15) and mins dmin*(sc>>4) rounded to float16
    Q3_K                3 bits, group 16: scales d*(s-32) rounded to float16; mins -4 x scale, rounded
                        alike (exactly -4 x the rounded scale unless that is a float16 subnormal)
    TQ1_0, TQ2_0        2 bits, group 256 (one block): scale d, min -d: lossless
    IQ4_NL              codebook iq4nl, group 32, no mins: lossless
    IQ4_XS              codebook iq4nl, group 32, no mins: d*(ls-32) rounded to float16
    MXFP4               codebook mxfp4, group 32, no mins: 2^(e-128) is exact in float16 from 2^-24
                        to 2^15; a matrix with a larger scale becomes int8 codes, exact up to 2^18 by
                        folding powers of two into them (quant_groups.py); a scale outside that is
                        refused here, never rounded to 0 or inf
Float16 holds d (a float16) times a 4- to 8-bit integer sub-scale to within 2^-11 relative, far
below the quantization step itself; the Q4_0/Q4_1/Q8_0/Q5_x/IQ4_NL/MXFP4/TQ mappings are exact.

Packing is vectorised numpy: a 4096 x 4096 matrix packs in well under a second.
"""

from dataclasses import dataclass

import numpy as np

from tierflow.cpu_kernels.quant_groups import CODEBOOKS, QuantGroups

TILE_ROWS = 64
# The C kernels' codebook ids (kernels.h's codebook_t): 0 is none, the int8 layout.
CODEBOOK_IDS = {name: index + 1 for index, name in enumerate(CODEBOOKS)}
LUT_BITS = (1, 2, 3, 4)
# Per group, a row's int16 accumulator sums group/8 look-up pairs of up to 2*127, times 2^bits - 1.
LUT_MAX_GROUP = {bits: 8 * (32767 // (254 * ((1 << bits) - 1))) for bits in LUT_BITS}


@dataclass(frozen=True)
class PackedMatrix:
    rows: int  # N, before padding
    cols: int  # K
    bits: int  # 1..4 (LUT kernel) or 8 (int8 kernel)
    group: int
    data: np.ndarray  # see the module docstring
    scales: np.ndarray  # float16 [T, G, 64]
    mins: np.ndarray | None  # float16 [T, G, 64]
    codebook: str | None = None  # bits 8: data holds 4-bit indices into CODEBOOKS[codebook]

    @property
    def tiles(self) -> int:
        return -(-self.rows // TILE_ROWS)

    @property
    def codebook_id(self) -> int:
        """The codebook as the C kernels name it (0: none)."""
        return 0 if self.codebook is None else CODEBOOK_IDS[self.codebook]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def codes(self) -> np.ndarray:
        """The codes q [N, K] (uint8 for LUT bits, int8 for 8: a codebook's entries), undoing the layout."""
        if self.codebook is not None:
            q = self.int8_data().transpose(0, 2, 1, 3).reshape(self.tiles * TILE_ROWS, self.cols)
        elif self.bits == 8:
            q = self.data.transpose(0, 2, 1, 3).reshape(self.tiles * TILE_ROWS, self.cols)
        else:
            bits = np.unpackbits(self.data[..., None], axis=-1, bitorder="little")  # [T, K/8, b, 64, 8]
            weights = (1 << np.arange(self.bits, dtype=np.uint8))[None, None, :, None, None]
            q = (bits * weights).sum(axis=2, dtype=np.uint8)  # [T, K/8, 64, 8]
            q = q.transpose(0, 2, 1, 3).reshape(self.tiles * TILE_ROWS, self.cols)
        return q[: self.rows]

    def int8_data(self) -> np.ndarray:
        """The data in the int8 layout, int8 [T, K/4, 64, 4]: the codes a codebook's indices select."""
        if self.codebook is None:
            return self.data
        codes = CODEBOOKS[self.codebook][_split_nibbles(self.data)]  # [T, K/8, 64, 2, 4]
        return codes.transpose(0, 1, 3, 2, 4).reshape(self.tiles, self.cols // 4, TILE_ROWS, 4)

    def as_int8(self) -> "PackedMatrix":
        """The matrix in the int8 layout (a copy when it has a codebook), for kernels that read only that."""
        if self.codebook is None:
            return self
        return PackedMatrix(self.rows, self.cols, 8, self.group, self.int8_data(), self.scales, self.mins)

    def group_params(self) -> tuple[np.ndarray, np.ndarray]:
        """Float32 scales and mins [N, G] (mins zero where absent)."""
        def unpad(a: np.ndarray) -> np.ndarray:
            return a.transpose(0, 2, 1).reshape(-1, self.cols // self.group)[: self.rows].astype(np.float32)

        scales = unpad(self.scales)
        return scales, (np.zeros_like(scales) if self.mins is None else unpad(self.mins))

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
        groups = self.cols // self.group
        if self.codebook is not None:
            indices = _split_nibbles(self.data[tile, :, row, :])  # [n, K/8, 2, 4]
            q = CODEBOOKS[self.codebook][indices].reshape(len(ids), self.cols).astype(np.float32)
        elif self.bits == 8:
            q = self.data[tile, :, row, :].reshape(len(ids), self.cols).astype(np.float32)
        else:
            planes = self.data[tile, :, :, row]  # [n, K/8, bits]
            bits = np.unpackbits(planes[..., None], axis=-1, bitorder="little")  # [n, K/8, b, 8]
            weights = (1 << np.arange(self.bits, dtype=np.uint8))[None, None, :, None]
            q = (bits * weights).sum(axis=2, dtype=np.uint8).reshape(len(ids), self.cols).astype(np.float32)
        scales = self.scales[tile, :, row].astype(np.float32)
        mins = 0.0 if self.mins is None else self.mins[tile, :, row].astype(np.float32)[..., None]
        q = q.reshape(len(ids), groups, self.group) * scales[..., None] + mins
        return q.reshape(len(ids), self.cols)


def _split_nibbles(data: np.ndarray) -> np.ndarray:
    """Nibble bytes [..., 4] -> indices [..., 2, 4]: the low nibbles, then the high ones."""
    return np.stack([data & 0x0F, data >> 4], axis=-2)


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
    padded = np.zeros((tiles * TILE_ROWS, values.shape[1]), values.dtype)
    padded[: values.shape[0]] = values
    return np.ascontiguousarray(padded.reshape(tiles, TILE_ROWS, -1).transpose(0, 2, 1))


def pack(groups: QuantGroups, with_mins: bool | None = None) -> PackedMatrix:
    """Lays out codes, scales and mins for the kernels. int8 codes keep their mins when with_mins,
    or when None, when any is nonzero (LUT codes always keep them: their offsets centre them)."""
    rows, cols = groups.q.shape
    tiles = -(-rows // TILE_ROWS)
    if groups.codebook is not None:
        data = _nibble_data(groups, tiles)
        has_mins = _int8_has_mins(groups, with_mins)
    elif groups.bits == 8:
        if groups.group % 4:
            raise ValueError(f"int8 codes need a group that is a multiple of 4, not {groups.group}")
        q = np.zeros((tiles * TILE_ROWS, cols), np.int8)
        q[:rows] = groups.q
        data = q.reshape(tiles, TILE_ROWS, cols // 4, 4).transpose(0, 2, 1, 3)
        has_mins = _int8_has_mins(groups, with_mins)
    elif groups.bits in LUT_BITS:
        if groups.group % 8 or groups.group > LUT_MAX_GROUP[groups.bits]:
            raise ValueError(f"{groups.bits}-bit codes need a group that is a multiple of 8 and at most "
                             f"{LUT_MAX_GROUP[groups.bits]}, not {groups.group}")
        q = np.zeros((tiles * TILE_ROWS, cols), np.uint8)
        q[:rows] = groups.q
        q = q.reshape(tiles, TILE_ROWS, cols // 8, 8).transpose(0, 2, 1, 3)  # [T, K/8, 64, 8]
        planes = (q[:, :, None] >> np.arange(groups.bits, dtype=np.uint8)[None, None, :, None, None]) & 1
        data = np.packbits(planes, axis=-1, bitorder="little")[..., 0]  # [T, K/8, bits, 64]
        has_mins = True
    else:
        raise ValueError(f"cannot pack {groups.bits}-bit codes")
    scales = _tiled_params(_to_half(groups.scale, "scale"), tiles)
    mins = _tiled_params(_to_half(groups.min, "min"), tiles) if has_mins else None
    return PackedMatrix(rows, cols, groups.bits, groups.group, np.ascontiguousarray(data), scales, mins,
                        groups.codebook)


def _int8_has_mins(groups: QuantGroups, with_mins: bool | None) -> bool:
    nonzero = bool(np.any(groups.min != 0))
    if with_mins is False and nonzero:
        raise ValueError("int8 codes with nonzero mins cannot be packed without them")
    return nonzero if with_mins is None else with_mins


def _nibble_data(groups: QuantGroups, tiles: int) -> np.ndarray:
    """Codebook indices [N, K] -> uint8 [T, K/8, 64, 4], two quads per byte (see the docstring)."""
    rows, cols = groups.q.shape
    if groups.group % 8:
        raise ValueError(f"codebook indices need a group that is a multiple of 8, not {groups.group}")
    q = np.zeros((tiles * TILE_ROWS, cols), np.uint8)
    q[:rows] = groups.q
    pairs = q.reshape(tiles, TILE_ROWS, cols // 8, 2, 4).transpose(0, 2, 1, 3, 4)  # [T, K/8, 64, 2, 4]
    return pairs[..., 0, :] | (pairs[..., 1, :] << 4)
