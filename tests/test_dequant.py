"""The numpy dequantizers against gguf-py's reference, bit for bit."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as reference_dequantize

from tierflow.cpu_kernels.dequant import SUPPORTED_TYPES, dequantize
from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.ggml_types import QUANT_SIZES, TierflowType, type_name
from tierflow.offload.store.model_path import bundled_model_path

T = GGMLQuantizationType
# ggml's types, which gguf-py can decode; tierflow's own are tested in test_quantize.py.
ALL_TYPES = sorted(SUPPORTED_TYPES - set(TierflowType), key=lambda t: T(t).name)

# Byte offsets of the float16 scale fields inside one block; random bits there could be inf/NaN.
HALF_FIELD_OFFSETS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], TierflowType.TQ2_1: [0, 2], TierflowType.TQ3_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.IQ4_NL: [0], T.IQ4_XS: [0], T.TQ1_0: [52], T.TQ2_0: [64],
}
# MXFP4's scale is the byte 2^(e - 128): random ones from 2^-24 to 2^18, the range whose float16
# form is exact (2^16 .. 2^18 by folding into the codes, see quant_groups.py).
MXFP4_EXPONENTS = (104, 147)
SHAPES = [(256,), (512, 3), (256, 2, 3)]  # GGUF order: ne0 first


def random_tensor(ggml_type: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random read-only bytes for a tensor: quant bits fully random, f16 scales finite."""
    rng = np.random.default_rng(seed)
    block_size, block_bytes = QUANT_SIZES[ggml_type]
    num_blocks = int(np.prod(shape)) // block_size
    raw = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
    for offset in HALF_FIELD_OFFSETS.get(ggml_type, []):
        scales = rng.standard_normal(num_blocks).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    if ggml_type == T.MXFP4:
        raw[:, 0] = rng.integers(*MXFP4_EXPONENTS, num_blocks)
    raw = raw.reshape(-1)
    raw.flags.writeable = False
    return raw


def reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    weights = reference_dequantize(raw.copy(), T(ggml_type))
    return np.asarray(weights, np.float32).reshape(tuple(reversed(shape)))


def assert_bit_exact(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same shape and the same float32 bit patterns (so NaNs must match in place too)."""
    assert actual.shape == expected.shape
    assert np.array_equal(actual.view(np.uint32), expected.view(np.uint32))


def test_supported_types_are_the_documented_ones():
    names = {type_name(t) for t in SUPPORTED_TYPES}
    assert names == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                     "Q6_K", "TQ2_1", "TQ3_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "TQ1_0", "TQ2_0"}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: T(t).name)
def test_matches_gguf_reference_bit_exactly(ggml_type, shape):
    raw = random_tensor(ggml_type, shape)
    assert_bit_exact(dequantize(raw, ggml_type, shape), reference(raw, ggml_type, shape))


def test_many_blocks_span_several_chunks():
    # 1M weights is many decode chunks: chunk boundaries must not shift or drop blocks.
    shape = (4096, 256)
    raw = random_tensor(T.Q4_K, shape, seed=1)
    assert_bit_exact(dequantize(raw, T.Q4_K, shape), reference(raw, T.Q4_K, shape))


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: T(t).name)
def test_output_is_reversed_shape_float32_contiguous_and_writable(ggml_type):
    shape = (256, 2, 3)
    weights = dequantize(random_tensor(ggml_type, shape), ggml_type, shape)
    assert weights.shape == (3, 2, 256)
    assert weights.dtype == np.float32
    assert weights.flags.c_contiguous
    assert weights.flags.writeable


def test_accepts_numpy_integer_shape_and_type():
    raw = random_tensor(T.Q8_0, (64, 2))
    shape = tuple(np.array([64, 2], dtype=np.uint32))
    weights = dequantize(raw, np.int64(T.Q8_0), shape)
    assert weights.shape == (2, 64)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: T(t).name)
def test_input_bytes_are_not_modified(ggml_type):
    raw = random_tensor(ggml_type, (512, 3))
    before = raw.copy()
    dequantize(raw, ggml_type, (512, 3))
    assert np.array_equal(raw, before)


def test_read_only_memmap_input(tmp_path):
    raw = random_tensor(T.Q5_0, (64, 4))
    path = tmp_path / "tensor.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    weights = dequantize(mapped, T.Q5_0, (64, 4))
    assert type(weights) is np.ndarray
    assert_bit_exact(weights, reference(raw, T.Q5_0, (64, 4)))


def test_mxfp4_every_exponent_matches_gguf_reference_bit_exactly():
    # e from 0 (2^-128, a float32 subnormal) to 255 (2^127: 12 x 2^127 is inf in ggml too).
    raw = random_tensor(T.MXFP4, (32, 256)).copy().reshape(256, 17)
    raw[:, 0] = np.arange(256)
    raw = raw.reshape(-1)
    with np.errstate(over="ignore"):
        assert_bit_exact(dequantize(raw, T.MXFP4, (32, 256)), reference(raw, T.MXFP4, (32, 256)))


@pytest.mark.parametrize("ggml_type", [T.IQ2_XXS, T.IQ3_S, T.IQ1_M, T.I8])
def test_unsupported_type_is_named(ggml_type):
    with pytest.raises(UnsupportedModelError, match=rf"tensor type {ggml_type.name} .*Q4_K"):
        dequantize(np.zeros(1024, np.uint8), ggml_type, (256,))


def test_unknown_type_number_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="tensor type 999 "):
        dequantize(np.zeros(4, np.uint8), 999, (1,))


@pytest.mark.parametrize("num_bytes", [143, 145, 0, 288])
def test_wrong_byte_count_is_a_model_file_error(num_bytes):
    with pytest.raises(ModelFileError, match="needs 144 bytes"):
        dequantize(np.zeros(num_bytes, np.uint8), T.Q4_K, (256,))


def test_row_not_whole_blocks_is_a_model_file_error():
    with pytest.raises(ModelFileError, match="not a multiple"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, (16, 2))


@pytest.fixture(scope="module")
def smollm2_tensors():
    try:
        path = bundled_model_path()
    except ModelFileError:
        pytest.skip("bundled SmolLM2 model is not installed")
    return GGUFReader(path).tensors


@pytest.mark.slow
def test_real_model_types_are_all_supported(smollm2_tensors):
    assert {int(tensor.tensor_type) for tensor in smollm2_tensors} <= SUPPORTED_TYPES


def test_real_model_tensors_match_reference(smollm2_tensors):
    # The first tensor of each type in the file, and the token embedding, bit for bit.
    first_of_type = {}
    for tensor in smollm2_tensors:
        first_of_type.setdefault(int(tensor.tensor_type), tensor)
    embedding = [tensor for tensor in smollm2_tensors if tensor.name == "token_embd.weight"]
    for tensor in [*first_of_type.values(), *embedding]:
        shape = tuple(int(dim) for dim in tensor.shape)
        raw = tensor.data.reshape(-1).view(np.uint8)
        expected = reference(raw, tensor.tensor_type, shape)
        assert_bit_exact(dequantize(raw, tensor.tensor_type, shape), expected)
