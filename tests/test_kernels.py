"""The C kernels against their numpy reference, on every ISA path, and their guard rails."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.test_dequant import random_tensor
from tests.test_packed import KINDS, as_int8_codes, codebook_groups, gguf_matrix, kind_id, random_groups
from tierflow.cpu_kernels import _kernels
from tierflow.cpu_kernels.linear import PackedLinear, linear_each
from tierflow.cpu_kernels.matmul import matmul, matmul_each
from tierflow.cpu_kernels.packed import LUT_MAX_GROUP, PackedMatrix, pack
from tierflow.cpu_kernels.quant_groups import CODEBOOKS, QuantGroups, SubScales, to_quant_groups
from tierflow.cpu_kernels.reference import matmul_exact, matmul_reference
from tierflow.ggml_types import type_name

ISAS = _kernels.supported_isas()
# M tokens, N rows, K columns, group. Together they cover: token blocks of 1..4 and a remainder
# (5, 9), chunks of 32 with a remainder (33, 70); one tile, a partial tile and several (1, 63,
# 64, 65, 200); one group and many; every group size.
SHAPES = [
    (1, 1, 32, 16),
    (2, 63, 96, 32),
    (3, 64, 256, 64),
    (4, 65, 32, 32),
    (5, 200, 96, 16),
    (9, 65, 256, 64),
    (33, 64, 96, 32),
    (70, 63, 256, 16),
]
shape_id = lambda s: "M{}-N{}-K{}-g{}".format(*s)  # noqa: E731
# The GGUF types issue 17 added; the older ones reach the kernels as the KINDS above.
WEIGHT_TYPES = [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.TQ1_0, T.TQ2_0]


def lut_max_group(bits: int) -> int:
    return LUT_MAX_GROUP[bits]


@pytest.fixture(autouse=True)
def restore_kernel_settings():
    isa, threads = _kernels.isa(), _kernels.threads()
    yield
    _kernels.set_isa(isa)
    _kernels.set_threads(threads)


def packed_and_acts(kind, tokens: int, rows: int, cols: int, group: int, seed: int = 0):
    bits, has_min = kind
    w = pack(random_groups(rows, cols, bits, group, has_min=has_min, seed=seed))
    x = np.random.default_rng(seed + 1).standard_normal((tokens, cols)).astype(np.float32)
    return w, x


def assert_matches_reference(y: np.ndarray, w: PackedMatrix, x: np.ndarray) -> None:
    """|y - reference| <= 1e-5 * magnitude + 1e-6, elementwise.

    The kernel and the reference do the same integer arithmetic (same int8 activation codes, same
    integer sums per group); they differ only in float rounding: the kernel rounds scale * step
    and the group sums the mins multiply (the LUT kernel's sums of x, added in float32; the int8
    kernel's step times the codes' sum, ggml's Q8_1 sum) to float32 and accumulates its G = K / group
    terms in float32, the reference works in float64. That error is at most about
    (G + group + 3) * 2**-24 times the size of the terms added, which is <= 1e-5 for every shape
    here (G + group <= 80).

    The size of the terms is |x| @ (|scale| |q| + |min|).T, not |x| @ |W|.T: the scale and min
    terms can cancel (a Q4_0 row of 8s has W = 0 but terms of 8 * scale * sum(x)), and each is
    rounded on its own.
    """
    scales, mins = w.group_params()
    q = w.codes().astype(np.float32).reshape(w.rows, -1, w.group)
    terms = (np.abs(q) * np.abs(scales[..., None]) + np.abs(mins[..., None])).reshape(w.rows, w.cols)
    bound = 1e-5 * (np.abs(x.astype(np.float64)) @ terms.T.astype(np.float64)) + 1e-6
    error = np.abs(y - matmul_reference(w, x))
    assert y.dtype == np.float32 and y.shape == (x.shape[0], w.rows)
    assert np.all(error <= bound), f"worst error / bound: {(error / bound).max():.3g}"


# --- agreement with the reference ---------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_matches_reference(isa, kind, shape):
    tokens, rows, cols, group = shape
    w, x = packed_and_acts(kind, tokens, rows, cols, group, seed=tokens)
    _kernels.set_isa(isa)
    assert_matches_reference(matmul(w, x), w, x)


def weight_type_matrix(ggml_type: int, rows: int, cols: int, seed: int = 0) -> PackedMatrix:
    """Random blocks of a GGUF type (finite scales), packed as the kernels read them."""
    shape = (cols, rows)  # GGUF order
    return pack(to_quant_groups(random_tensor(ggml_type, shape, seed), ggml_type, shape))


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("ggml_type", WEIGHT_TYPES, ids=type_name)
def test_kernel_matches_reference_on_each_weight_type(ggml_type, tokens):
    w = weight_type_matrix(ggml_type, 65, 512, seed=tokens)
    x = np.random.default_rng(tokens).standard_normal((tokens, 512)).astype(np.float32)
    for isa in ISAS:
        _kernels.set_isa(isa)
        assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.parametrize("isa", ISAS)
def test_two_level_integer_sums_at_their_largest_do_not_overflow(isa):
    # Q6_K's extremes: 16 groups of 16 codes at -32 under sub-scales of -128, every activation code
    # +127 or -127: a super block's integer sum reaches 16 * 16 * 32 * 128 * 127 = 127 * 2^20.
    rows, cols, group = 64, 256, 16
    sub = SubScales(np.zeros((rows, 16), np.uint8), None, np.ones((rows, 1), np.float32), None, bits=8,
                    offset=128)
    scale = np.full((rows, 16), -128.0, np.float32)
    w = pack(QuantGroups(np.full((rows, cols), -32, np.int8), scale, np.full_like(scale, -0.0), group, 8,
                         width=6, zero=32, sub=sub))
    x = np.full((2, cols), 0.5, np.float32)
    x[1] = -0.5
    _kernels.set_isa(isa)
    expected = np.repeat([[4096 * 0.5 * cols], [-4096 * 0.5 * cols]], rows, axis=1)  # every weight 4096
    assert np.array_equal(matmul(w, x), expected)


# Q3_K's and Q2_K's forms: (width, zero, sub bits, sub offset, with mins). Their kernel keeps two
# groups' dots in one register as int16 pairs.
TWO_BIT_FORMS = {"Q3_K": (3, 4, 6, 32, False), "Q2_K": (2, 0, 4, 0, True)}


@pytest.mark.parametrize("form", TWO_BIT_FORMS.values(), ids=TWO_BIT_FORMS.keys())
@pytest.mark.parametrize("isa", ISAS)
def test_two_bit_group_dots_at_their_largest_fit_their_int16_pairs(isa, form):
    # Half the rows at the largest code (7 or 3), half at code 0, under the extreme sub codes (0 and
    # 63 or 15), every activation code +127 or -127: a group's dot reaches 7 * 16 * 127 = 14224 and
    # Q3_K's zero share 4 * 16 * 127 = 8128.
    width, zero, sub_bits, offset, with_mins = form
    rows, cols, group = 64, 256, 16
    largest, sub_largest = (1 << width) - 1, (1 << sub_bits) - 1
    code = np.where(np.arange(rows)[:, None] < rows // 2, largest, 0).repeat(cols, axis=1)
    sub_codes = np.where(np.arange(rows)[:, None] % 2 == 0, 0, sub_largest).repeat(cols // group, axis=1)
    sub_codes = sub_codes.astype(np.uint8)
    scale = sub_codes.astype(np.float32) - offset
    min_ = -sub_codes.astype(np.float32) if with_mins else np.full_like(scale, -0.0)
    ones = np.ones((rows, 1), np.float32)
    sub = SubScales(sub_codes, sub_codes if with_mins else None, ones, ones if with_mins else None,
                    bits=sub_bits, offset=offset)
    q = (code - zero).astype(np.int8)
    w = pack(QuantGroups(q, scale, min_, group, 8, width=width, zero=zero, sub=sub))
    x = np.full((2, cols), 0.5, np.float32)
    x[1] = -0.5
    _kernels.set_isa(isa)
    weight = scale[:, 0] * (code[:, 0] - zero) + min_[:, 0]  # every weight of a row
    assert np.array_equal(matmul(w, x), np.outer(x[:, 0] * cols, weight))


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
@pytest.mark.parametrize("isa", ISAS)
def test_largest_lut_group_does_not_overflow(isa, bits):
    # Every table entry +127 (all x equal and positive) and every code at its maximum: the
    # int16 accumulators reach their largest value.
    group = lut_max_group(bits)
    q = np.full((64, group), (1 << bits) - 1, np.uint8)
    ones = np.ones((64, 1), np.float32)
    w = pack(QuantGroups(q, ones, ones, group, bits))
    x = np.full((2, group), 0.5, np.float32)
    x[1] = -0.5
    _kernels.set_isa(isa)
    assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_group_past_the_lut_limit_is_refused(bits):
    group = lut_max_group(bits) + 8
    with pytest.raises(ValueError, match=f"at most {lut_max_group(bits)}, not {group}"):
        pack(random_groups(64, group, bits, group))
    w = pack(random_groups(64, lut_max_group(bits), bits, lut_max_group(bits)))
    x = np.zeros((1, group), np.float32)
    with pytest.raises(ValueError, match=f"group {group} is not supported with {bits}-bit"):
        _kernels.matmul(bits, group, 64, w.data, w.scales, w.mins, x, np.empty((1, 64), np.float32))


def test_int8_extremes_match_reference():
    # -128 codes have no positive int8 twin: the sign trick must treat |-128| as unsigned 128.
    q = np.full((64, 64), -128, np.int8)
    q[::2] = 127
    ones = np.ones((64, 2), np.float32)
    w = pack(QuantGroups(q, ones, -ones, 32, 8))
    x = np.linspace(-3, 3, 3 * 64, dtype=np.float32).reshape(3, 64)
    for isa in ISAS:
        _kernels.set_isa(isa)
        assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.parametrize("shape", [SHAPES[4], SHAPES[7]], ids=shape_id)
@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_isa_paths_agree(kind, shape):
    w, x = packed_and_acts(kind, *shape)
    results = {}
    for isa in ISAS:
        _kernels.set_isa(isa)
        results[isa] = matmul(w, x)
        assert_matches_reference(results[isa], w, x)
    # The SIMD paths round in the same order, the scalar path differs only by float rounding.
    if {"avx2", "avx512"} <= set(ISAS):
        assert np.array_equal(results["avx2"], results["avx512"])


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
@pytest.mark.parametrize("isa", ISAS)
def test_codebook_product_is_bit_identical_to_the_int8_layout(isa, codebook, shape):
    tokens, rows, cols, group = shape
    groups = codebook_groups(rows, cols, group, codebook, seed=tokens)
    x = np.random.default_rng(tokens).standard_normal((tokens, cols)).astype(np.float32)
    _kernels.set_isa(isa)
    y = matmul(pack(groups), x)
    assert np.array_equal(y.view(np.uint32), matmul(pack(as_int8_codes(groups)), x).view(np.uint32))
    assert_matches_reference(y, pack(groups), x)


@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
def test_codebook_product_is_bit_identical_on_the_simd_paths(codebook):
    if not {"avx2", "avx512"} <= set(ISAS):  # CI machines vary: some have no AVX-512
        pytest.skip(f"two SIMD paths to compare are needed; this machine has {ISAS}")
    w = pack(codebook_groups(200, 256, 32, codebook, seed=5))
    x = np.random.default_rng(5).standard_normal((9, 256)).astype(np.float32)
    results = []
    for isa in ("avx2", "avx512"):
        _kernels.set_isa(isa)
        results.append(matmul(w, x))
    assert np.array_equal(results[0].view(np.uint32), results[1].view(np.uint32))


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
@pytest.mark.parametrize("isa", ISAS)
def test_thread_count_does_not_change_results(isa, kind):
    # Each output tile and token chunk is one work item computed by one thread: bit-identical,
    # also with more workers than this machine has cores (a 16- or 33-thread pool, as on a desktop).
    w, x = packed_and_acts(kind, 70, 200, 96, 32)
    _kernels.set_isa(isa)
    _kernels.set_threads(1)
    single = matmul(w, x)
    for threads in (2, 16, 33):
        _kernels.set_threads(threads)
        assert np.array_equal(matmul(w, x), single), f"{threads} threads"


def test_back_to_back_tiny_jobs_never_mix_their_work_items():
    """A worker late out of one job must not claim items of the next (it once could, reading the
    next job's item count before its claim failed: wrong rows, or a crash)."""
    rng = np.random.default_rng(0)
    weights = [pack(random_groups(rows, 64, 4, 32)) for rows in (128, 192, 576)]
    acts = [rng.standard_normal((tokens, 64)).astype(np.float32) for tokens in (1, 3, 7)]
    _kernels.set_threads(1)
    expected = [[matmul(w, x) for x in acts] for w in weights]
    _kernels.set_threads(2)
    for call in range(60000):
        i, j = call % 3, call // 3 % 3
        assert np.array_equal(matmul(weights[i], acts[j]), expected[i][j]), f"call {call}"


# --- the one approximation: int8 activations ----------------------------------------------------


def quantize_gaussian(rows: int, cols: int, bits: int, group: int, seed: int) -> QuantGroups:
    """Gaussian weights quantized as GGUF does: min/max per group (LUT), or absmax (int8)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols // group, group)).astype(np.float32)
    if bits == 8:
        scale, low = np.abs(w).max(-1) / 127, np.zeros((rows, cols // group), np.float32)
        q = np.rint(w / scale[..., None]).astype(np.int8)
    else:
        low = w.min(-1)
        scale = (w.max(-1) - low) / ((1 << bits) - 1)
        q = np.rint((w - low[..., None]) / scale[..., None]).astype(np.uint8)
    half = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    return QuantGroups(q.reshape(rows, cols), half(scale), half(low), group, bits)


# Measured worst over seeds 0..4 (M=16, N=128, K=512, group 64): 1.0% (1 bit) to 1.6% (2 bits)
# for the LUT kernel, whose int8 tables step by a 127th of a sum of four activations; 0.6% for
# int8, which steps by a 127th of one activation.
EXACT_GAP = {1: 0.02, 2: 0.025, 3: 0.025, 4: 0.025, 8: 0.01}


@pytest.mark.parametrize("bits", sorted(EXACT_GAP))
def test_gap_to_exact_product_is_small(bits):
    w = pack(quantize_gaussian(128, 512, bits, 64, seed=bits))
    x = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    exact = matmul_exact(w, x)
    gap = np.linalg.norm(matmul(w, x) - exact) / np.linalg.norm(exact)
    assert gap < EXACT_GAP[bits]


# --- zeros --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
@pytest.mark.parametrize("isa", ISAS)
def test_zero_activations_give_exact_zeros(isa, kind):
    w, x = packed_and_acts(kind, 5, 65, 96, 32)
    x[2] = 0.0
    _kernels.set_isa(isa)
    y = matmul(w, x)
    assert not np.isnan(y).any()
    assert np.all(y[2] == 0.0)  # step 0 and sum 0: every term, min * 0 included, is zero
    assert_matches_reference(y, w, x)


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
@pytest.mark.parametrize("isa", ISAS)
def test_a_group_of_zero_activations_is_fine(isa, kind):
    w, x = packed_and_acts(kind, 5, 65, 96, 32)
    x[:, 32:64] = 0.0
    _kernels.set_isa(isa)
    y = matmul(w, x)
    assert not np.isnan(y).any()
    assert_matches_reference(y, w, x)


def test_no_tokens_is_an_empty_product():
    w, _ = packed_and_acts((4, True), 1, 65, 64, 32)
    assert matmul(w, np.zeros((0, 64), np.float32)).shape == (0, 65)


# --- bad arguments are exceptions, never crashes ------------------------------------------------


def valid_args(bits: int = 4) -> dict:
    """Arguments of _kernels.matmul, in order: a [65, 64] matrix of `bits`-bit codes, group 32, 3 tokens."""
    w, x = packed_and_acts((bits, True), 3, 65, 64, 32)
    return dict(bits=bits, group=32, rows=65, data=w.data, scales=w.scales, mins=w.mins, x=x,
                y=np.zeros((3, 65), np.float32))


def read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


good_x = np.zeros((3, 64), np.float32)
# (argument changed, its bad value, the error, what its message says)
BAD_ARGUMENTS = [
    ("x", good_x.astype(np.float64), TypeError, "x has item format 'd'"),
    ("x", good_x.astype(np.int32), TypeError, "x has item format 'i'"),
    ("x", np.zeros((64, 3), np.float32).T, TypeError, "x must be a C-contiguous"),
    ("x", np.zeros((3, 128), np.float32)[:, ::2], TypeError, "x must be a C-contiguous"),
    ("x", good_x.astype(">f4"), TypeError, "x has item format"),
    ("x", np.zeros(64, np.float32), ValueError, "x and y must be 2-D, not 1-D"),
    ("x", np.zeros((1, 3, 64), np.float32), ValueError, "x and y must be 2-D, not 3-D"),
    ("x", np.zeros((3, 48), np.float32), ValueError, "x has 48 columns, not a positive multiple of group 32"),
    ("x", np.zeros((3, 0), np.float32), ValueError, "x has 0 columns"),
    # K a multiple of the group but not the packed K: only the data's length can tell.
    ("x", np.zeros((3, 96), np.float32), ValueError, "data holds 4096 items; the packed shape needs 6144"),
    ("y", np.zeros((3, 64), np.float32), ValueError, r"y has shape \[3, 64\]; expected \[3, 65\]"),
    ("y", np.zeros((4, 65), np.float32), ValueError, r"y has shape \[4, 65\]"),
    ("y", np.zeros((3, 65), np.float64), TypeError, "y has item format 'd'"),
    ("y", read_only(np.zeros((3, 65), np.float32)), TypeError, "y must be a C-contiguous, writable"),
    ("y", np.zeros((3, 130), np.float32)[:, ::2], TypeError, "y must be a C-contiguous"),
    ("data", np.zeros(4095, np.uint8), ValueError, "data holds 4095 items; the packed shape needs 4096"),
    ("data", np.zeros(2048, np.int16), TypeError, "data has item format 'h'"),
    ("scales", np.zeros(255, np.float16), ValueError, "scales holds 255 items; the packed shape needs 256"),
    ("scales", np.zeros(256, np.float32), TypeError, "scales has item format 'f'"),
    ("scales", np.zeros(256, np.int16), TypeError, "scales has item format 'h'"),
    ("mins", np.zeros(257, np.float16), ValueError, "mins holds 257 items"),
    ("mins", np.zeros(256, np.float32), TypeError, "mins has item format 'f'"),
    ("mins", None, ValueError, "4-bit weights need mins"),
    ("mins", [0.0] * 256, TypeError, "mins must be a C-contiguous"),
    ("bits", 0, ValueError, "bits must be 1, 2, 3, 4 or 8, not 0"),
    ("bits", 5, ValueError, "bits must be 1, 2, 3, 4 or 8, not 5"),
    ("bits", 9, ValueError, "bits must be 1, 2, 3, 4 or 8, not 9"),
    ("group", 12, ValueError, "group 12 is not supported with 4-bit weights"),
    ("group", 72, ValueError, "group 72 is not supported with 4-bit weights"),  # past lut_max_group
    ("group", 0, ValueError, "group 0 is not supported"),
    ("rows", 0, ValueError, "rows must be positive, not 0"),
    ("rows", 64, ValueError, r"y has shape \[3, 65\]; expected \[3, 64\]"),
]


@pytest.mark.parametrize("name, value, error, message", BAD_ARGUMENTS,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_ARGUMENTS)])
def test_bad_argument_is_an_exception_naming_it(name, value, error, message):
    args = valid_args()
    args[name] = value
    with pytest.raises(error, match=message):
        _kernels.matmul(*args.values())


@pytest.mark.parametrize("group", [2, 6, 0])
def test_int8_group_not_a_multiple_of_four_is_refused(group):
    args = valid_args(bits=8)
    args["group"] = group
    with pytest.raises(ValueError, match=f"group {group} is not supported with 8-bit weights"):
        _kernels.matmul(*args.values())


def codebook_args(codebook: int = 1) -> dict:
    """Arguments of _kernels.matmul for a [65, 64] matrix of codebook indices, group 32, 3 tokens."""
    w = pack(codebook_groups(65, 64, 32, "iq4nl"))
    return dict(bits=8, group=32, rows=65, data=w.data, scales=w.scales, mins=None,
                x=np.ones((3, 64), np.float32), y=np.zeros((3, 65), np.float32), accumulate=False,
                codebook=codebook)


# (argument changed, its bad value, what the error message says)
BAD_CODEBOOK_ARGUMENTS = [
    ("codebook", 3, "codebook 3 is not one of 0..2"),
    ("codebook", -1, "codebook -1 is not one of 0..2"),
    ("bits", 4, "codebook 1 is not one of 0..2 for 8-bit weights"),
    ("group", 4, "group 4 is not supported with 8-bit weights"),
    ("data", np.zeros(8192, np.int8), "data holds 8192 items; the packed shape needs 4096"),  # int8 layout
]


@pytest.mark.parametrize("name, value, message", BAD_CODEBOOK_ARGUMENTS,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_CODEBOOK_ARGUMENTS)])
def test_bad_codebook_argument_is_an_exception_naming_it(name, value, message):
    args = codebook_args()
    args[name] = value
    with pytest.raises(ValueError, match=message):
        _kernels.matmul(**args)


def compact_args() -> dict:
    """Arguments of _kernels.matmul for a real Q5_K matrix [65, 256]: nibbles, high bits and two-level
    scales with mins, 3 tokens."""
    w = pack(to_quant_groups(random_tensor(T.Q5_K, (256, 65)), T.Q5_K, (256, 65)))
    return dict(bits=8, group=w.group, rows=w.rows, data=w.data, scales=None, mins=None,
                x=np.ones((3, 256), np.float32), y=np.zeros((3, 65), np.float32), width=5, zero=0,
                high=w.high, sub_codes=w.sub.codes, supers=w.sub.supers, sub_bits=6, sub_offset=0,
                sub_groups=8, sub_mins=True)


# (argument changed, its bad value, what the error message says)
BAD_COMPACT_ARGUMENTS = [
    ("width", 7, "width 7 is not 8, or 2..6 with 8-bit weights"),
    ("width", 4, "high must be given for widths 3, 5 and 6 only"),
    ("zero", 128, "zero 128 is not in 0..127"),
    ("high", None, "high must be given for widths 3, 5 and 6 only"),
    ("high", np.zeros(100, np.uint8), "high holds 100 items"),
    ("scales", np.zeros(4 * 64 * 8, np.float16), "give either scales or sub_codes and supers"),
    ("mins", np.zeros(2 * 64 * 8, np.float16), "two-level scales code their mins: mins must be None"),
    ("supers", None, "sub_codes and supers go together"),
    ("sub_bits", 5, "sub_bits must be 4, 6 or 8, not 5"),
    ("sub_groups", 3, "sub_groups must divide the groups"),
    ("sub_codes", np.zeros(10, np.uint8), "sub_codes holds 10 items"),
]


@pytest.mark.parametrize("name, value, message", BAD_COMPACT_ARGUMENTS,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_COMPACT_ARGUMENTS)])
def test_bad_compact_layout_argument_is_an_exception_naming_it(name, value, message):
    args = compact_args()
    _kernels.matmul(**args)  # valid as they are
    args[name] = value
    with pytest.raises(ValueError, match=message):
        _kernels.matmul(**args)


def test_two_level_mins_on_a_group_whose_code_sum_passes_int16_are_refused():
    # The int8 kernel pairs each group's activation code sum (up to group * 127) with its min code as
    # int16: a group of 512 columns would overflow it.
    args = compact_args()
    cols, group = 1024, 512
    args.update(group=group, x=np.ones((3, cols), np.float32), width=4, high=None, sub_bits=8, sub_groups=2,
                data=np.zeros(2 * 64 * cols // 2, np.uint8))
    with pytest.raises(ValueError, match="group 512 is over 258 with two-level mins on 8-bit weights"):
        _kernels.matmul(**args)


def test_valid_arguments_work():
    args = valid_args()
    _kernels.matmul(*args.values())
    assert args["y"].any()


@pytest.mark.parametrize("threads", [0, -1, 257, 10**6])
def test_thread_count_out_of_range_is_refused(threads):
    with pytest.raises(ValueError, match=f"threads must be 1..256, not {threads}"):
        _kernels.set_threads(threads)


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError, match="ISA 'sse9' is not one this CPU supports"):
        _kernels.set_isa("sse9")


def test_supported_isas_start_with_scalar_and_include_the_active_one():
    assert ISAS[0] == "scalar" and _kernels.isa() in ISAS


# --- threads ------------------------------------------------------------------------------------


def test_gil_is_released_during_a_product():
    # A pure-Python thread keeps stamping the time; with the GIL held through the call, no stamp
    # could fall inside it. The middle half of the call is clear of Python work on either side.
    w = PackedMatrix(1024, 1024, 4, 32, np.full((16, 128, 4, 64), 0x5A, np.uint8),
                     np.ones((16, 32, 64), np.float16), np.zeros((16, 32, 64), np.float16))
    x = np.ones((8192, 1024), np.float32)  # ~80 ms on one core here: long enough to tell
    out = np.empty((8192, 1024), np.float32)
    _kernels.set_threads(1)
    stamps, stop = [], threading.Event()

    def stamp():
        while not stop.is_set():
            stamps.append(time.perf_counter())
            sum(range(200))

    thread = threading.Thread(target=stamp)
    thread.start()
    while not stamps:
        time.sleep(0.001)
    start = time.perf_counter()
    matmul(w, x, out)
    end = time.perf_counter()
    stop.set()
    thread.join()
    quarter = (end - start) / 4
    assert quarter > 0.01, "the product was too short to tell"
    assert any(start + quarter < s < end - quarter for s in stamps)


def test_pool_survives_resizing():
    w, x = packed_and_acts((4, True), 70, 200, 96, 32)
    _kernels.set_threads(1)
    expected = matmul(w, x)
    assert_matches_reference(expected, w, x)
    for threads in (3, 2, 1, 2):
        _kernels.set_threads(threads)
        assert _kernels.threads() == threads
        assert np.array_equal(matmul(w, x), expected)


def test_concurrent_callers_each_get_their_own_product():
    # Four Python threads share a two-thread pool: the call lock must keep their jobs apart.
    kinds = [(4, True), (8, False), (2, True), (8, True)]
    problems = [packed_and_acts(kind, 33, 130, 96, 32, seed=i) for i, kind in enumerate(kinds)]
    _kernels.set_threads(1)
    expected = [matmul(w, x) for w, x in problems]
    _kernels.set_threads(2)

    def run(i: int) -> bool:
        w, x = problems[i]
        return all(np.array_equal(matmul(w, x), expected[i]) for _ in range(20))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(4)))


# --- many products in one call -------------------------------------------------------------------


def mixed_products() -> list[tuple[PackedMatrix, np.ndarray]]:
    """Matrices of several layouts and shapes, each with its own tokens (none for one of them)."""
    rng = np.random.default_rng(7)
    matrices = [pack(random_groups(65, 96, 4, 32)), gguf_matrix(T.Q4_K, 128, 256),
                pack(random_groups(200, 64, 8, 32)), gguf_matrix(T.Q6_K, 64, 256, seed=1),
                gguf_matrix(T.IQ4_NL, 96, 64, seed=2)]
    tokens = [1, 3, 0, 40, 1]
    return [(w, rng.standard_normal((m, w.cols)).astype(np.float32)) for w, m in zip(matrices, tokens)]


@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_each_gives_each_product_what_matmul_gives(threads):
    products, before = mixed_products(), _kernels.threads()
    outs = [np.full((x.shape[0], w.rows), np.nan, np.float32) for w, x in products]
    _kernels.set_threads(threads)
    try:
        matmul_each([(w, x, out) for (w, x), out in zip(products, outs)])
    finally:
        _kernels.set_threads(before)
    assert all(np.array_equal(out, matmul(w, x)) for (w, x), out in zip(products, outs))


def test_matmul_many_with_a_bad_call_names_it_and_computes_nothing():
    calls = [((4, 32, 65, args["data"], args["scales"], args["mins"], args["x"], args["y"]), None)
             for args in (valid_args(), valid_args())]
    bad = valid_args()
    calls.append(((4, 32, 65, bad["data"][:-1], bad["scales"], bad["mins"], bad["x"], bad["y"]), None))
    with pytest.raises(ValueError, match="data holds"):
        _kernels.matmul_many(calls)
    assert not calls[0][0][-1].any()


@pytest.mark.parametrize("call", [None, (), ((4,),), ([], {}), ((), [])], ids=str)
def test_matmul_many_refuses_what_is_not_args_and_kwargs(call):
    with pytest.raises(TypeError, match=r"calls\[0\]"):
        _kernels.matmul_many([call])


def test_linear_each_is_each_linear_of_its_own_input():
    (w1, x1), (w2, x2), (w3, x3) = mixed_products()[:3]
    bias = np.linspace(-1, 1, w2.rows, dtype=np.float32)
    linears = [PackedLinear(w1), PackedLinear(w2, bias), lambda x: 2 * x, PackedLinear(w3)]
    xs = [x1, x2, x3, x3]
    outs = linear_each(linears, xs)
    assert all(np.array_equal(out, linear(x)) for out, linear, x in zip(outs, linears, xs))


# --- PackedLinear -------------------------------------------------------------------------------


@pytest.fixture
def linear_and_matrix():
    w = pack(random_groups(65, 96, 4, 32))
    return PackedLinear(w), w


def test_packed_linear_is_the_kernel_product(linear_and_matrix):
    linear, w = linear_and_matrix
    x = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32)
    y = linear(x)
    assert y.shape == (5, 65) and y.dtype == np.float32
    assert np.array_equal(y, matmul(w, x))


@pytest.mark.parametrize("make", [
    lambda x: x.T.copy().T,  # transposed storage
    lambda x: np.stack([x, np.zeros_like(x)], axis=-1)[..., 0],  # every other float
    lambda x: x.astype(np.float64),
], ids=["transposed", "strided", "float64"])
def test_packed_linear_refuses_other_layouts(linear_and_matrix, make):
    linear, _ = linear_and_matrix
    x = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    with pytest.raises(TypeError, match="x"):
        linear(make(x))


def test_packed_linear_adds_bias(linear_and_matrix):
    _, w = linear_and_matrix
    bias = np.linspace(-1, 1, 65, dtype=np.float32)
    x = np.random.default_rng(2).standard_normal((6, 96)).astype(np.float32)
    assert np.array_equal(PackedLinear(w, bias)(x), PackedLinear(w)(x) + bias)
    assert PackedLinear(w, bias).nbytes == w.nbytes + 65 * 4


A_HIGH_PLANE = np.zeros(64, np.uint8)


@pytest.mark.parametrize("width, high", [(7, None), (1, None), (5, None), (3, None), (4, A_HIGH_PLANE),
                                         (2, A_HIGH_PLANE)], ids=str)
def test_pack_fields_refuses_a_width_and_high_plane_that_disagree(width, high):
    data = np.zeros((1, 4, 64, 4), np.uint8)
    with pytest.raises(ValueError, match="pack_fields: q must be 2-D .* width 2..6"):
        _kernels.pack_fields(np.zeros((3, 32), np.int8), 0, width, data, high)
