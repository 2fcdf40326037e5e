"""The Triton kernels against their torch references and the CPU kernels, on the same packed bytes.

Without CUDA the kernels run in Triton's interpreter on CPU tensors, so the shapes stay small
(TRITON_INTERPRET is set from here on in the process: only Triton reads it); with CUDA they run
compiled on the GPU, and the cuda-marked tests add model-sized shapes, the copy stream, pinned
buffers and events.
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.support.gpu import load_gpu_kernels_or_skip
from tests.test_kernels import WEIGHT_TYPES, weight_type_matrix
from tests.test_packed import KINDS, as_int8_codes, codebook_groups, gguf_matrix, kind_id, random_groups
from tierflow.cpu_kernels import ops as cpu_ops
from tierflow.cpu_kernels.kv_layout import CACHE_DTYPES, cache_shapes, decode, read_rows
from tierflow.cpu_kernels.matmul import matmul as cpu_matmul
from tierflow.cpu_kernels.packed import PackedMatrix, pack
from tierflow.cpu_kernels.quant_groups import CODEBOOKS
from tierflow.ggml_types import type_name
from tierflow.gpu_kernels import reference
from tierflow.gpu_kernels.attention import attention
from tierflow.gpu_kernels.launch import (
    TritonUnavailableError,
    check_device,
    load_kernels,
)
from tierflow.gpu_kernels.matmul import DeviceLinear, matmul, matmul_silu_mul
from tierflow.gpu_kernels.ops import add_rms_norm, rms_norm, silu_mul
from tierflow.gpu_kernels.packed import DeviceMatrix, to_device, view_matrix
from tierflow.kv_types import KV_TYPES
from tierflow.offload.tiers.device import DeviceTier

pytestmark = pytest.mark.slow  # the GPU kernels run through Triton's interpreter here: minutes in all

CUDA = load_gpu_kernels_or_skip()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# Error bound per activation dtype, relative to the size of the terms summed: float32 rounding,
# or W rounded to the activations' dtype for the tensor-core product.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def packed(kind, rows: int, cols: int, group: int, seed: int = 0, device=DEVICE):
    """(PackedMatrix, its DeviceMatrix) of random codes, scales and mins."""
    bits, has_min = kind
    matrix = pack(random_groups(rows, cols, bits, group, has_min=has_min, seed=seed))
    return matrix, to_device(matrix, device)


def activations(tokens: int, cols: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, cols, generator=generator).to(DEVICE, dtype)


def assert_matches_reference(y: torch.Tensor, w: DeviceMatrix, x: torch.Tensor) -> None:
    """|y - reference| <= tolerance * (|x| @ (|scale q| + |min|).T) + output rounding, elementwise:
    the size of the terms summed (they may cancel), not of the result."""
    scales, mins = reference.group_params(w)
    terms = reference.codes(w).abs().float() * scales.abs() + mins.abs()  # [N, K]
    expected = reference.matmul_reference(w, x).float()
    rounding = expected.abs() * (0 if x.dtype == torch.float32 else torch.finfo(x.dtype).eps)
    bound = TOLERANCE[x.dtype] * (x.float().abs() @ terms.T) + rounding + 1e-6
    error = (y.float() - expected).abs()
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.rows)
    assert torch.all(error <= bound), f"worst error / bound: {(error / bound).max():.3g}"


# --- dequantize-and-multiply --------------------------------------------------------------------

# M tokens, N rows, K columns, group: one token and a few (decode), part of a tile and several.
DECODE_SHAPES = [(1, 65, 96, 32), (2, 70, 64, 16)]
shape_id = lambda s: "M{}-N{}-K{}-g{}".format(*s)  # noqa: E731


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=shape_id)
@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_decode_matmul_matches_reference(kind, shape):
    tokens, rows, cols, group = shape
    _, w = packed(kind, rows, cols, group)
    x = activations(tokens, cols)
    assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("kind", [(4, True), (8, False)], ids=kind_id)
def test_decode_matmul_split_over_k_matches_reference(kind, split_k):
    _, w = packed(kind, 40, 192, 32)
    x = activations(2, 192)
    assert_matches_reference(matmul(w, x, split_k=split_k), w, x)


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_prefill_matmul_matches_reference(kind):
    _, w = packed(kind, 65, 96, 32)
    x = activations(9, 96)
    assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.parametrize("tokens", [1, 9], ids=["decode", "prefill"])
@pytest.mark.parametrize("ggml_type", WEIGHT_TYPES, ids=type_name)
def test_matmul_matches_reference_on_each_weight_type(ggml_type, tokens):
    w = to_device(weight_type_matrix(ggml_type, 65, 256, seed=tokens), DEVICE)
    x = activations(tokens, 256)
    assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_activations_give_half_results(dtype, tokens):
    if dtype == torch.bfloat16 and tokens > 4 and not CUDA:  # the tensor-core kernel
        pytest.skip("Triton's interpreter gets bfloat16 tl.dot wrong (3.9); the CUDA tests cover it")
    _, w = packed((4, True), 65, 64, 32)
    x = activations(tokens, 64, dtype)
    assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_kernels_read_the_layout_as_the_cpu_kernels_do(kind):
    """With one-hot activations both kernels return W.T itself (the CPU kernel's int8 tables are
    exact for them), up to the rounding of `scale * q + min`; any difference in how the bytes are
    read would show in full."""
    matrix, w = packed(kind, 65, 64, 32, seed=kind[0])
    eye = np.eye(64, dtype=np.float32)
    for result in (matmul(w, torch.from_numpy(eye).to(DEVICE)).cpu().numpy(), cpu_matmul(matrix, eye)):
        assert np.all(np.abs(result - matrix.dequantize().T) <= weight_rounding(matrix))


def weight_rounding(matrix: PackedMatrix) -> np.ndarray:
    """[K, N]: what a kernel's rounding of `scale * q + min` may move each weight by, relative to the
    size of the terms (1e-5 of |scale q| + |min|: float32, or tf32x3 on tensor cores)."""
    scales, mins = matrix.group_params()
    q = np.abs(matrix.codes().astype(np.float32).reshape(matrix.rows, -1, matrix.group))
    terms = q * np.abs(scales[..., None]) + np.abs(mins[..., None])
    return 1e-5 * terms.reshape(matrix.rows, matrix.cols).T + 1e-7


@pytest.mark.parametrize("kind", [(2, True), (8, True)], ids=kind_id)
def test_decode_matches_the_cpu_kernel_up_to_its_activation_rounding(kind):
    matrix, w = packed(kind, 65, 96, 32)
    x = activations(1, 96)
    ours = matmul(w, x).cpu().numpy()
    theirs = cpu_matmul(matrix, x.cpu().numpy())
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(ours) < 0.02  # int8 activations: about 0.5%


@pytest.mark.parametrize("tokens", [2, 9], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", [(3, True), (8, False)], ids=kind_id)
def test_gate_up_projection_with_silu_mul_epilogue_matches_reference(kind, tokens):
    _, w = packed(kind, 80, 64, 32)  # F = 40: the up rows start inside a tile
    assert_silu_mul_matches_reference(w, activations(tokens, 64))


def assert_silu_mul_matches_reference(w: DeviceMatrix, x: torch.Tensor) -> None:
    expected = reference.matmul_silu_mul_reference(w, x)
    torch.testing.assert_close(matmul_silu_mul(w, x), expected, rtol=1e-4, atol=1e-4 * expected.abs().max())


def test_matmul_writes_into_out_and_device_linear_adds_the_bias():
    _, w = packed((4, True), 65, 64, 32)
    x, out, bias = activations(1, 64), torch.empty(1, 65, device=DEVICE), torch.randn(65).to(DEVICE)
    assert matmul(w, x, out) is out
    assert_matches_reference(out, w, x)
    torch.testing.assert_close(DeviceLinear(w, bias)(x), out + bias)
    assert matmul(w, torch.empty(0, 64, device=DEVICE)).shape == (0, 65)


def uploaded(matrix: PackedMatrix, tier: DeviceTier | None = None) -> tuple[torch.Tensor, dict]:
    """The matrix's arrays as one layer's bytes (each 64-byte aligned, as a pack holds them),
    uploaded to `tier` (by default the stand-in tier), and the pack's manifest entry placing them."""
    sub = matrix.sub
    arrays = {"data": matrix.data, "high": matrix.high, "scales": matrix.scales, "mins": matrix.mins,
              "codes": sub and sub.codes, "supers": sub and sub.supers}
    layer, places = bytearray(), {}
    for name, array in arrays.items():
        if array is not None:
            layer += bytes(-len(layer) % 64)
            places[name] = [len(layer), array.nbytes]
            layer += array.tobytes()
    place = places.get
    spec = dict(rows=matrix.rows, cols=matrix.cols, bits=matrix.bits, group=matrix.group,
                codebook=matrix.codebook, width=matrix.width, zero=matrix.zero, data=place("data"),
                high=place("high"), scales=place("scales"), mins=place("mins"),
                sub=sub and dict(bits=sub.bits, offset=sub.offset, groups_per_super=sub.groups_per_super,
                                 with_mins=sub.with_mins, codes=place("codes"), supers=place("supers")))
    tier = tier or DeviceTier(DEVICE, budget=1 << 20)
    return tier.upload(memoryview(layer)), spec


