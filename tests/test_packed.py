"""The packed weight layout: what pack() writes is what codes(), dequantize() and the kernels read."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.support.random_weights import random_tensor_bytes
from tests.test_dequant import random_tensor
from tierflow.cpu_kernels import _kernels
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.cpu_kernels.matmul import matmul
from tierflow.cpu_kernels.packed import (
    BLOCK_PACKED_TYPES,
    TILE_ROWS,
    PackedMatrix,
    UnpackableBlocks,
    block_array_shapes,
    pack,
    pack_blocks,
    transcode_blocks,
)
from tierflow.cpu_kernels.quant_groups import (
    CODEBOOKS,
    GROUPED_TYPES,
    QuantGroups,
    stack_rows,
    to_quant_groups,
)
from tierflow.ggml_types import QUANT_SIZES, TierflowType, type_name

ALL_BITS = (1, 2, 3, 4, 8)
ROW_COUNTS = (1, 63, 65, 130)  # within one tile, one short of it, just past it, past two
COLS_AND_GROUPS = [(32, 16), (96, 32), (128, 64)]  # every group here is within lut_max_group
# (bits, has_min): the LUT formats always carry mins; int8 with and without an offset.
KINDS = [(1, True), (2, True), (3, True), (4, True), (8, True), (8, False)]
kind_id = lambda kind: f"{kind[0]}bit" + ("" if kind[1] else "-nomin")  # noqa: E731


def random_codes(rng: np.random.Generator, rows: int, cols: int, bits: int) -> np.ndarray:
    """Uniform codes over the whole range: [0, 2**bits) uint8, or all of int8 for 8 bits."""
    if bits == 8:
        return rng.integers(-128, 128, (rows, cols), dtype=np.int8)
    return rng.integers(0, 1 << bits, (rows, cols), dtype=np.uint8)


def random_groups(rows: int, cols: int, bits: int, group: int, *, has_min: bool = True,
                  seed: int = 0, half_exact: bool = True) -> QuantGroups:
    """Random codes with Gaussian scales and mins (float16-representable when half_exact).

    Without has_min the mins are -0.0, as quant_groups makes them for formats with no offset.
    """
    rng = np.random.default_rng(seed)
    scale = rng.standard_normal((rows, cols // group)).astype(np.float32)
    min_ = rng.standard_normal((rows, cols // group)).astype(np.float32) if has_min else None
    if half_exact:
        scale = scale.astype(np.float16).astype(np.float32)
        min_ = None if min_ is None else min_.astype(np.float16).astype(np.float32)
    if min_ is None:
        min_ = np.full_like(scale, -0.0)
    return QuantGroups(random_codes(rng, rows, cols, bits), scale, min_, group, bits)


def codebook_groups(rows: int, cols: int, group: int, codebook: str, seed: int = 0) -> QuantGroups:
    """Random 4-bit indices into `codebook` with Gaussian float16 scales, no offset."""
    rng = np.random.default_rng(seed)
    scale = to_half(rng.standard_normal((rows, cols // group)).astype(np.float32))
    indices = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    return QuantGroups(indices, scale, np.full_like(scale, -0.0), group, 8, codebook)


def as_int8_codes(groups: QuantGroups) -> QuantGroups:
    """The same matrix as plain int8 codes, the codebook's entries."""
    return QuantGroups(groups.codes(), groups.scale, groups.min, groups.group, 8)


