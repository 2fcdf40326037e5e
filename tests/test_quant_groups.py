"""Quant groups (codes, scale, min) against the float32 dequantizer, bit for bit."""

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tests.test_dequant import assert_bit_exact, random_tensor
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.cpu_kernels.quant_groups import GROUPED_TYPES, QuantGroups, to_quant_groups
from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.ggml_types import TierflowType, type_name

T = GGMLQuantizationType
ALL_TYPES = sorted(GROUPED_TYPES, key=type_name)
GROUP_AND_BITS = {
    T.Q4_0: (32, 8), T.Q4_1: (32, 8), T.Q8_0: (32, 8), T.Q5_0: (32, 8), T.Q5_1: (32, 8),
    T.Q4_K: (32, 8), T.Q5_K: (32, 8), T.Q6_K: (16, 8),
    TierflowType.TQ2_1: (32, 2), TierflowType.TQ3_1: (32, 3),
    T.Q2_K: (16, 8), T.Q3_K: (16, 8), T.TQ1_0: (256, 2), T.TQ2_0: (256, 2),
    T.IQ4_NL: (32, 8), T.IQ4_XS: (32, 8), T.MXFP4: (32, 8),
}
# Range of the int8 codes for the 8-bit mappings: [low, high). MXFP4's +-12 reach +-96 where a
# scale above 2^15 folds three doublings into them.
INT8_RANGES = {T.Q8_0: (-128, 128), T.Q5_0: (-16, 16), T.Q5_1: (0, 32), T.Q5_K: (0, 32),
               T.Q6_K: (-32, 32), T.Q2_K: (0, 4), T.Q3_K: (-4, 4), T.IQ4_NL: (-127, 114),
               T.IQ4_XS: (-127, 114), T.MXFP4: (-96, 97)}
# Types whose offset turns ggml's -0.0 weights into +0.0 (see quant_groups' docstring).
ZERO_SIGN_TYPES = {T.Q4_0, T.TQ1_0, T.TQ2_0}
SHAPES = [(256, 1), (512, 3), (256, 7)]  # GGUF order: K columns, N rows
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1}  # those gguf-py can quantize
type_id = type_name