def test_views_of_an_uploaded_layer_are_the_matrix():
    """A layer's bytes, uploaded as one buffer (the stand-in tier here), viewed in place."""
    matrix, w = packed((4, True), 65, 64, 32)
    copy, spec = uploaded(matrix)
    viewed = view_matrix(copy, spec)
    assert viewed.data.data_ptr() == copy.data_ptr()
    x = activations(1, 64)
    assert torch.equal(matmul(viewed, x), matmul(w, x))


@pytest.mark.parametrize("tokens", [1, 9], ids=["decode", "prefill"])
@pytest.mark.parametrize("codebook", sorted(CODEBOOKS))
def test_a_codebook_matrix_computes_on_the_device_as_its_int8_layout(codebook, tokens):
    """Copied, or viewed in an uploaded layer, the 4-bit indices stay 4 bits; the kernels look the
    codes up and compute exactly as on the int8 layout of the same codes."""
    groups = codebook_groups(80, 64, 32, codebook)  # F = 40 gate and up rows
    nibbles, expected = pack(groups), to_device(pack(as_int8_codes(groups)), DEVICE)
    copy, spec = uploaded(nibbles)
    x = activations(tokens, 64)
    for w in (to_device(nibbles, DEVICE), view_matrix(copy, spec)):
        assert w.data.dtype == torch.uint8 and 2 * w.data.numel() == expected.data.numel()
        assert torch.equal(reference.codes(w), reference.codes(expected))
        assert torch.equal(matmul(w, x), matmul(expected, x))
        assert torch.equal(matmul_silu_mul(w, x), matmul_silu_mul(expected, x))


