"""The encoders to Q4_1, TQ3_1 and TQ2_1 (cpu_kernels/quantize.py) and the TQ decoders."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from tierflow.cpu_kernels import quantize as quantize_module
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.cpu_kernels.quantize import TYPE_FOR_BITS, quantize
from tierflow.errors import InvalidArgumentError
from tierflow.ggml_types import QUANT_SIZES, TierflowType, type_name
from tierflow.offload.gguf.reader import read_gguf

Q4_1 = GGMLQuantizationType.Q4_1
BITS = [4, 3, 2]
METHODS = ["search", "rtn"]


def random_weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Gaussian weights with a per-row scale and offset, and a few outliers, like real layers."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 0.1, (rows, 1))
    weights += rng.normal(0, 0.01, (rows, 1))
    outliers = rng.random((rows, cols)) < 0.01
    weights[outliers] *= 8
    return weights.astype(np.float32)


def round_trip(weights: np.ndarray, bits: int, method: str = "search") -> np.ndarray:
    ggml_type = TYPE_FOR_BITS[bits]
    return dequantize(quantize(weights, ggml_type, method), ggml_type, weights.shape[::-1])


def scales_and_offsets(raw: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block's d and m [blocks, 1] float32: the first four bytes of every format here."""
    blocks = raw.reshape(-1, QUANT_SIZES[TYPE_FOR_BITS[bits]][1])
    halves = np.ascontiguousarray(blocks[:, :4]).view(np.float16).astype(np.float32)
    return halves[:, :1], halves[:, 1:2]


@pytest.fixture(scope="module")
def real_weights(model_path) -> dict[str, np.ndarray]:
    """Rows of the bundled model's embedding (Q8_0, so nearly continuous) and one layer weight
    (Q4_1: on a 16-level grid per block already, so 4-bit rtn rebuilds it exactly)."""
    with read_gguf(model_path) as model:
        weights = {}
        for name, rows in [("token_embd.weight", 2048), ("blk.7.ffn_up.weight", 1536)]:
            info = model.tensors[name]
            weights[name] = dequantize(model.tensor_data(name), info.ggml_type, info.shape)[:rows]
    return weights


# -- formats ----------------------------------------------------------------------------------


def test_type_names_and_block_sizes():
    assert type_name(TierflowType.TQ2_1) == "TQ2_1" and type_name(1003) == "TQ3_1"
    assert type_name(Q4_1) == "Q4_1" and type_name(999) == "999"
    assert QUANT_SIZES[1002] == (32, 12) and QUANT_SIZES[1003] == (32, 16)


