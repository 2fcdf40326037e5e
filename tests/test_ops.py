"""The fused layer operations match their torch formulations, and give every token the same bits
whether it is computed alone or in a batch, with the KV cache in every type."""

import numpy as np
import pytest
import torch

from tierflow.cpu_kernels import _kernels
from tierflow.cpu_kernels.kv_layout import CACHE_DTYPES, cache_shapes
from tierflow.cpu_kernels.ops import attention, dense_matmul, rms_norm, silu_mul, swiglu_oai, weighted_rows
from tierflow.cpu_kernels.torch_ops import (
    attention_reference,
    rms_norm_reference,
    silu_mul_reference,
    swiglu_oai_reference,
    weighted_rows_reference,
)
from tierflow.kv_types import KV_TYPES
from tierflow.runtime.compute.cpu import DENSE_KERNEL_TOKENS, DenseLinear
from tierflow.runtime.decoder.decoder import Decoder
from tierflow.runtime.memory.kv_cache import KVCache

HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 6, 2, 32, 48
TYPES = list(KV_TYPES)


def random_qkv(tokens: int, seed: int = 0, head_dim: int = HEAD_DIM) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, (HEADS + 2 * KV_HEADS) * head_dim, generator=generator)


def rope_rows(tokens: int, start: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(start, start + tokens, dtype=torch.float32),
                         10000.0 ** (-torch.arange(rope_dim // 2) * 2.0 / rope_dim))
    return torch.cos(angles), torch.sin(angles)


def empty_cache(name: str = "f32", head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys [K, C/16, I, 16] and values [K, C, I] in the type (ops take their .numpy())."""
    shapes = cache_shapes(KV_TYPES[name], KV_HEADS, CAPACITY, head_dim)
    return tuple(torch.zeros(shape, dtype=CACHE_DTYPES[name]) for shape in shapes)


def random_sinks(with_sinks: bool = True) -> torch.Tensor | None:
    """Attention sinks [H] (gpt-oss's), some above the scores and some below; None without."""
    return torch.randn(HEADS, generator=torch.Generator().manual_seed(7)) * 3 if with_sinks else None


def run_attention(qkv, cache, cos, sin, start, neox, sinks=None) -> torch.Tensor:
    keys, values = cache
    out = attention(qkv.clone().numpy(), keys.numpy(), values.numpy(), cos.contiguous().numpy(),
                    sin.contiguous().numpy(), HEADS, start, neox,
                    sinks=None if sinks is None else sinks.numpy())
    return torch.from_numpy(out)


def test_rms_norm_matches_torch():
    x, weight = torch.randn(5, 96), torch.randn(96)
    out = rms_norm(x.numpy(), weight.numpy(), 1e-5)
    torch.testing.assert_close(torch.from_numpy(out), rms_norm_reference(x, weight, 1e-5))


def test_silu_mul_matches_torch():
    gate_up = torch.randn(3, 2 * 80) * 4
    torch.testing.assert_close(torch.from_numpy(silu_mul(gate_up.numpy())), silu_mul_reference(gate_up))


def test_silu_mul_of_gates_far_below_zero_is_zero_not_the_gate():
    gate = torch.tensor([[-1e30, -1000.0, -200.0, -100.0, -89.0, -88.5, -88.0, -60.0] * 2])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)], dim=1)
    torch.testing.assert_close(torch.from_numpy(silu_mul(gate_up.numpy())), silu_mul_reference(gate_up))


def test_swiglu_oai_matches_torch_across_its_clamps():
    gate_up = torch.randn(3, 2 * 40) * 6  # gates and ups past +-7, a tail of 8 after two vectors
    gate_up[0, :5] = torch.tensor([-1e30, -200.0, 7.0, 7.5, 1e30])
    torch.testing.assert_close(torch.from_numpy(swiglu_oai(gate_up.numpy())), swiglu_oai_reference(gate_up))


@pytest.mark.parametrize("activation", [silu_mul, swiglu_oai])
def test_a_gated_activation_refuses_an_odd_width_naming_the_shapes(activation):
    with pytest.raises(ValueError, match=r"gate_up \[M, 2F\] needs out \[M, F\]"):
        activation(np.ones((2, 33), np.float32))


def test_weighted_rows_match_torch():
    rows, weights = torch.randn(7, 40), torch.rand(3, 4)
    picks = torch.tensor([[6, 0, 2, 1], [3, 3, 5, 4], [0, 1, 2, 6]])
    out = weighted_rows(rows.numpy(), picks.numpy(), weights.numpy())
    torch.testing.assert_close(torch.from_numpy(out), weighted_rows_reference(rows, picks, weights))


def test_weighted_rows_give_a_token_the_same_bits_alone_or_in_a_batch():
    rows, weights = torch.randn(9, 48).numpy(), torch.rand(3, 3).numpy()
    picks = np.array([[8, 1, 4], [0, 2, 7], [5, 6, 3]])
    batch = weighted_rows(rows, picks, weights)
    for t in range(3):
        assert np.array_equal(weighted_rows(rows, picks[t:t + 1], weights[t:t + 1])[0], batch[t])


@pytest.mark.parametrize("pick", [-1, 5])
def test_weighted_rows_refuse_a_pick_outside_the_rows(pick):
    rows, weights = np.ones((5, 16), np.float32), np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match="not a row"):
        weighted_rows(rows, np.array([[0, pick]]), weights)


def test_dense_matmul_matches_float64_with_its_bias():
    x, weight, bias = torch.randn(6, 37), torch.randn(7, 37), torch.randn(7)  # a tail of 5 columns and 3 rows
    out = dense_matmul(x.numpy(), weight.numpy(), bias.numpy())
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double()).float()
    torch.testing.assert_close(torch.from_numpy(out), expected)