# --- the GGUF types' packed forms, read as they are -----------------------------------------------

# One type of each form the packed layout gives GGUF blocks (cpu_kernels/packed.py): unsigned codes in
# nibbles of width 4, 5 and 6 with a zero code (Q4_0, Q5_0, Q6_K) or float16 mins (Q4_1), and in 2-bit
# fields of width 2 and 3 (Q2_K, Q3_K); LUT codes whose min is their zero code's (TQ2_0); two-level
# scales of 4, 6 and 8 bits, with mins (Q2_K, Q4_K, Q5_K) and without (Q3_K, IQ4_XS, Q6_K).
GGUF_FORMS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_K, T.Q4_K, T.Q6_K, T.Q2_K, T.Q3_K, T.TQ2_0, T.IQ4_XS]


def host_arrays(matrix: PackedMatrix) -> list[np.ndarray | None]:
    sub = matrix.sub
    return [matrix.data, matrix.high, matrix.scales, matrix.mins, sub and sub.codes, sub and sub.supers]


def device_arrays(w: DeviceMatrix) -> list[torch.Tensor | None]:
    """The matrix's own arrays, in host_arrays' order (a codebook's table is shared, not its own)."""
    sub = w.sub
    return [w.data, w.high, w.scales, w.mins, sub and sub.codes, sub and sub.supers]


@pytest.mark.parametrize("ggml_type", GGUF_FORMS, ids=type_name)
def test_a_device_matrix_holds_the_packed_bytes_and_no_more(ggml_type):
    """The device is budgeted by the pack's bytes: every array is copied as it is, none expanded."""
    matrix = gguf_matrix(ggml_type, 65, 256)
    w = to_device(matrix, DEVICE)
    for tensor, array in zip(device_arrays(w), host_arrays(matrix), strict=True):
        assert (tensor is None) == (array is None)
        assert tensor is None or torch.equal(tensor.cpu(), torch.from_numpy(array))
    assert w.nbytes == matrix.nbytes