def spec_decode_block(block: bytes, bits: int) -> list[float]:
    """One TQ block decoded weight by weight from the format table in tierflow.ggml_types."""
    d, m = (float(v) for v in np.frombuffer(block[:4], np.float16))
    qh, qs = (block[4:8], block[8:16]) if bits == 3 else (b"", block[4:12])
    weights = []
    for j in range(32):
        q = (qs[j // 4] >> (2 * (j % 4))) & 3
        if bits == 3:
            q += 4 * ((qh[j // 8] >> (j % 8)) & 1)
        weights.append(np.float32(np.float32(d) * np.float32(q)) + np.float32(m))
    return weights


@pytest.mark.parametrize("bits", [3, 2])
def test_tq_decoders_follow_the_documented_layout(bits):
    rng = np.random.default_rng(bits)
    block_bytes = QUANT_SIZES[TYPE_FOR_BITS[bits]][1]
    raw = rng.integers(0, 256, (6, block_bytes), dtype=np.uint8)
    raw[:, :4] = rng.standard_normal((6, 2)).astype(np.float16).view(np.uint8)
    decoded = dequantize(raw.reshape(-1), TYPE_FOR_BITS[bits], (64, 3))
    expected = [w for block in raw for w in spec_decode_block(block.tobytes(), bits)]
    assert np.array_equal(decoded.reshape(-1), np.array(expected, np.float32))


def test_half_rounding_matches_numpy_float16():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(200_000).astype(np.float32) * scale
                             for scale in (1e-8, 1e-6, 3e-5, 6e-5, 1e-3, 1.0, 1e3, 3e4)])
    ties = np.float32([1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-25, 2.0**-14, 65504])
    values = np.concatenate([values, ties, -ties, np.float32([0.0, -0.0])])
    values = values[np.abs(values) < 65520]  # the documented range; float16 overflows beyond
    expected = values.astype(np.float16).astype(np.float32)
    assert np.array_equal(quantize_module._half(values).view(np.uint32), expected.view(np.uint32))


# -- encoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (300, 576)], ids=str)
def test_rtn_q4_1_is_bit_exact_with_gguf_py(shape):
    weights = random_weights(*shape)
    expected = reference_quantize(weights, Q4_1).reshape(-1)
    assert np.array_equal(quantize(weights, Q4_1, "rtn"), expected)


@pytest.mark.parametrize("method", METHODS)
def test_q4_1_output_decodes_the_same_in_gguf_py(method):
    weights = random_weights(64, 576)
    raw = quantize(weights, Q4_1, method)
    ours = dequantize(raw, Q4_1, (576, 64))
    theirs = reference_dequantize(raw.copy(), Q4_1).astype(np.float32).reshape(64, 576)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_is_within_half_a_step(bits, method):
    """Each weight decodes to within half a step d / 2 of itself (plus the float16 rounding of d
    and m), except weights the search chose to clip, which decode to the end level."""
    weights = random_weights(200, 576)
    ggml_type = TYPE_FOR_BITS[bits]
    raw = quantize(weights, ggml_type, method)
    assert raw.dtype == np.uint8 and raw.nbytes == 200 * 576 // 32 * QUANT_SIZES[ggml_type][1]
    decoded = dequantize(raw, ggml_type, (576, 200)).reshape(-1, 32)
    groups = weights.reshape(-1, 32)
    d, m = scales_and_offsets(raw, bits)
    assert (d > 0).all()
    top = m + (2**bits - 1) * d
    slack = (2**bits - 1) * d * 2.0**-11 + np.abs(m) * 2.0**-11 + 1e-7
    inside = (groups > m - d / 2) & (groups < top + d / 2)
    assert (np.abs(decoded - groups) <= d / 2 + slack)[inside].all()
    if method == "rtn":
        assert inside.all()
    below, above = groups <= m - d / 2, groups >= top + d / 2  # clipped by the search
    assert np.allclose(decoded[below], np.broadcast_to(m, groups.shape)[below])
    assert np.allclose(decoded[above], np.broadcast_to(top, groups.shape)[above])


@pytest.mark.parametrize("bits", BITS)
def test_search_picks_the_nearest_level_for_every_weight(bits):
    weights = random_weights(100, 256, seed=1)
    raw = quantize(weights, TYPE_FOR_BITS[bits])
    d, m = scales_and_offsets(raw, bits)
    levels = d[:, None, :] * np.arange(2**bits, dtype=np.float32)[None, :, None] + m[:, None, :]
    groups = weights.reshape(-1, 32)
    best = np.abs(levels - groups[:, None, :]).min(axis=1)  # [blocks, 32]
    decoded = dequantize(raw, TYPE_FOR_BITS[bits], (256, 100)).reshape(-1, 32)
    assert np.allclose(np.abs(decoded - groups), best, rtol=0, atol=1e-6 * np.abs(groups).max())


def mean_squared_error(weights: np.ndarray, bits: int, method: str) -> float:
    return float(np.mean((round_trip(weights, bits, method) - weights) ** 2))


@pytest.mark.parametrize("bits", BITS)
def test_search_beats_rtn_on_random_weights(bits):
    weights = random_weights(256, 576, seed=2)
    search, rtn = (mean_squared_error(weights, bits, method) for method in METHODS)
    print(f"{bits} bits, random: search/rtn squared error {search / rtn:.3f}")
    assert search < 0.9 * rtn


@pytest.mark.parametrize("bits", BITS)
def test_search_beats_rtn_on_real_embedding_weights(real_weights, bits):
    weights = real_weights["token_embd.weight"]
    search, rtn = (mean_squared_error(weights, bits, method) for method in METHODS)
    print(f"{bits} bits, token_embd: search/rtn squared error {search / rtn:.3f}")
    assert search < 0.9 * rtn


@pytest.mark.parametrize("bits", [3, 2])
def test_search_beats_rtn_on_real_layer_weights(real_weights, bits):
    weights = real_weights["blk.7.ffn_up.weight"]
    search, rtn = (mean_squared_error(weights, bits, method) for method in METHODS)
    print(f"{bits} bits, blk.7.ffn_up: search/rtn squared error {search / rtn:.3f}")
    assert search < 0.9 * rtn


@pytest.mark.parametrize("method", METHODS)
def test_4_bit_layer_weights_of_a_q4_1_model_are_rebuilt_exactly(real_weights, method):
    # Already Q4_1 (made by ggml's rtn): both methods find the same blocks again.
    weights = real_weights["blk.7.ffn_up.weight"]
    assert np.array_equal(round_trip(weights, 4, method), weights)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bits", BITS)
def test_constant_and_tiny_groups(bits, method):
    weights = np.zeros((4, 64), np.float32)
    weights[1] = 0.375  # float16-exact constants come back exactly
    weights[2] = -3.0
    weights[3] = np.linspace(-3e-6, 2e-6, 64)  # float16 subnormal scales
    decoded = round_trip(weights, bits, method)
    assert np.array_equal(decoded[:3], weights[:3])
    assert np.abs(decoded[3] - weights[3]).max() <= 5e-6 / (2**bits - 1)


@pytest.mark.parametrize("method", METHODS)
def test_no_rows_is_no_bytes(method):
    assert quantize(np.zeros((0, 64), np.float32), TYPE_FOR_BITS[2], method).size == 0


@pytest.mark.parametrize(
    "weights, ggml_type, method, message",
    [
        (np.zeros((2, 48), np.float32), Q4_1, "search", "multiple of 32"),
        (np.zeros(64, np.float32), Q4_1, "search", "2-D"),
        (np.full((1, 32), np.nan, np.float32), Q4_1, "search", "non-finite"),
        (np.full((1, 32), np.inf, np.float32), Q4_1, "rtn", "non-finite"),
        (np.full((1, 32), 7e4, np.float32), Q4_1, "search", "beyond float16"),
        (np.zeros((1, 32), np.float32), GGMLQuantizationType.Q4_K, "search", "cannot encode Q4_K"),
        (np.zeros((1, 32), np.float32), Q4_1, "gptq", "method"),
    ],
    ids=["row-length", "1-D", "nan", "inf", "too-large", "type", "method"],
)
def test_bad_input_is_an_invalid_argument(weights, ggml_type, method, message):
    with pytest.raises(InvalidArgumentError, match=message):
        quantize(weights, ggml_type, method)