def quantized_tensor(ggml_type: int, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Real quantized bytes where gguf-py can make them, else random bytes with finite scales."""
    if ggml_type not in QUANTIZABLE:
        return random_tensor(ggml_type, shape, seed)
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(tuple(reversed(shape))).astype(np.float32)
    weights[0, :32] = 0.0  # an all-zero group: zero scale
    return quantize(weights, T(ggml_type)).reshape(-1)


def assert_reconstructs(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> QuantGroups:
    """Bit for bit, but zeros may lose their minus sign in ZERO_SIGN_TYPES."""
    groups = to_quant_groups(raw, ggml_type, shape)
    actual, expected = groups.dequantize(), dequantize(raw, ggml_type, shape)
    if ggml_type in ZERO_SIGN_TYPES:
        assert np.array_equal(actual, expected)
        actual, expected = actual + 0.0, expected + 0.0  # -0.0 + 0.0 is +0.0, all else unchanged
    assert_bit_exact(actual, expected)
    return groups


def test_grouped_types_are_the_quantized_ones():
    assert {type_name(t) for t in GROUPED_TYPES} == {
        "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "TQ2_1", "TQ3_1",
        "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "TQ1_0", "TQ2_0",
    }


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=type_id)
def test_random_bytes_reconstruct_bit_exactly(ggml_type, shape):
    assert_reconstructs(random_tensor(ggml_type, shape, seed=3), ggml_type, shape)


@pytest.mark.parametrize("ggml_type", sorted(QUANTIZABLE), ids=type_id)
def test_gguf_quantized_weights_reconstruct_bit_exactly(ggml_type):
    shape = (512, 5)
    assert_reconstructs(quantized_tensor(ggml_type, shape), ggml_type, shape)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q5_0, T.Q6_K, T.Q3_K, T.Q4_0], ids=type_id)
def test_negative_zero_weights_keep_their_sign_without_offset(ggml_type):
    # Negative scales times zero codes give -0.0 in ggml; the offset must not make it +0.0.
    shape = (256, 2)
    raw = random_tensor(ggml_type, shape, seed=5)
    expected = dequantize(raw, ggml_type, shape)
    assert np.signbit(expected[expected == 0]).any()
    assert_reconstructs(raw, ggml_type, shape)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=type_id)
def test_group_and_bits_per_type(ggml_type):
    groups = to_quant_groups(random_tensor(ggml_type, (256, 3)), ggml_type, (256, 3))
    assert (groups.group, groups.bits) == GROUP_AND_BITS[ggml_type]


@pytest.mark.parametrize("ggml_type", [t for t in ALL_TYPES if GROUP_AND_BITS[t][1] <= 4],
                         ids=type_id)
def test_low_bit_codes_are_uint8_below_two_to_the_bits(ggml_type):
    groups = to_quant_groups(random_tensor(ggml_type, (512, 3)), ggml_type, (512, 3))
    assert groups.q.dtype == np.uint8
    assert groups.q.max() < 2 ** groups.bits
    codes = 3 if ggml_type == T.TQ1_0 else 2 ** groups.bits  # a base-3 digit is 0, 1 or 2
    assert len(np.unique(groups.q)) == codes  # random bytes reach every code


@pytest.mark.parametrize("ggml_type", sorted(INT8_RANGES), ids=type_id)
def test_eight_bit_codes_are_int8_in_the_format_range(ggml_type):
    shape = (512, 30)  # enough MXFP4 blocks to meet the largest folded scale
    groups = to_quant_groups(random_tensor(ggml_type, shape), ggml_type, shape)
    low, high = INT8_RANGES[ggml_type]
    codes = groups.codes()
    assert codes.dtype == np.int8
    assert (codes.min(), int(codes.max()) + 1) == (low, high)


@pytest.mark.parametrize("ggml_type, codebook",
                         [(T.IQ4_NL, "iq4nl"), (T.IQ4_XS, "iq4nl"), (T.MXFP4, "mxfp4")], ids=str)
def test_codebook_types_keep_4_bit_indices_and_name_their_codebook(ggml_type, codebook):
    raw = random_tensor(ggml_type, (256, 3)).copy()
    if ggml_type == T.MXFP4:
        raw.reshape(-1, 17)[:, 0] = 128  # scale 1: no folding
    groups = assert_reconstructs(raw, ggml_type, (256, 3))
    assert (groups.codebook, groups.q.dtype) == (codebook, np.uint8)
    assert len(np.unique(groups.q)) == 16


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=type_id)
def test_shapes_are_rows_by_columns_and_rows_by_groups(ggml_type, shape):
    num_columns, num_rows = shape
    groups = to_quant_groups(random_tensor(ggml_type, shape), ggml_type, shape)
    assert groups.q.shape == (num_rows, num_columns)
    assert groups.scale.shape == groups.min.shape == (num_rows, num_columns // groups.group)
    assert groups.scale.dtype == groups.min.dtype == np.float32


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4],
                         ids=type_id)
def test_formats_without_offset_have_zero_min(ggml_type):
    groups = to_quant_groups(random_tensor(ggml_type, (256, 3)), ggml_type, (256, 3))
    assert np.all(groups.min == 0)


WIDTH_AND_ZERO = {T.Q4_0: (4, 8), T.Q4_1: (4, 0), T.Q5_0: (5, 16), T.Q5_1: (5, 0), T.Q4_K: (4, 0),
                  T.Q5_K: (5, 0), T.Q6_K: (6, 32)}


@pytest.mark.parametrize("ggml_type", sorted(WIDTH_AND_ZERO), ids=type_id)
def test_int8_codes_plus_the_zero_code_fit_the_files_width(ggml_type):
    groups = to_quant_groups(random_tensor(ggml_type, (512, 3)), ggml_type, (512, 3))
    assert (groups.width, groups.zero) == WIDTH_AND_ZERO[ggml_type]
    stored = groups.q.astype(np.int16) + groups.zero
    assert stored.min() == 0 and stored.max() == 2**groups.width - 1  # random bytes reach both ends


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS], ids=type_id)
def test_two_level_scales_keep_the_files_codes_and_ggmls_products(ggml_type):
    groups = to_quant_groups(random_tensor(ggml_type, (512, 3)), ggml_type, (512, 3))
    sub = groups.sub
    d = np.repeat(sub.d, sub.groups_per_super, axis=1)
    assert sub.scale_codes.max() < 2**sub.bits
    assert np.array_equal(groups.scale, d * (sub.scale_codes.astype(np.float32) - sub.offset))
    if sub.min_codes is not None:
        dmin = np.repeat(sub.dmin, sub.groups_per_super, axis=1)
        assert np.array_equal(groups.min, -(dmin * sub.min_codes))


def test_q3_k_codes_are_three_bits_less_four_with_no_offset():
    groups = to_quant_groups(random_tensor(T.Q3_K, (256, 3)), T.Q3_K, (256, 3))
    assert (groups.width, groups.zero) == (3, 4)
    assert np.all(groups.min == 0) and np.signbit(groups.min).all()


@pytest.mark.parametrize("ggml_type", [T.TQ1_0, T.TQ2_0], ids=type_id)
def test_ternary_offset_is_minus_the_scale(ggml_type):
    groups = to_quant_groups(random_tensor(ggml_type, (256, 3)), ggml_type, (256, 3))
    assert np.array_equal(groups.min, -groups.scale)


def mxfp4_blocks(exponents: list[int], seed: int = 0) -> np.ndarray:
    """One MXFP4 row of random codes per exponent byte e (scale 2^(e - 128))."""
    raw = random_tensor(T.MXFP4, (32, len(exponents)), seed).copy().reshape(-1, 17)
    raw[:, 0] = exponents
    return raw.reshape(-1)


def test_mxfp4_scales_above_float16_fold_into_the_codes_exactly():
    exponents = [143, 144, 145, 146]  # 2^15 .. 2^18
    raw = mxfp4_blocks(exponents, seed=4)
    groups = assert_reconstructs(raw, T.MXFP4, (32, 4))
    assert groups.codebook is None  # folded codes are no codebook's entries
    assert np.array_equal(groups.scale[:, 0], np.exp2(np.minimum(np.array(exponents) - 128, 15)))
    unfolded = to_quant_groups(mxfp4_blocks([128] * 4, seed=4), T.MXFP4, (32, 4)).codes()
    assert np.array_equal(groups.q[1:], unfolded[1:] << np.array([1, 2, 3], np.int8)[:, None])


def test_mxfp4_scale_of_2_to_the_15_keeps_the_codebook():
    groups = assert_reconstructs(mxfp4_blocks([104, 143]), T.MXFP4, (32, 2))
    assert groups.codebook == "mxfp4"


def test_mxfp4_zero_block_gets_scale_one():
    raw = mxfp4_blocks([0, 255]).reshape(2, 17)
    raw[:, 1:] = 0  # ggml's quantizer writes e = 0 for an all-zero block
    groups = assert_reconstructs(raw.reshape(-1), T.MXFP4, (32, 2))
    assert np.array_equal(groups.scale, np.ones((2, 1), np.float32))


def test_many_blocks_span_several_chunks():
    shape = (4096, 300)  # far more blocks than one decode chunk, and not a multiple of it
    assert_reconstructs(random_tensor(T.Q4_K, shape, seed=1), T.Q4_K, shape)


def test_memmap_input_is_read_only_and_unchanged(tmp_path):
    raw = random_tensor(T.Q5_1, (64, 3))
    path = tmp_path / "tensor.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    groups = assert_reconstructs(mapped, T.Q5_1, (64, 3))
    assert type(groups.q) is np.ndarray
    assert np.array_equal(np.fromfile(path, np.uint8), raw)


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16], ids=type_id)
def test_float_type_is_unsupported_and_named(ggml_type):
    raw = np.zeros(256 * 2 * (4 if ggml_type == T.F32 else 2), np.uint8)
    with pytest.raises(UnsupportedModelError, match=rf"{ggml_type.name} is not group-quantized"):
        to_quant_groups(raw, ggml_type, (256, 2))


@pytest.mark.parametrize("ggml_type", [T.IQ2_XXS, T.IQ1_S, 999], ids=str)
def test_type_without_groups_is_unsupported_and_named(ggml_type):
    name = T(ggml_type).name if ggml_type != 999 else "999"
    with pytest.raises(UnsupportedModelError, match=rf"tensor type {name} .*Q4_K"):
        to_quant_groups(np.zeros(1024, np.uint8), ggml_type, (256, 1))


@pytest.mark.parametrize("shape", [(256,), (256, 2, 3)], ids=str)
def test_tensor_not_2d_is_unsupported(shape):
    raw = random_tensor(T.Q4_0, shape)
    with pytest.raises(UnsupportedModelError, match="not a 2-D matrix"):
        to_quant_groups(raw, T.Q4_0, shape)


def test_wrong_byte_count_is_a_model_file_error():
    with pytest.raises(ModelFileError, match="needs 144 bytes"):
        to_quant_groups(np.zeros(143, np.uint8), T.Q4_K, (256, 1))


def test_inconsistent_groups_are_rejected():
    q = np.zeros((2, 64), np.uint8)
    scale = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="min must be float32"):
        QuantGroups(q, scale, np.zeros((2, 3), np.float32), group=32, bits=4)
    with pytest.raises(ValueError, match="8-bit codes cannot be uint8"):
        QuantGroups(q, scale, scale, group=32, bits=8)


@pytest.mark.slow
def test_4096_square_q4_0_decodes_in_well_under_a_second():
    shape = (4096, 4096)
    raw = random_tensor(T.Q4_0, shape)
    start = time.perf_counter()
    groups = to_quant_groups(raw, T.Q4_0, shape)
    elapsed = time.perf_counter() - start
    print(f"4096x4096 Q4_0 to quant groups: {elapsed * 1e3:.0f} ms")
    assert groups.q.shape == (4096, 4096)
    assert elapsed < 0.5