@pytest.mark.parametrize("ggml_type", GGUF_FORMS, ids=type_name)
def test_reference_dequantizes_each_gguf_form_as_the_packed_matrix(ggml_type):
    """Bit for bit: the same codes, and ggml's float32 products for the scales (two super blocks)."""
    matrix = gguf_matrix(ggml_type, 65, 512)
    w = to_device(matrix, DEVICE)
    assert torch.equal(reference.codes(w).cpu(), torch.from_numpy(matrix.codes().astype(np.int32)))
    assert torch.equal(reference.dequantize(w).cpu(), torch.from_numpy(matrix.dequantize()))


@pytest.mark.parametrize("tokens", [1, 9], ids=["decode", "prefill"])
@pytest.mark.parametrize("ggml_type", GGUF_FORMS, ids=type_name)
def test_matmul_matches_reference_on_each_gguf_form(ggml_type, tokens):
    w = to_device(gguf_matrix(ggml_type, 65, 512, seed=tokens), DEVICE)
    x = activations(tokens, 512)
    assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.parametrize("ggml_type", GGUF_FORMS, ids=type_name)
def test_kernels_compute_each_gguf_form_as_the_packed_matrix_dequantizes(ggml_type):
    """One-hot activations give columns of W.T itself, up to the rounding of `scale * q + min`: any
    difference in how codes, high bits, zero or sub-scales are read shows in full. Four columns
    (decode), then every 7th (prefill): each group of 16, at every place in a byte or quad."""
    matrix = gguf_matrix(ggml_type, 65, 256)
    w, eye = to_device(matrix, DEVICE), torch.eye(256, device=DEVICE)
    for columns in ([0, 37, 130, 255], list(range(0, 256, 7))):
        error = np.abs(matmul(w, eye[columns]).cpu().numpy() - matrix.dequantize().T[columns])
        assert np.all(error <= weight_rounding(matrix)[columns])


@pytest.mark.parametrize("tokens", [2, 9], ids=["decode", "prefill"])
@pytest.mark.parametrize("ggml_type", GGUF_FORMS, ids=type_name)
def test_gate_up_silu_mul_epilogue_matches_reference_on_each_gguf_form(ggml_type, tokens):
    w = to_device(gguf_matrix(ggml_type, 80, 256), DEVICE)  # F = 40: the up rows start inside a tile
    assert_silu_mul_matches_reference(w, activations(tokens, 256))


@pytest.mark.parametrize("ggml_type", GGUF_FORMS, ids=type_name)
def test_views_of_an_uploaded_layer_hold_each_gguf_form(ggml_type):
    """view_matrix places every array the manifest entry names, in the uploaded bytes themselves."""
    matrix = gguf_matrix(ggml_type, 65, 256)
    copy, spec = uploaded(matrix)
    viewed, copied = view_matrix(copy, spec), to_device(matrix, DEVICE)
    start, end = copy.data_ptr(), copy.data_ptr() + copy.numel()
    for view, tensor in zip(device_arrays(viewed), device_arrays(copied), strict=True):
        assert (view is None) == (tensor is None)
        assert view is None or (torch.equal(view, tensor) and start <= view.data_ptr() < end)
    assert viewed.nbytes == matrix.nbytes
    x = activations(1, 256)
    assert torch.equal(matmul(viewed, x), matmul(copied, x))


# --- norms and activation -----------------------------------------------------------------------