def test_dense_matmul_gives_a_token_the_same_bits_alone_or_in_a_batch():
    x, weight = torch.randn(11, 200).numpy(), torch.randn(130, 200).numpy()
    batch = dense_matmul(x, weight)
    for t in range(11):
        assert np.array_equal(dense_matmul(x[t:t + 1], weight)[0], batch[t])


@pytest.mark.parametrize("weight_shape, bias_shape", [((4, 9), None), ((4, 8), (3,))])
def test_dense_matmul_refuses_shapes_that_disagree(weight_shape, bias_shape):
    bias = None if bias_shape is None else np.ones(bias_shape, np.float32)
    with pytest.raises(ValueError, match=r"dense_matmul: x \[T, K\], weight \[N, K\]"):
        dense_matmul(np.ones((2, 8), np.float32), np.ones(weight_shape, np.float32), bias)


@pytest.mark.parametrize("tokens", [1, DENSE_KERNEL_TOKENS, DENSE_KERNEL_TOKENS + 1])
def test_a_dense_linear_matches_torch_below_and_above_the_kernels_bound(tokens):
    x, weight, bias = torch.randn(tokens, 64), torch.randn(24, 64), torch.randn(24)
    out = DenseLinear(weight, bias.numpy())(x.numpy())
    torch.testing.assert_close(torch.from_numpy(out), torch.nn.functional.linear(x, weight, bias))