def to_half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("cols, group", COLS_AND_GROUPS, ids=lambda v: str(v))
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("bits", ALL_BITS)
def test_codes_round_trip_through_the_layout(bits, rows, cols, group):
    groups = random_groups(rows, cols, bits, group, seed=rows + cols)
    packed = pack(groups)
    assert packed.codes().dtype == groups.q.dtype
    assert np.array_equal(packed.codes(), groups.q)


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_lut_byte_holds_one_bit_plane_of_eight_columns(bits):
    # Byte (t, o, p, r): bit j is bit p of the code of row 64t + r in column 8o + j.
    groups = random_groups(130, 64, bits, 32, seed=bits)
    data = pack(groups).data
    assert data.shape == (3, 64 // 8, bits, TILE_ROWS) and data.dtype == np.uint8
    row, col = 129, 8 * 5 + 6
    tile, r = divmod(row, TILE_ROWS)
    octet, j = divmod(col, 8)
    for plane in range(bits):
        assert (data[tile, octet, plane, r] >> j) & 1 == (groups.q[row, col] >> plane) & 1


def test_int8_layout_is_quads_of_columns_per_row():
    # Byte (t, c, r, j) is the code of row 64t + r, column 4c + j.
    groups = random_groups(130, 64, 8, 32)
    data = pack(groups).data
    assert data.shape == (3, 64 // 4, TILE_ROWS, 4) and data.dtype == np.int8
    assert data[2, 7, 1, 3] == groups.q[129, 31]
    assert data[1, 0, 0, 0] == groups.q[64, 0]


def test_nibble_layout_holds_quads_2o_and_2o_plus_1_in_one_byte():
    # Byte (t, o, r, j): low nibble the index of row 64t + r, column 8o + j; high nibble column 8o + 4 + j.
    groups = codebook_groups(130, 64, 32, "iq4nl")
    data = pack(groups).data
    assert data.shape == (3, 64 // 8, TILE_ROWS, 4) and data.dtype == np.uint8
    assert data[2, 5, 1, 3] & 0x0F == groups.q[129, 43]
    assert data[2, 5, 1, 3] >> 4 == groups.q[129, 47]


def test_two_bit_layout_holds_quads_4o_to_4o_plus_3_in_one_byte_and_the_third_bit_in_high():
    # Q3_K: byte (t, o, r, j) holds at bits 2i, 2i + 1 the low bits of column 16o + 4i + j of row 64t + r;
    # high byte (t, b, r, j) at bit i the third bit of column 32b + 4i + j.
    shape = (256, 130)  # GGUF order
    groups = to_quant_groups(random_tensor(T.Q3_K, shape, seed=2), T.Q3_K, shape)
    packed = pack(groups)
    assert packed.data.shape == (3, 256 // 16, TILE_ROWS, 4)
    assert packed.high.shape == (3, 256 // 32, TILE_ROWS, 4)
    u = groups.q[129].astype(np.int16) + 4  # the unsigned codes of row 129: tile 2, row 1
    assert all((packed.data[2, 5, 1, 3] >> (2 * i)) & 3 == u[80 + 4 * i + 3] & 3 for i in range(4))
    assert all((packed.high[2, 6, 1, 3] >> i) & 1 == u[192 + 4 * i + 3] >> 2 for i in range(8))
    assert np.array_equal(packed.codes(), groups.q)


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
def test_codebook_matrix_reads_back_as_its_int8_layout(codebook):
    groups = codebook_groups(130, 96, 32, codebook, seed=3)
    nibbles, int8 = pack(groups), pack(as_int8_codes(groups))
    assert (nibbles.codebook, int8.codebook) == (codebook, None)
    assert np.array_equal(nibbles.codes(), int8.codes())
    expanded = nibbles.int8_data()
    assert (expanded.shape, expanded.dtype) == (int8.data.shape, np.int8)
    rows = expanded.transpose(0, 2, 1, 3).reshape(-1, 96)[:130]  # padding rows may differ: their scales are 0
    assert np.array_equal(rows, int8.codes())
    assert np.array_equal(nibbles.dequantize(), int8.dequantize())
    ids = np.array([129, 0, 63, 64, 64, 7])
    assert np.array_equal(nibbles.row_slice(ids), int8.row_slice(ids))


def test_codebook_data_is_half_the_int8_data():
    groups = codebook_groups(130, 96, 32, "mxfp4")
    assert 2 * pack(groups).data.nbytes == pack(as_int8_codes(groups)).data.nbytes


def test_codebook_group_not_a_multiple_of_eight_is_refused():
    with pytest.raises(ValueError, match="multiple of 8, not 4"):
        pack(codebook_groups(3, 48, 4, "iq4nl"))


def test_matrices_of_different_codebooks_do_not_stack():
    with pytest.raises(ValueError, match="codebook"):
        stack_rows([codebook_groups(3, 64, 32, "iq4nl"), codebook_groups(3, 64, 32, "mxfp4")])


@pytest.mark.parametrize("bits", ALL_BITS)
def test_padding_rows_are_zero_with_zero_params(bits):
    packed = pack(random_groups(65, 64, bits, 32))
    padded_codes = (packed.data[1, :, 1:] if bits == 8 else packed.data[1, ..., 1:])
    assert not padded_codes.any()
    assert not packed.scales[1, :, 1:].any() and not packed.mins[1, :, 1:].any()


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_group_params_are_the_float16_rounded_scales_and_mins(kind):
    bits, has_min = kind
    groups = random_groups(65, 96, bits, 32, has_min=has_min, half_exact=False)
    scales, mins = pack(groups).group_params()
    assert scales.dtype == mins.dtype == np.float32
    assert np.array_equal(scales, to_half(groups.scale))
    assert np.array_equal(mins, to_half(groups.min))  # -0.0 mins read back as +0.0: equal values


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_dequantize_equals_quant_groups_when_params_are_half_exact(kind):
    bits, has_min = kind
    groups = random_groups(130, 96, bits, 32, has_min=has_min)
    assert np.array_equal(pack(groups).dequantize(), groups.dequantize())


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_dequantize_differs_from_quant_groups_only_by_float16_params(kind):
    bits, has_min = kind
    groups = random_groups(65, 96, bits, 32, has_min=has_min, half_exact=False)
    rounded = QuantGroups(groups.q, to_half(groups.scale), to_half(groups.min), groups.group, bits)
    assert np.array_equal(pack(groups).dequantize(), rounded.dequantize())
    assert not np.array_equal(rounded.dequantize(), groups.dequantize())  # the rounding is real


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_row_slice_equals_dequantized_rows(kind):
    bits, has_min = kind
    groups = random_groups(130, 96, bits, 16, has_min=has_min, seed=bits)
    packed = pack(groups)
    rng = np.random.default_rng(1)
    ids = np.concatenate([[129, 0, 63, 64, 64, 129, 7], rng.integers(0, 130, 20)])  # repeats, tile edges
    sliced = packed.row_slice(ids)
    assert sliced.shape == (len(ids), 96) and sliced.dtype == np.float32
    assert np.array_equal(sliced, packed.dequantize()[ids])


def test_int8_with_all_zero_mins_packs_without_mins():
    for zero in (0.0, -0.0):  # quant_groups writes -0.0 for formats without an offset
        groups = random_groups(65, 64, 8, 32, has_min=False)
        groups.min[:] = zero
        assert pack(groups).mins is None


def test_int8_with_one_nonzero_min_packs_mins():
    groups = random_groups(65, 64, 8, 32, has_min=False)
    groups.min[64, 1] = 0.5
    packed = pack(groups)
    assert packed.mins is not None and packed.group_params()[1][64, 1] == 0.5


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_lut_always_has_mins(bits):
    groups = random_groups(65, 64, bits, 32, has_min=False)
    assert pack(groups).mins is not None


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_stacked_rows_multiply_like_the_parts_concatenated(kind):
    bits, has_min = kind
    parts = [random_groups(rows, 96, bits, 32, has_min=has_min, seed=rows) for rows in (65, 1, 63)]
    x = np.random.default_rng(2).standard_normal((5, 96)).astype(np.float32)
    stacked = matmul(pack(stack_rows(parts)), x)
    # Each output is computed from its own row alone, in the same order: bit-identical.
    assert np.array_equal(stacked, np.concatenate([matmul(pack(p), x) for p in parts], axis=1))


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_lut_group_not_a_multiple_of_eight_is_refused(bits):
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(random_groups(3, 48, bits, 12))


def test_int8_group_not_a_multiple_of_four_is_refused():
    with pytest.raises(ValueError, match="multiple of 4, not 6"):
        pack(random_groups(3, 48, 8, 6))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("param", ["scale", "min"])
@pytest.mark.parametrize("bits", (4, 8))
def test_param_outside_float16_is_refused(bits, param):
    groups = random_groups(3, 64, bits, 32)
    getattr(groups, param)[1, 1] = 1e5  # float16 tops out at 65504
    with pytest.raises(ValueError, match=f"a {param} of .* is outside the float16 range"):
        pack(groups)


@pytest.mark.parametrize("param", ["scale", "min"])
def test_param_that_would_round_to_zero_in_float16_is_refused(param):
    groups = random_groups(3, 64, 4, 32)
    getattr(groups, param)[1, 1] = 2.0 ** -26  # half float16's smallest subnormal: rounds to 0
    with pytest.raises(ValueError, match=f"a {param} of .* is outside the float16 range .*round to zero"):
        pack(groups)


# GGUF types whose scales and offsets are float16 values already (or powers of two within its range).
EXACT_WHEN_PACKED = {T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.IQ4_NL, T.MXFP4, T.TQ1_0, T.TQ2_0,
                     TierflowType.TQ2_1, TierflowType.TQ3_1}


@pytest.mark.parametrize("ggml_type", sorted(GROUPED_TYPES, key=type_name), ids=type_name)
def test_packed_weight_type_is_its_weights_up_to_float16_scales(ggml_type):
    shape = (512, 65)  # GGUF order: two tiles of rows, K-quant and ternary blocks of 256
    raw = random_tensor(ggml_type, shape, seed=7)
    groups = to_quant_groups(raw, ggml_type, shape)
    actual, expected = pack(groups).dequantize(), dequantize(raw, ggml_type, shape)
    if ggml_type in EXACT_WHEN_PACKED:
        assert np.array_equal(actual, expected)
    else:  # each of scale and min rounded to float16: within 2^-11 of itself
        q = groups.codes().astype(np.float32).reshape(65, -1, groups.group)
        terms = np.abs(q * groups.scale[..., None]) + np.abs(groups.min[..., None])
        assert np.all(np.abs(actual - expected) <= 2.0 ** -11 * terms.reshape(65, 512))


# Bytes per 256 weights that the packed layout holds beyond the GGUF's: none but for these two.
LARGER_THAN_FILE = {T.TQ1_0: 66 / 54, T.MXFP4: 144 / 136}
FILE_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.TQ1_0,
              T.TQ2_0, T.IQ4_NL, T.IQ4_XS, T.MXFP4]


@pytest.mark.parametrize("ggml_type", FILE_TYPES, ids=lambda t: t.name)
def test_packed_matrix_holds_the_files_bytes(ggml_type):
    shape = (512, 128)  # GGUF order: 512 columns, 128 rows (two whole tiles)
    raw = random_tensor_bytes(np.random.default_rng(4), ggml_type, shape[::-1], std=0.02).reshape(-1)
    packed = pack(to_quant_groups(raw, ggml_type, shape))
    assert packed.nbytes == pytest.approx(raw.nbytes * LARGER_THAN_FILE.get(ggml_type, 1.0))


@pytest.mark.parametrize("ggml_type", FILE_TYPES, ids=lambda t: t.name)
def test_packed_matrix_computes_the_files_weights(ggml_type):
    shape = (512, 70)
    raw = random_tensor(ggml_type, shape, seed=6)
    packed = pack(to_quant_groups(raw, ggml_type, shape))
    expected = np.abs(dequantize(raw, ggml_type, shape).reshape(70, 512))  # the sign of zeros aside
    assert np.array_equal(np.abs(packed.dequantize()), expected)
    ids = np.array([69, 0, 63, 64, 64, 7])
    assert np.array_equal(np.abs(packed.row_slice(ids)), expected[ids])


def same_arrays(a: PackedMatrix, b: PackedMatrix) -> bool:
    """Whether two packed matrices hold the same bytes in every array, and the same form."""
    def bits(array: np.ndarray | None):
        return None if array is None else array.view(np.uint8).tobytes()

    arrays = lambda m: [m.data, m.high, m.scales, m.mins, m.sub and m.sub.codes, m.sub and m.sub.supers]  # noqa: E731
    form = lambda m: (m.rows, m.cols, m.bits, m.group, m.codebook, m.width, m.zero,  # noqa: E731
                      m.sub and (m.sub.bits, m.sub.offset, m.sub.groups_per_super, m.sub.with_mins))
    return form(a) == form(b) and [bits(x) for x in arrays(a)] == [bits(x) for x in arrays(b)]


def block_tensor(ggml_type: int, shape: tuple[int, int], seed: int) -> np.ndarray:
    """random_tensor's bytes, with an MXFP4 tensor's scales in its codebook form's range (at most 2^15:
    quant_groups folds a larger one into int8 codes)."""
    raw = random_tensor(ggml_type, shape, seed)
    if ggml_type != T.MXFP4:
        return raw
    blocks = raw.reshape(-1, QUANT_SIZES[T.MXFP4][1]).copy()
    blocks[:, 0] = np.minimum(blocks[:, 0], 128 + 15)
    return blocks.reshape(-1)


@pytest.mark.parametrize("ggml_type", sorted(BLOCK_PACKED_TYPES), ids=lambda t: T(t).name)
def test_blocks_packed_in_c_are_the_bytes_their_quant_groups_pack_to(ggml_type):
    # Two stacked tensors whose rows end mid-tile, as a fused projection's parts do.
    parts = [(block_tensor(ggml_type, (768, rows), seed=rows), (768, rows)) for rows in (70, 33)]
    expected = pack(stack_rows([to_quant_groups(raw, ggml_type, shape) for raw, shape in parts]))
    assert same_arrays(pack_blocks(parts, ggml_type), expected)


@pytest.mark.parametrize("ggml_type", sorted(BLOCK_PACKED_TYPES), ids=lambda t: T(t).name)
def test_blocks_transcoded_a_tile_range_at_a_time_into_dirty_arrays_pack_the_same(ggml_type):
    parts = [(block_tensor(ggml_type, (256, rows), seed=rows), (256, rows)) for rows in (100, 90)]
    shapes = block_array_shapes(ggml_type, 190, 256)
    arrays = {name: np.full(shape, 0x5A, np.uint8).view(dtype) if dtype != np.float16
              else np.full(shape, 7, dtype) for name, (shape, dtype) in shapes.items()}
    for first, end in [(128, 190), (0, 64), (64, 128)]:  # the last range first: it zeroes the padding
        transcode_blocks(parts, ggml_type, arrays, first, end)
    expected = pack_blocks(parts, ggml_type)
    assert all(np.array_equal(arrays[name].view(np.uint8), getattr(expected, name).view(np.uint8))
               for name in ("data", "high", "scales", "mins") if name in arrays)
    if expected.sub is not None:
        assert np.array_equal(arrays["sub_codes"], expected.sub.codes)
        assert np.array_equal(arrays["supers"].view(np.uint8), expected.sub.supers.view(np.uint8))


def test_a_transcoded_range_of_rows_starts_a_tile():
    parts = [(random_tensor(T.Q8_0, (64, 100), seed=1), (64, 100))]
    shapes = block_array_shapes(T.Q8_0, 100, 64)
    arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}
    with pytest.raises(ValueError, match="starts a tile"):
        transcode_blocks(parts, T.Q8_0, arrays, 32, 100)


# (type, byte offset in a block of a float16 scale: d, or the min m or dmin at 2 in Q4_1, Q5_1, Q4_K, Q5_K)
SCALE_OFFSETS = [(T.Q4_0, 0), (T.Q4_1, 0), (T.Q4_1, 2), (T.Q5_0, 0), (T.Q5_1, 2), (T.Q8_0, 0), (T.Q4_K, 0),
                 (T.Q4_K, 2), (T.Q5_K, 2), (T.Q6_K, 208), (T.IQ4_NL, 0),
                 (T.IQ4_XS, 0)]


@pytest.mark.parametrize("ggml_type, offset", SCALE_OFFSETS, ids=str)
def test_a_block_packed_part_whose_block_scale_is_not_a_number_is_named(ggml_type, offset):
    parts = [(random_tensor(ggml_type, (256, 3), seed=seed).copy(), (256, 3)) for seed in (1, 2)]
    last_block = parts[1][0][-QUANT_SIZES[ggml_type][1]:]
    last_block[offset:offset + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    with pytest.raises(UnpackableBlocks) as refused:
        pack_blocks(parts, ggml_type)
    assert refused.value.part == 1


@pytest.mark.parametrize("exponent", [144, 103, 255], ids=["2^16", "2^-25", "2^127"])
def test_an_mxfp4_part_with_a_scale_float16_does_not_hold_is_named(exponent):
    parts = [(block_tensor(T.MXFP4, (256, 3), seed=seed), (256, 3)) for seed in (1, 2)]
    last_block = parts[1][0][-QUANT_SIZES[T.MXFP4][1]:]
    last_block[0], last_block[1] = exponent, 0x11  # weights of magnitude 1 and 16: not a block of zeros
    with pytest.raises(UnpackableBlocks) as refused:
        pack_blocks(parts, T.MXFP4)
    assert refused.value.part == 1


@pytest.mark.parametrize("zeros", [0x00, 0x88], ids=["+0", "-0"])
def test_an_mxfp4_block_of_zeros_packs_whatever_its_scale(zeros):
    raw = block_tensor(T.MXFP4, (256, 3), seed=3)
    raw[:QUANT_SIZES[T.MXFP4][1]] = [255] + [zeros] * 16
    expected = pack(to_quant_groups(raw, T.MXFP4, (256, 3)))
    assert same_arrays(pack_blocks([(raw, (256, 3))], T.MXFP4), expected)


def gguf_matrix(ggml_type: int, rows: int, cols: int, seed: int = 0) -> PackedMatrix:
    """Real blocks of the type (random weights that gguf-py quantizes), packed as the kernels read them."""
    raw = random_tensor_bytes(np.random.default_rng(seed), ggml_type, (rows, cols), 0.02).reshape(-1)
    return pack(to_quant_groups(raw, ggml_type, (cols, rows)))


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q4_1, T.Q3_K, T.IQ4_XS], ids=lambda t: t.name)
def test_a_token_gets_the_same_bits_alone_as_among_many(ggml_type):
    # Among many tokens a tile's scales are decoded once for all of them: the same floats as one by one.
    packed = gguf_matrix(ggml_type, 70, 512, seed=7)
    x = np.random.default_rng(8).standard_normal((40, 512)).astype(np.float32)
    together = matmul(packed, x)
    alone = np.concatenate([matmul(packed, x[i:i + 1]) for i in range(len(x))])
    assert np.array_equal(together.view(np.uint32), alone.view(np.uint32))


def test_codes_that_do_not_fit_their_width_are_refused():
    q = np.zeros((3, 64), np.int8)
    q[2, 5] = 8  # with zero 8: 16, past 4 bits
    scale = np.ones((3, 2), np.float32)
    with pytest.raises(ValueError, match="do not fit 4 unsigned bits"):
        pack(QuantGroups(q, scale, np.full_like(scale, -0.0), 32, 8, width=4, zero=8))


@pytest.mark.parametrize("width, group, cols, problem", [
    (2, 8, 64, "2-bit codes need a group that is a multiple of 16 and a multiple of 16 columns"),
    (3, 16, 48, "3-bit codes need a group that is a multiple of 16 and a multiple of 32 columns"),
], ids=["two-bit-group", "three-bit-columns"])
def test_two_bit_fields_refuse_a_group_or_width_their_blocks_do_not_hold(width, group, cols, problem):
    q = np.zeros((3, cols), np.int8)
    scale = np.ones((3, cols // group), np.float32)
    with pytest.raises(ValueError, match=problem):
        pack(QuantGroups(q, scale, np.full_like(scale, -0.0), group, 8, width=width, zero=2))


@pytest.mark.parametrize("ggml_type, nbytes, problem", [
    (T.Q3_K, 144, "is not Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS or MXFP4"),
    (T.Q4_K, 143, "whole rows of the type's blocks"),
], ids=["other type", "partial block"])
def test_transcode_refuses_what_it_cannot_lay_out_naming_it(ggml_type, nbytes, problem):
    data, codes = np.zeros((1, 32, TILE_ROWS, 4), np.uint8), np.zeros((1, 1, 12, TILE_ROWS), np.uint8)
    supers = np.zeros((1, 1, 2, TILE_ROWS), np.float16)
    with pytest.raises(ValueError, match=problem):
        _kernels.transcode(ggml_type, np.zeros(nbytes, np.uint8), 256, 0, data, None, codes, supers, None,
                           None)


def test_transcode_refuses_an_array_the_types_form_lacks():
    data, scales = np.zeros((1, 32, TILE_ROWS, 4), np.uint8), np.zeros((1, 8, TILE_ROWS), np.float16)
    with pytest.raises(ValueError, match="high must be None"):
        _kernels.transcode(T.Q4_0, np.zeros(8 * 18, np.uint8), 256, 0, data, data, None, None, scales, None)


def test_transcode_refuses_a_q4_1_tensor_without_its_mins():
    data, scales = np.zeros((1, 32, TILE_ROWS, 4), np.uint8), np.zeros((1, 8, TILE_ROWS), np.float16)
    with pytest.raises(ValueError, match="mins must be given"):
        _kernels.transcode(T.Q4_1, np.zeros(8 * 20, np.uint8), 256, 0, data, None, None, None, scales, None)


def test_transcode_refuses_arrays_too_small_for_the_rows_it_writes():
    data, codes = np.zeros((1, 32, TILE_ROWS, 4), np.uint8), np.zeros((1, 1, 12, TILE_ROWS), np.uint8)
    supers = np.zeros((1, 1, 2, TILE_ROWS), np.float16)
    with pytest.raises(ValueError, match="too small for rows row0"):  # row 64 is a second tile
        _kernels.transcode(T.Q4_K, np.zeros(144, np.uint8), 256, 64, data, None, codes, supers, None, None)