def test_rms_norm_matches_reference_and_the_cpu_op():
    x, weight = activations(5, 96), torch.randn(96).to(DEVICE)
    ours = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(ours, reference.rms_norm_reference(x, weight, 1e-5))
    theirs = cpu_ops.rms_norm(x.cpu().numpy(), weight.cpu().numpy(), 1e-5)
    np.testing.assert_allclose(ours.cpu().numpy(), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_add_rms_norm_updates_the_residual_stream_and_normalises_it(dtype):
    residual, x = activations(3, 80, dtype, seed=2), activations(3, 80, dtype, seed=3)
    weight = torch.randn(80).to(DEVICE)
    expected, total = reference.add_rms_norm_reference(residual, x, weight, 1e-6)
    out = add_rms_norm(residual, x, weight, 1e-6)
    assert torch.equal(residual, total)
    torch.testing.assert_close(out, expected)


def test_silu_mul_matches_reference_and_the_cpu_op():
    gate_up = activations(3, 2 * 80) * 4
    ours = silu_mul(gate_up)
    torch.testing.assert_close(ours, reference.silu_mul_reference(gate_up), rtol=1e-5, atol=1e-6)
    theirs = cpu_ops.silu_mul(gate_up.cpu().numpy())
    np.testing.assert_allclose(ours.cpu().numpy(), theirs, rtol=1e-5, atol=1e-6)


# --- rotary + KV-cache write + attention --------------------------------------------------------

HEADS, KV_HEADS, CAPACITY = 6, 2, 64  # three query heads per key/value head


def qkv_rows(tokens: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, (HEADS + 2 * KV_HEADS) * head_dim, generator=generator).to(DEVICE)


def rope_rows(positions: slice, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(positions.start, positions.stop, dtype=torch.float32),
                         10000.0 ** (-torch.arange(rope_dim // 2) * 2.0 / rope_dim))
    return torch.cos(angles).to(DEVICE), torch.sin(angles).to(DEVICE)


def filled_cache(qkv: torch.Tensor, start: int, head_dim: int, rope_dim: int, neox: bool,
                 capacity: int = CAPACITY, name: str = "f32") -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys [KvH, C/16, I, 16] and values [KvH, C, I] in the type, holding positions
    0 .. start-1."""
    shapes = cache_shapes(KV_TYPES[name], KV_HEADS, capacity, head_dim)
    keys, values = (torch.zeros(shape, dtype=CACHE_DTYPES[name], device=DEVICE) for shape in shapes)
    if start:
        cos, sin = rope_rows(slice(0, start), rope_dim)
        reference.attention_reference(qkv[:start], keys, values, cos, sin, HEADS, 0, neox)
    return keys, values


def assert_same_cache(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...], name: str) -> None:
    """The same rows: bit for bit in the interpreter; compiled, rotation's fused multiply-adds may
    move a key by a float32 rounding, and so its row by a rounding of the type."""
    if not CUDA:
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
        return
    positions = torch.arange(ours[1].shape[1], device=ours[1].device)
    decoded = ([decode(rows, KV_TYPES[name]) for rows in read_rows(*cache, positions)]
               for cache in (ours, theirs))
    step = {"f32": 1e-6, "f16": 1e-3, "q8_0": 1 / 64, "q4_0": 1 / 4}[name]  # of the largest value
    for a, b in zip(*decoded):
        torch.testing.assert_close(a, b, rtol=0, atol=step * float(b.abs().max()) + 1e-6)


def check_attention(tokens: int, start: int, head_dim: int, rope_dim: int, neox: bool, splits=None,
                    capacity: int = CAPACITY, name: str = "f32", **scores) -> None:
    """scores: the window, scale and soft cap, given to the kernel and its reference alike."""
    qkv = qkv_rows(start + tokens, head_dim)
    ours = filled_cache(qkv, start, head_dim, rope_dim, neox, capacity, name)
    theirs = tuple(t.clone() for t in ours)
    new, cos_sin = qkv[start:].contiguous(), rope_rows(slice(start, start + tokens), rope_dim)
    out = attention(new, *ours, *cos_sin, HEADS, start, neox, num_splits=splits, **scores)
    expected = reference.attention_reference(new, *theirs, *cos_sin, HEADS, start, neox, **scores)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert_same_cache(ours, theirs, name)


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
@pytest.mark.parametrize("rope_dim", [16, 8], ids=["full-rope", "half-rope"])
@pytest.mark.parametrize("tokens,start", [(1, 0), (1, 37), (5, 11)], ids=lambda v: str(v))
def test_attention_matches_reference_and_fills_the_cache(tokens, start, rope_dim, neox):
    check_attention(tokens, start, 16, rope_dim, neox)


@pytest.mark.parametrize("splits", [1, 3])
def test_attention_split_over_positions_matches_reference(splits):
    check_attention(2, 40, 16, 16, False, splits)


def test_attention_with_a_head_size_that_is_not_a_power_of_two():
    check_attention(2, 19, 24, 16, True)


@pytest.mark.parametrize("scores", [dict(window=5), dict(window=17), dict(softcap=1.5), dict(scale=0.7),
                                    dict(window=7, softcap=2.0, scale=0.3)],
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("splits", [1, 3])
def test_attention_with_a_window_soft_cap_and_scale_matches_reference(scores, splits):
    """Windows that start inside a block of 16 cached keys, and splits that see no position."""
    check_attention(3, 40, 16, 16, True, splits, **scores)


@pytest.mark.parametrize("splits", [1, 3])
def test_attention_sinks_in_a_window_match_reference(splits):
    """gpt-oss's sinks (one logit per query head, counted once whatever the splits), with its
    sliding window."""
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 3
    check_attention(3, 40, 16, 16, True, splits, window=7, sinks=sinks)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(KV_TYPES))
def test_attention_reads_and_writes_each_cache_type_as_the_reference(name, splits):
    check_attention(3, 37, 32, 32, True, splits, name=name)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])  # keys rotated in blocks of 64 and 128, values of 64
@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_attention_rotates_a_quantized_cache_as_the_reference(name, head_dim, splits):
    """llama.cpp's Hadamard rotation (cpu_kernels/hadamard.py) of the queries, keys, values and
    output, new tokens' keys and values included."""
    check_attention(3, 37, head_dim, head_dim, True, splits, name=name)


@pytest.mark.parametrize("head_dim", [32, 64])  # 64: a quantized cache rotated
@pytest.mark.parametrize("name", list(KV_TYPES))
def test_attention_of_a_batch_equals_token_by_token_in_each_cache_type(name, head_dim):
    """A new token reads its own key rounded through the type, as a later token reads it stored."""
    qkv = qkv_rows(6, head_dim, seed=3)
    cos, sin = rope_rows(slice(0, 6), head_dim)
    empty = lambda: filled_cache(qkv, 0, head_dim, head_dim, False, name=name)  # noqa: E731
    batch = attention(qkv, *empty(), cos, sin, HEADS, 0, False)
    cache = empty()
    steps = [attention(qkv[i: i + 1].contiguous(), *cache, cos[i: i + 1].contiguous(),
                       sin[i: i + 1].contiguous(), HEADS, i, False) for i in range(6)]
    torch.testing.assert_close(batch, torch.cat(steps), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [32, 64])  # 64: a quantized cache rotated
@pytest.mark.parametrize("name", list(KV_TYPES))
@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
def test_attention_matches_the_cpu_kernel_over_a_prefill_and_decode_steps(neox, name, head_dim):
    qkv = qkv_rows(8, head_dim, seed=5)
    gpu_cache = filled_cache(qkv, 0, head_dim, head_dim, neox, name=name)
    cpu_cache = tuple(t.cpu().numpy().copy() for t in gpu_cache)
    for positions in (slice(0, 6), slice(6, 7), slice(7, 8)):
        cos, sin = rope_rows(positions, head_dim)
        rows = qkv[positions].contiguous()
        ours = attention(rows, *gpu_cache, cos, sin, HEADS, positions.start, neox)
        theirs = cpu_ops.attention(rows.cpu().numpy().copy(), *cpu_cache, cos.cpu().numpy(),
                                   sin.cpu().numpy(), HEADS, positions.start, neox)
        np.testing.assert_allclose(ours.cpu().numpy(), theirs, rtol=1e-5, atol=1e-5)
    assert_same_cache(tuple(t.cpu() for t in gpu_cache), tuple(map(torch.from_numpy, cpu_cache)), name)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("change,problem", [
    (dict(bits=5), "1..4 or 8 bits"),
    (dict(group=12), "multiple of 8"),
    (dict(group=24, cols=48), "power of two"),
    (dict(cols=128), "data of a"),
    (dict(scales=torch.zeros(2, 2, 64)), "scales of a"),
    (dict(mins=torch.zeros(2, 1, 64, dtype=torch.float16)), "mins of a"),
    (dict(data=np.zeros((2, 8, 4, 64), np.uint8)), "got ndarray"),
])
def test_a_device_matrix_checks_its_layout(change, problem):
    _, w = packed((4, True), 65, 64, 32, device="cpu")
    fields = dict(rows=w.rows, cols=w.cols, bits=w.bits, group=w.group, data=w.data, scales=w.scales,
                  mins=w.mins)
    with pytest.raises(ValueError, match=problem):
        DeviceMatrix(**(fields | change))


def sub_codes_of(w: DeviceMatrix, codes: torch.Tensor) -> dict:
    return dict(sub=dataclasses.replace(w.sub, codes=codes))


@pytest.mark.parametrize("change,problem", [
    (lambda w: dict(high=None), "high of a 65 x 256 5-bit unsigned matrix must be torch.uint8"),
    (lambda w: dict(width=7), "2..6 or 8 bits wide"),
    (lambda w: dict(zero=32), "zero code of 5-bit unsigned codes is 0..31, not 32"),
    (lambda w: dict(scales=torch.zeros(2, 8, 64, dtype=torch.float16)), "has no scales"),
    (lambda w: dict(sub=None), "scales of a .* got NoneType"),
    (lambda w: sub_codes_of(w, w.sub.codes[:, :, 1:].contiguous()), "sub codes of a"),
    (lambda w: dict(sub=dataclasses.replace(w.sub, bits=5)), "sub-scale codes are 4, 6 or 8 bits"),
    (lambda w: dict(sub=dataclasses.replace(w.sub, offset=64)), "offset of 64 is not a 6-bit code"),
])
def test_a_device_matrix_checks_its_high_bits_and_sub_scales(change, problem):
    w = to_device(gguf_matrix(T.Q5_K, 65, 256), "cpu")
    with pytest.raises(ValueError, match=problem):
        dataclasses.replace(w, **change(w))


def with_entry(spec: dict, key: str, value, sub: bool = False) -> dict:
    """The manifest entry with spec[key] (or spec["sub"][key]) set to value."""
    if sub:
        return spec | {"sub": spec["sub"] | {key: value}}
    return spec | {key: value}


@pytest.mark.parametrize("change,problem", [
    (lambda spec: with_entry(spec, "codes", [spec["sub"]["codes"][0], 64], sub=True),
     r"sub codes is torch.uint8 \[2, 1, 12, 64\], 1536 bytes, but the pack gives it 64"),
    (lambda spec: with_entry(spec, "data", [1 << 20, spec["data"][1]]), "outside the buffer"),
    (lambda spec: with_entry(spec, "supers", [spec["sub"]["supers"][0] + 1, spec["sub"]["supers"][1]],
                             sub=True), "not aligned to 2"),
    (lambda spec: with_entry(spec, "high", None), "high of a .* got NoneType"),
    (lambda spec: with_entry(spec, "scales", spec["data"]), "has no scales"),
    (lambda spec: with_entry(spec, "group", 48), "power of two"),
])
def test_view_matrix_refuses_a_manifest_entry_that_does_not_fit_its_form(change, problem):
    copy, spec = uploaded(gguf_matrix(T.Q5_K, 65, 256))
    with pytest.raises(ValueError, match=problem):
        view_matrix(copy, change(spec))


def test_matmul_refuses_what_it_cannot_compute():
    _, w = packed((4, True), 65, 64, 32)
    with pytest.raises(TypeError, match="x must be float32, float16, bfloat16, not float64"):
        matmul(w, activations(1, 64, torch.float64))
    with pytest.raises(ValueError, match=r"x must be \[\*, 64\], not \[1, 96\]"):
        matmul(w, activations(1, 96))
    with pytest.raises(ValueError, match="x must be contiguous"):
        matmul(w, activations(64, 2).T)
    with pytest.raises(ValueError, match="out must be"):
        matmul(w, activations(1, 64), out=torch.empty(1, 64, device=DEVICE))
    with pytest.raises(ValueError, match="different devices"):
        matmul(w, torch.empty(1, 64, device="meta"))
    with pytest.raises(TypeError, match="DeviceMatrix"):
        matmul(packed((4, True), 65, 64, 32)[0], activations(1, 64))
    with pytest.raises(ValueError, match="even number of rows"):
        matmul_silu_mul(w, activations(1, 64))


@pytest.mark.parametrize("problem,heads,start,cos_width,dtype", [
    ("heads is not a multiple", 5, 0, 8, torch.float32),
    ("do not fit in the cache", 6, 63, 8, torch.float32),
    ("cos and sin must be", 6, 0, 9, torch.float32),
    ("qkv must be float32", 6, 0, 8, torch.float16),
])
def test_attention_refuses_inconsistent_arguments(problem, heads, start, cos_width, dtype):
    keys, values = filled_cache(qkv_rows(0, 16), 0, 16, 16, False)
    cos = torch.zeros(2, cos_width, device=DEVICE)
    error = TypeError if dtype != torch.float32 else ValueError
    with pytest.raises(error, match=problem):
        attention(qkv_rows(2, 16).to(dtype), keys, values, cos, cos, heads, start, False)


def test_ops_refuse_wrong_dtypes_and_shapes():
    x = activations(2, 8)
    with pytest.raises(TypeError, match="x must be"):
        rms_norm(x.double(), torch.ones(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        rms_norm(x, torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(TypeError, match="residual must be float16"):
        add_rms_norm(x, x.half(), torch.ones(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="even width"):
        silu_mul(activations(2, 7))


def test_cpu_tensors_are_refused_by_compiled_kernels():
    with pytest.raises(ValueError, match="need CUDA tensors"):
        check_device(SimpleNamespace(INTERPRETED=False), x=torch.zeros(1))


def test_a_missing_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    with pytest.raises(TritonUnavailableError, match="pip install 'triton"):
        load_kernels("matmul_kernels")


def test_tierflow_and_the_launchers_import_without_triton():
    code = ("import sys, tierflow, tierflow.gpu_kernels.matmul, tierflow.gpu_kernels.ops, "
            "tierflow.gpu_kernels.attention, tierflow.gpu_kernels.reference; "
            "assert 'triton' not in sys.modules, 'triton was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kernels_compile_for_a_cuda_gpu():
    """The interpreter accepts code the compiler refuses: each kernel is built through ptxas for
    sm_80, no GPU needed (about 12 s; Triton's cache makes a rerun quick)."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tierflow.gpu_kernels.compile_check", "--arch", "80"],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    from tierflow.gpu_kernels.compile_check import variants

    assert len(result.stdout.splitlines()) == len(variants(all_configs=False)), result.stdout


# --- on a CUDA GPU ------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 4, 64])
@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_cuda_matmul_matches_reference_at_model_sizes(kind, tokens):
    _, w = packed(kind, 1024, 2048, 32, device="cuda")
    for dtype in TOLERANCE:
        x = activations(tokens, 2048, dtype)
        assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 4, 64])
@pytest.mark.parametrize("ggml_type", GGUF_FORMS, ids=type_name)
def test_cuda_matmul_matches_reference_on_each_gguf_form_at_model_sizes(ggml_type, tokens):
    w = to_device(gguf_matrix(ggml_type, 1024, 2048), "cuda")
    for dtype in TOLERANCE:
        x = activations(tokens, 2048, dtype)
        assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_K, T.Q6_K], ids=type_name)
def test_cuda_gate_up_silu_mul_matches_reference_on_k_quants_at_model_sizes(ggml_type, tokens):
    """The register-heaviest matrix-vector programs: sub-scales and high bits, for gate and up."""
    w = to_device(gguf_matrix(ggml_type, 2 * 1376, 512), "cuda")
    assert_silu_mul_matches_reference(w, activations(tokens, 512))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 32])
def test_cuda_gate_up_silu_mul_matches_reference_at_model_sizes(tokens):
    _, w = packed((4, True), 2 * 1376, 512, 32, device="cuda")
    x = activations(tokens, 512)
    expected = reference.matmul_silu_mul_reference(w, x)
    torch.testing.assert_close(matmul_silu_mul(w, x), expected, rtol=1e-4, atol=1e-4 * expected.abs().max())


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("tokens,start", [(1, 3000), (16, 1000)])
def test_cuda_attention_over_a_long_cache_matches_reference(tokens, start):
    check_attention(tokens, start, 64, 64, True, capacity=4096)


@pytest.mark.cuda
@needs_cuda
def test_cuda_layer_upload_on_the_copy_stream_then_kernels_on_the_compute_stream():
    """DeviceTier stages the bytes in pinned memory and copies them on its side stream; the
    kernel, on the current stream, runs after `ready` makes that stream wait on the copy's event."""
    matrix, _ = packed((4, True), 4096, 4096, 32, device="cpu")
    tier = DeviceTier(torch.device("cuda"), budget=1 << 30)
    copy, spec = uploaded(matrix, tier)
    assert tier._stream is not None and copy.data_ptr() in tier._events  # in flight on the side stream
    tier.ready(copy)
    assert not tier._events
    w = view_matrix(copy, spec)
    x = activations(1, 4096)
    assert_matches_reference(matmul(w, x), w, x)


@pytest.mark.cuda
@needs_cuda
def test_cuda_pinned_activations_copied_without_blocking_feed_a_kernel_on_a_side_stream():
    _, w = packed((8, False), 512, 1024, 32, device="cuda")
    host = torch.randn(1, 1024).pin_memory()
    stream, landed = torch.cuda.Stream(), torch.cuda.Event()
    with torch.cuda.stream(stream):
        x = host.to("cuda", non_blocking=True)
        landed.record(stream)
    torch.cuda.current_stream().wait_event(landed)
    x.record_stream(torch.cuda.current_stream())
    y = matmul(w, x)
    torch.cuda.synchronize()
    assert_matches_reference(y, w, x)