def check_attention(name: str, head_dim: int, neox: bool, rope_dim: int, tokens: int, start: int,
                    sinks: torch.Tensor | None = None) -> None:
    """The kernel's output is the reference's, and the bytes it writes into the cache are too."""
    qkv = random_qkv(start + tokens, head_dim=head_dim)
    cos, sin = rope_rows(start + tokens, 0, rope_dim)
    ours, theirs = empty_cache(name, head_dim), empty_cache(name, head_dim)
    if start:  # an earlier prompt fills positions 0 .. start - 1
        run_attention(qkv[:start], ours, cos[:start], sin[:start], 0, neox, sinks)
        attention_reference(qkv[:start].clone(), *theirs, cos[:start], sin[:start], HEADS, 0, neox,
                            sinks=sinks)
    new = slice(start, start + tokens)
    out = run_attention(qkv[new], ours, cos[new], sin[new], start, neox, sinks)
    expected = attention_reference(qkv[new].clone(), *theirs, cos[new], sin[new], HEADS, start, neox,
                                   sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("rope_dim", [HEAD_DIM, HEAD_DIM // 2])
@pytest.mark.parametrize("tokens,start", [(1, 0), (1, 17), (7, 0), (5, 11)])
@pytest.mark.parametrize("name", TYPES)
def test_attention_matches_torch_and_fills_the_cache(name, neox, rope_dim, tokens, start):
    check_attention(name, HEAD_DIM, neox, rope_dim, tokens, start)


@pytest.mark.parametrize("head_dim", [64, 128, 192])  # keys rotated in blocks of 64, 128 and 64
@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_attention_rotates_a_quantized_cache_as_the_reference(name, head_dim):
    """llama.cpp's Hadamard rotation (cpu_kernels/hadamard.py): the same bytes in the cache."""
    check_attention(name, head_dim, False, head_dim, 5, 11)


@pytest.mark.parametrize("name", TYPES)
def test_attention_sinks_take_their_share_of_the_softmax_as_the_reference(name):
    """gpt-oss's sinks: one more logit per query head, whose probability goes to no value."""
    check_attention(name, HEAD_DIM, True, HEAD_DIM, 5, 11, random_sinks())


def test_attention_sinks_lower_every_output():
    """A sink only takes probability away: large sinks shrink the output towards zero."""
    qkv, (cos, sin) = random_qkv(4), rope_rows(4, 0, HEAD_DIM)
    plain = run_attention(qkv, empty_cache(), cos, sin, 0, True)
    sunk = run_attention(qkv, empty_cache(), cos, sin, 0, True, torch.full((HEADS,), 30.0))
    assert sunk.abs().max() < 1e-6 * plain.abs().max()


@pytest.mark.parametrize("name", ["f32", "f16"])
def test_attention_with_a_head_size_that_is_not_a_multiple_of_16(name):
    check_attention(name, 24, True, 16, 3, 18)


@pytest.mark.parametrize("name", TYPES)
def test_tree_attention_matches_torch_in_one_call_and_across_two(name):
    """A 5-token prompt, then a tree (two branches from one root) fed as 2 tokens and 3 more."""
    parents = np.array([-1, 0, 1, 0, 3], np.int32)
    depths = 5 + np.array([0, 1, 2, 1, 2])
    qkv = random_qkv(10)
    cos, sin = rope_rows(8, 0, HEAD_DIM)
    cos, sin = torch.cat([cos[:5], cos[depths]]), torch.cat([sin[:5], sin[depths]])
    ours, theirs = empty_cache(name), empty_cache(name)
    run_attention(qkv[:5], ours, cos[:5], sin[:5], 0, False)
    attention_reference(qkv[:5].clone(), *theirs, cos[:5], sin[:5], HEADS, 0, False)
    for part in (slice(5, 7), slice(7, 10)):
        keys, values = ours
        out = attention(qkv[part].clone().numpy(), keys.numpy(), values.numpy(),
                        cos[part].contiguous().numpy(), sin[part].contiguous().numpy(), HEADS, part.start,
                        False, parents[: part.stop - 5], 5)
        expected = attention_reference(qkv[part].clone(), *theirs, cos[part], sin[part], HEADS, part.start,
                                       False, parents[: part.stop - 5], 5)
        torch.testing.assert_close(torch.from_numpy(out), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])  # 64: a quantized cache rotated
@pytest.mark.parametrize("name", TYPES)
def test_attention_of_a_batch_equals_token_by_token_bit_for_bit(name, head_dim, with_sinks):
    """A token reads its own key as stored in the type, as every later token does."""
    qkv, sinks = random_qkv(9, head_dim=head_dim), random_sinks(with_sinks)
    cos, sin = rope_rows(9, 0, head_dim)
    batch = run_attention(qkv, empty_cache(name, head_dim), cos, sin, 0, False, sinks)
    cache = empty_cache(name, head_dim)
    steps = [run_attention(qkv[i: i + 1], cache, cos[i: i + 1], sin[i: i + 1], i, False, sinks)
             for i in range(9)]
    assert torch.equal(batch, torch.cat(steps))


@pytest.fixture
def restore_isa():
    isa = _kernels.isa()
    yield
    _kernels.set_isa(isa)


def prompt_then_tree(name: str, head_dim: int, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A 21-token prompt in one pass, then a 5-token tree (two branches from one root): both
    passes' outputs and the cache they leave."""
    parents = np.array([-1, 0, 1, 0, 3], np.int32)
    qkv = random_qkv(26, seed=3, head_dim=head_dim)
    cos, sin = rope_rows(26, 0, head_dim)
    keys, values = cache = empty_cache(name, head_dim)
    prompt = run_attention(qkv[:21], cache, cos[:21], sin[:21], 0, False, sinks)
    tree = attention(qkv[21:].clone().numpy(), keys.numpy(), values.numpy(), cos[21:].contiguous().numpy(),
                     sin[21:].contiguous().numpy(), HEADS, 21, False, parents, 21,
                     sinks=None if sinks is None else sinks.numpy())
    return prompt, torch.from_numpy(tree), keys, values


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
@pytest.mark.parametrize("name", TYPES)
def test_every_isa_gives_attention_the_same_bits(name, head_dim, with_sinks, restore_isa):
    """Each ISA's copy of the kernel (csrc/attend_*.c) does the same float32 steps in the same
    order, so the choice of ISA never changes a token's output."""
    results = []
    for isa in _kernels.supported_isas():
        _kernels.set_isa(isa)
        results.append(prompt_then_tree(name, head_dim, random_sinks(with_sinks)))
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))


@pytest.mark.parametrize("name", TYPES)
def test_model_logits_of_a_prefill_equal_those_of_decoding_token_by_token(engine, name):
    """So greedy output never depends on how a prompt was split (prefix reuse, verify batches)."""
    decoder = Decoder(engine.config, engine.arch.block, engine.weights, 64)
    ids = np.array(engine.tokenize("Batches and single steps agree."))
    all_at_once = decoder.forward(ids, KVCache(engine.config, 64, kv_type=KV_TYPES[name]), all_logits=True)
    cache = KVCache(engine.config, 64, kv_type=KV_TYPES[name])
    one_by_one = np.concatenate([decoder.forward(ids[i: i + 1], cache) for i in range(len(ids))])
    assert np.array_equal(all_at_once, one_by_one)


@pytest.mark.parametrize("problem,heads,start,rope_dim,cos_width,out_width", [
    ("heads is not a multiple", 5, 0, 16, 8, HEADS * HEAD_DIM),
    ("do not fit in the cache", 6, 47, 16, 8, HEADS * HEAD_DIM),
    ("rope_dim must be even", 6, 0, 15, 8, HEADS * HEAD_DIM),
    ("cos and sin must be", 6, 0, 16, 4, HEADS * HEAD_DIM),
    ("out must be", 6, 0, 16, 8, 8),
])
def test_attention_refuses_inconsistent_arguments(problem, heads, start, rope_dim, cos_width, out_width):
    keys, values = (t.numpy() for t in empty_cache())
    cos, sin = (t[:, :cos_width].contiguous().numpy() for t in rope_rows(2, 0, HEAD_DIM))
    with pytest.raises(ValueError, match=problem):
        _kernels.attention(random_qkv(2).numpy(), keys, values, cos, sin, torch.empty(2, out_width).numpy(),
                           heads, start, rope_dim, False, 1.0)


@pytest.mark.parametrize("keys_type,values_type,problem", [
    ("q8_0", "q4_0", "keys must be"),
    ("f16", "f32", "differ in type"),
])
def test_attention_refuses_a_cache_whose_keys_and_values_disagree(keys_type, values_type, problem):
    keys, values = empty_cache(keys_type)[0].numpy(), empty_cache(values_type)[1].numpy()
    cos, sin = (t.numpy() for t in rope_rows(2, 0, HEAD_DIM))
    with pytest.raises(ValueError, match=problem):
        attention(random_qkv(2).numpy(), keys, values, cos, sin, HEADS, 0, False)


def test_attention_refuses_sinks_that_are_not_one_per_query_head():
    keys, values = (t.numpy() for t in empty_cache())
    cos, sin = (t.numpy() for t in rope_rows(2, 0, HEAD_DIM))
    with pytest.raises(ValueError, match=r"sinks must be \[heads\]"):
        attention(random_qkv(2).numpy(), keys, values, cos, sin, HEADS, 0, False,
                  sinks=np.zeros(HEADS - 1, np.float32))


def test_attention_refuses_byte_rows_that_are_no_block_type():
    keys = torch.zeros(KV_HEADS, 3, 40, 16, dtype=torch.uint8)  # rows of 40 bytes for head size 32
    values = torch.zeros(KV_HEADS, 48, 40, dtype=torch.uint8)
    cos, sin = (t.numpy() for t in rope_rows(2, 0, HEAD_DIM))
    with pytest.raises(ValueError, match="q8_0 .34 bytes. or q4_0"):
        attention(random_qkv(2).numpy(), keys.numpy(), values.numpy(), cos, sin, HEADS, 0, False)


def test_ops_refuse_wrong_dtypes_and_shapes():
    with pytest.raises(TypeError, match="x"):
        _kernels.rms_norm(torch.zeros(2, 4, dtype=torch.float64).numpy(), torch.ones(4).numpy(), 1e-5,
                          torch.empty(2, 4).numpy())
    with pytest.raises(ValueError, match="rms_norm"):
        _kernels.rms_norm(torch.zeros(2, 4).numpy(), torch.ones(3).numpy(), 1e-5, torch.empty(2, 4).numpy())
    with pytest.raises(ValueError, match="silu_mul"):
        _kernels.silu_mul(torch.zeros(2, 6).numpy(), torch.empty(2, 4).numpy())
