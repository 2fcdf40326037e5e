"""Sliding-window layers keep a ring of their window and a pass, position p in slot p % capacity:
the kernels read and write by slot, the cache is sized, planned and counted as rings, and the
model gives the same bits as with whole-context caches across prefix reuse, token trees and
context shift, and llama.cpp's logits on F32.

The kernel tests use tiny rings (a ring holds any pass whose window and tokens fit, in whole
blocks of 16: kv_types.scored_slots); the model tests a generated Gemma 3 with a window of 32,
whose ring is 560 positions (kv_types.ring_positions) in a context of 2048.
"""

import functools
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.support.gpu import load_gpu_kernels_or_skip
from tests.support.make_model import ModelSpec, write_model
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    assert_greedy_agrees,
    assert_logits_agree,
    llama_cpp_model,
)
from tests.test_ops import HEADS, KV_HEADS, random_qkv, random_sinks, rope_rows
from tests.test_token_tree import TREE_PARENTS, TREE_TOKENS, path_to
from tierflow import Engine
from tierflow.cpu_kernels.kv_layout import CACHE_DTYPES, cache_shapes
from tierflow.cpu_kernels.ops import attention
from tierflow.cpu_kernels.torch_ops import attention_reference
from tierflow.errors import InvalidArgumentError
from tierflow.kv_types import KV_TYPES, MAX_PASS_TOKENS, cache_positions, ring_positions, scored_slots
from tierflow.offload.plan.budgets import kv_cache_bytes
from tierflow.runtime.decoder.decoder import Decoder
from tierflow.runtime.generation.token_loop import TokenGenerator
from tierflow.runtime.memory import attention_rows
from tierflow.runtime.memory.kv_cache import KVCache

NEVER = threading.Event()
HEAD_DIM, WINDOW, RING = 32, 10, 48  # the kernel tests' ring: three blocks of 16
LENGTH = 150  # positions the kernel tests feed: the ring wraps three times
PASSES = [3, 1, 4, 2, 5, 1, 1, 3]  # tokens per pass, cycled: passes straddle the ring's end


def ring_cache(capacity: int = RING, name: str = "f32") -> tuple[torch.Tensor, torch.Tensor]:
    shapes = cache_shapes(KV_TYPES[name], KV_HEADS, capacity, HEAD_DIM)
    return tuple(torch.zeros(shape, dtype=CACHE_DTYPES[name]) for shape in shapes)


def c_attention(qkv, cache, cos, sin, start, parents=None, tree_start=None, held_from=0,
                sinks=None) -> torch.Tensor:
    keys, values = cache
    out = attention(qkv.clone().numpy(), keys.numpy(), values.numpy(), cos.contiguous().numpy(),
                    sin.contiguous().numpy(), HEADS, start, True, parents, tree_start, WINDOW,
                    held_from=held_from, sinks=None if sinks is None else sinks.numpy())
    return torch.from_numpy(out)


def pass_bounds(length: int) -> list[tuple[int, int]]:
    bounds, start, i = [], 0, 0
    while start < length:
        end = min(start + PASSES[i % len(PASSES)], length)
        bounds.append((start, end))
        start, i = end, i + 1
    return bounds


def feed(run, cache, length: int = LENGTH) -> list[torch.Tensor]:
    """Outputs of positions 0 .. length - 1 fed pass by pass through run(qkv, cache, cos, sin, start)."""
    qkv, (cos, sin) = random_qkv(length, head_dim=HEAD_DIM) * 2, rope_rows(length, 0, HEAD_DIM)
    return [run(qkv[a:b], cache, cos[a:b], sin[a:b], a) for a, b in pass_bounds(length)]


def reference_attention(qkv, cache, cos, sin, start, sinks=None) -> torch.Tensor:
    return attention_reference(qkv.clone(), *cache, cos, sin, HEADS, start, True, window=WINDOW, sinks=sinks)


# --- the kernels ---------------------------------------------------------------------------------


def test_ring_sizes_hold_the_window_and_a_pass_in_whole_blocks():
    for window in (1, 32, 100, 1024, 4096):
        ring = ring_positions(window)
        assert ring % 16 == 0 and window + MAX_PASS_TOKENS + 14 <= ring < window + MAX_PASS_TOKENS + 30
        starts = range(window, window + 16)  # the first position seen at each place in its block
        assert max(scored_slots(start, start + MAX_PASS_TOKENS, window) for start in starts) == ring
    assert cache_positions(100, 32) == 112  # a context shorter than the ring: the whole of it
    assert cache_positions(4096, 32) == ring_positions(32) == 560
    assert cache_positions(4096, 0) == 4096


def test_the_c_kernel_over_a_wrapping_ring_matches_the_reference_over_the_whole_context():
    ours = feed(c_attention, ring_cache())
    theirs = feed(reference_attention, ring_cache(160))
    torch.testing.assert_close(torch.cat(ours), torch.cat(theirs), rtol=1e-5, atol=1e-5)


def test_attention_sinks_over_a_wrapping_ring_match_the_reference_over_the_whole_context():
    sinks = random_sinks()
    ours = feed(functools.partial(c_attention, sinks=sinks), ring_cache())
    theirs = feed(functools.partial(reference_attention, sinks=sinks), ring_cache(160))
    torch.testing.assert_close(torch.cat(ours), torch.cat(theirs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["f32", "q8_0"])
def test_a_ring_gives_the_c_kernel_the_bits_of_a_whole_context_cache(name):
    """Only the addresses wrap: every token gets the same bits over a ring as over a cache holding
    every position, in a float and a block type."""
    ring, whole = ring_cache(name=name), ring_cache(160, name)
    assert torch.equal(torch.cat(feed(c_attention, ring)), torch.cat(feed(c_attention, whole)))


def test_the_reference_over_a_wrapping_ring_matches_itself_over_the_whole_context():
    ours = feed(reference_attention, ring_cache())
    theirs = feed(reference_attention, ring_cache(160))
    torch.testing.assert_close(torch.cat(ours), torch.cat(theirs), rtol=1e-6, atol=1e-6)


def test_a_tree_past_the_rings_end_gets_the_bits_of_its_path_decoded_alone():
    """A tree from position 90 (slot 42 of 48): its nodes wrap around to slot 0."""
    start, depths = 90, np.array([0, 1, 2, 3, 1, 2, 2, 3, 2])
    parents = np.array(TREE_PARENTS, np.int32)
    qkv, (cos, sin) = random_qkv(start + len(parents), head_dim=HEAD_DIM), rope_rows(start + 4, 0, HEAD_DIM)
    tree_cos, tree_sin = cos[start + depths], sin[start + depths]
    cache = ring_cache()
    for a, b in pass_bounds(start):
        c_attention(qkv[a:b], cache, cos[a:b], sin[a:b], a)
    tree = c_attention(qkv[start:], cache, tree_cos, tree_sin, start, parents, start)
    for node in range(len(parents)):
        rows = [start + i for i in path_to(node)]
        alone = ring_cache()
        for a, b in pass_bounds(start):
            c_attention(qkv[a:b], alone, cos[a:b], sin[a:b], a)
        at = slice(start, start + len(rows))
        path = c_attention(qkv[rows], alone, cos[at], sin[at], start)
        assert torch.equal(tree[node], path[-1]), f"node {node}"


def poisoned(cache: tuple[torch.Tensor, torch.Tensor], slots) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of the cache whose rows in the slots are NaN (float types)."""
    keys, values = (t.clone() for t in cache)
    for slot in slots:
        keys[:, slot // 16, :, slot % 16] = float("nan")
        values[:, slot] = float("nan")
    return keys, values


@pytest.mark.parametrize("kernel", ["c", "reference"])
def test_no_position_before_held_from_is_read(kernel):
    """After 100 positions (the ring holds 52 .. 99), held_from 96: the four slots of 92 .. 95,
    inside the window of the tokens at 100 .. 102, are poisoned; the output does not change."""
    qkv, (cos, sin) = random_qkv(103, head_dim=HEAD_DIM), rope_rows(103, 0, HEAD_DIM)
    cache = ring_cache()
    for a, b in pass_bounds(100):
        c_attention(qkv[a:b], cache, cos[a:b], sin[a:b], a)
    run = c_attention if kernel == "c" else (
        lambda q, c, co, si, s, held_from: attention_reference(q.clone(), *c, co, si, HEADS, s, True,
                                                               window=WINDOW, held_from=held_from))
    outputs = [run(qkv[100:], c, cos[100:], sin[100:], 100, held_from=96)
               for c in (poisoned(cache, []), poisoned(cache, [p % RING for p in range(92, 96)]))]
    assert torch.equal(*outputs) and not outputs[0].isnan().any()
    assert not torch.equal(outputs[0], run(qkv[100:], poisoned(cache, []), cos[100:], sin[100:], 100,
                                           held_from=0))


def test_the_c_kernel_refuses_a_pass_longer_than_its_ring():
    qkv, (cos, sin) = random_qkv(40, head_dim=HEAD_DIM), rope_rows(40, 60, HEAD_DIM)
    with pytest.raises(ValueError, match="do not fit in the cache's ring"):
        c_attention(qkv, ring_cache(), cos, sin, 60)  # 40 tokens and a window of 10 in 48 slots


def test_the_c_kernel_refuses_held_from_after_the_pass():
    qkv, (cos, sin) = random_qkv(2, head_dim=HEAD_DIM), rope_rows(2, 60, HEAD_DIM)
    with pytest.raises(ValueError, match="held_from must be"):
        c_attention(qkv, ring_cache(), cos, sin, 60, held_from=61)


@pytest.fixture(scope="module")
def triton_attention():
    """The Triton launcher, in Triton's interpreter without CUDA."""
    load_gpu_kernels_or_skip()
    from tierflow.gpu_kernels.attention import attention as launch

    return launch


@pytest.mark.slow
@pytest.mark.parametrize("splits", [1, 3])
def test_the_triton_kernel_over_a_wrapping_ring_matches_the_reference(triton_attention, splits):
    """Positions 0 .. 89 are written by the reference; the Triton kernel then takes passes that
    wrap past the ring's end (slots 42 .. 47, then 0 ..), with and without splits."""
    qkv, (cos, sin) = random_qkv(100, head_dim=HEAD_DIM), rope_rows(100, 0, HEAD_DIM)
    ring, whole = ring_cache(), ring_cache(112)
    for a, b in pass_bounds(90):
        for cache in (ring, whole):
            attention_reference(qkv[a:b].clone(), *cache, cos[a:b], sin[a:b], HEADS, a, True, window=WINDOW)
    for a, b in [(90, 94), (94, 95), (95, 100)]:
        ours = triton_attention(qkv[a:b].contiguous(), *ring, cos[a:b].contiguous(), sin[a:b].contiguous(),
                                HEADS, a, True, num_splits=splits, window=WINDOW, held_from=a - 8)
        theirs = attention_reference(qkv[a:b].clone(), *whole, cos[a:b], sin[a:b], HEADS, a, True,
                                     window=WINDOW, held_from=a - 8)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_triton_kernel_refuses_a_pass_longer_than_its_ring(triton_attention):
    qkv, (cos, sin) = random_qkv(40, head_dim=HEAD_DIM), rope_rows(40, 60, HEAD_DIM)
    with pytest.raises(ValueError, match="do not fit in the cache"):
        triton_attention(qkv, *ring_cache(), cos, sin, HEADS, 60, True, window=WINDOW)


# --- the model: a generated Gemma 3, five local layers (window 32) and a global one ---------------

CONTEXT, MODEL_WINDOW = 2048, 32
MODEL_RING = ring_positions(MODEL_WINDOW)  # 560 positions: prompts of 600 and more wrap
SPEC = ModelSpec(arch="gemma3", num_layers=6, hidden_size=128, num_heads=4, num_kv_heads=2, head_size=32,
                 ffn_size=256, context_length=CONTEXT, sliding_window=MODEL_WINDOW, weight_type="F32",
                 embedding_type="F32")
OTHER_TEXT = " Every summer the town holds a regatta on the canal"


@pytest.fixture(scope="module")
def ring_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("ring") / "gemma3.gguf", SPEC)


@pytest.fixture(scope="module")
def ring_engine(ring_model):
    """F32 weights: llama.cpp's exact oracle."""
    with Engine.load(ring_model, threads=2, context_length=CONTEXT, kv_cache_type="f32") as engine:
        yield engine


@pytest.fixture(scope="module")
def q8_engine(tmp_path_factory):
    """Q8_0 weights, which the C kernels multiply batch-invariantly (torch's F32 matmuls are not):
    the engine of the bit-for-bit tests."""
    path = write_model(tmp_path_factory.mktemp("ring-q8") / "gemma3.gguf",
                       replace(SPEC, weight_type="Q8_0", embedding_type="Q8_0"))
    with Engine.load(path, threads=2, context_length=CONTEXT, kv_cache_type="f32") as engine:
        yield engine


def text_ids(engine, count: int) -> list[int]:
    ids = engine.tokenize(LONG_TEXT * 30)
    assert len(ids) >= count
    return ids[:count]


def make_generator(engine, kv: str = "f32", rings: bool = True) -> TokenGenerator:
    """A generator over a fresh cache; without rings, over one built as for the model without
    windows, whose every layer holds the whole context (the decoder still masks the windows)."""
    cache_config = engine.config if rings else replace(engine.config, layer_windows=())
    decoder = Decoder(engine.config, engine.arch.block, engine.weights, CONTEXT)
    return TokenGenerator(decoder, KVCache(cache_config, CONTEXT, kv_type=KV_TYPES[kv]))


def fresh_logits(engine, ids: list[int]) -> np.ndarray:
    return make_generator(engine).prefill(ids, NEVER, reuse_prefix=False)[0]


def test_windowed_layers_hold_a_ring_and_the_engine_holds_what_the_plan_counts(ring_engine):
    config, f32 = ring_engine.config, KV_TYPES["f32"]
    with ring_engine.exclusive() as generator:
        capacities = [values.shape[1] for values in generator.cache.values]
    assert capacities == [MODEL_RING] * 5 + [CONTEXT]
    row_bytes = 2 * config.num_kv_heads * f32.row_bytes(config.head_dim)  # a position's keys and values
    assert ring_engine.kv_cache_bytes == row_bytes * (5 * MODEL_RING + CONTEXT)
    assert ring_engine.plan.kv_bytes == kv_cache_bytes(config, CONTEXT, f32) == ring_engine.kv_cache_bytes


@pytest.mark.slow
def test_f32_rings_match_llama_cpp_exactly_on_prompts_longer_than_the_ring(ring_model, ring_engine):
    """700 positions (two prefill chunks; slots wrap from position 560), and a greedy decode of 48
    tokens after a prompt of about 600."""
    llama = llama_cpp_model(ring_model, n_ctx=CONTEXT, f32_kv=True)
    ids = text_ids(ring_engine, 700)
    assert_logits_agree(ring_engine, llama, ids, max_mean_diff=0.01, near_tie=EXACT_TIE)
    prompt = LONG_TEXT * 9
    assert len(ring_engine.tokenize(prompt)) > MODEL_RING
    assert_greedy_agrees(ring_engine, llama, prompt, near_tie=EXACT_TIE, max_tokens=48)
    llama.close()


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_a_token_gets_the_same_bits_alone_or_in_a_batch_after_the_ring_wrapped(q8_engine, kv):
    generator, ids = make_generator(q8_engine, kv), text_ids(q8_engine, 700)
    generator.prefill(ids[:600], NEVER, reuse_prefix=False)
    batch = generator.verify(ids[600:])
    generator.keep(600)
    alone = np.stack([generator.decode_step(token) for token in ids[600:]])
    assert np.array_equal(batch, alone)


def test_a_token_tree_after_the_ring_wrapped_gets_the_bits_of_decoding_each_path(q8_engine):
    generator = make_generator(q8_engine)
    generator.prefill(text_ids(q8_engine, 600), NEVER, reuse_prefix=False)
    tree_rows = generator.verify_tree(TREE_TOKENS, TREE_PARENTS)
    for node in range(len(TREE_TOKENS)):
        generator.keep(600)
        rows = generator.verify([TREE_TOKENS[i] for i in path_to(node)])
        assert np.array_equal(tree_rows[node], rows[-1]), f"node {node}"


def test_keeping_a_path_after_the_ring_wrapped_leaves_the_cache_of_decoding_it(q8_engine):
    generator, path = make_generator(q8_engine), path_to(7)
    prompt = text_ids(q8_engine, 600)
    generator.prefill(prompt, NEVER, reuse_prefix=False)
    generator.verify_tree(TREE_TOKENS, TREE_PARENTS)
    generator.keep_path(600, path)
    after_path = generator.verify([5, 6])
    expected = fresh_logits(q8_engine, prompt + [TREE_TOKENS[i] for i in path] + [5, 6])
    assert np.array_equal(after_path[-1], expected)


def test_a_recent_shared_prefix_is_reused_and_one_the_ring_lost_is_prefilled_again(q8_engine):
    """After 1000 positions the rings hold 440 .. 999: a prompt diverging at 900 reuses 900 tokens;
    one diverging at 300 (whose window the rings no longer hold) reuses none. Both give a fresh
    cache's logits."""
    generator, ids = make_generator(q8_engine), text_ids(q8_engine, 1000)
    other = q8_engine.tokenize(OTHER_TEXT, add_bos=False)
    for shared, expected_reuse in [(900, 900), (300, 0)]:
        generator.prefill(ids, NEVER)
        logits, reused = generator.prefill(ids[:shared] + other, NEVER)
        assert reused == expected_reuse
        assert np.array_equal(logits, fresh_logits(q8_engine, ids[:shared] + other))


def test_keeping_fewer_tokens_than_the_ring_can_go_back_to_prefills_them_again(q8_engine):
    generator, ids = make_generator(q8_engine), text_ids(q8_engine, 1000)
    generator.prefill(ids, NEVER, reuse_prefix=False)
    generator.keep(300)
    assert generator.cached_tokens == ids[:300]
    assert np.array_equal(generator.decode_step(ids[300]), fresh_logits(q8_engine, ids[:301]))


def test_a_shift_before_the_ring_wraps_gives_the_bits_of_whole_context_caches(q8_engine):
    """The kept positions are still in the rings (400 < 560 written). Oracle: the same decoder over
    caches that hold every position in every layer (make_generator without rings): the same
    shift and passes must give the same bits, as nothing they attend to has left a ring. The
    700 positions fed after the shift wrap the rings."""
    ids, outputs = text_ids(q8_engine, 1100), []
    for rings in (True, False):
        generator = make_generator(q8_engine, rings=rings)
        generator.prefill(ids[:400], NEVER, reuse_prefix=False)
        generator.shift(8, 150)
        logits, reused = generator.prefill(generator.cached_tokens + ids[400:1100], NEVER, shifted=True)
        assert reused == 250
        outputs.append(np.stack([logits, *(generator.decode_step(token) for token in ids[1000:1003])]))
    assert np.array_equal(*outputs)


def test_a_shift_whose_moves_wrap_around_the_ring_gives_the_bits_of_whole_context_caches(q8_engine,
                                                                                           monkeypatch):
    """After 700 positions the rings hold 140 .. 699 in slots that wrap; dropping the first 200
    moves 200 .. 699 to 0 .. 499, 64 at a time, some onto slots that later moves read from. The
    oracle: as above, caches holding every position."""
    monkeypatch.setattr(attention_rows, "SHIFT_CHUNK", 64)
    ids, outputs = text_ids(q8_engine, 704), []
    for rings in (True, False):
        generator = make_generator(q8_engine, rings=rings)
        generator.prefill(ids[:700], NEVER, reuse_prefix=False)
        generator.shift(0, 200)
        outputs.append(np.stack([generator.decode_step(token) for token in ids[700:]]))
    assert np.array_equal(*outputs)


def poison_what_is_not_held(cache: KVCache) -> None:
    """NaN in every slot of every layer that holds none of the positions it holds (held_from ..
    length - 1): what a kernel reading a stale slot would spread."""
    for layer, capacity in enumerate(cache.capacities):
        stale = np.setdiff1d(np.arange(capacity), np.arange(cache.held_from[layer], cache.length) % capacity)
        cache.keys[layer][:, stale // 16, :, stale % 16] = np.nan
        cache.values[layer][:, stale] = np.nan


def test_kept_positions_a_ring_had_overwritten_are_not_attended_after_a_shift(q8_engine):
    """After 700 positions the rings no longer hold 0 .. 139. Keeping 4 and dropping 680 moves
    684 .. 699 to 4 .. 19: the windowed layers hold 4 .. 19 (held_from 4), and the tokens after
    them, whose windows reach back to 0, give the same bits whatever the stale slots hold."""
    ids, outputs = text_ids(q8_engine, 703), []
    for poison in (False, True):
        generator = make_generator(q8_engine)
        generator.prefill(ids[:700], NEVER, reuse_prefix=False)
        generator.shift(4, 680)
        assert generator.cache.held_from == [4] * 5 + [0]
        if poison:
            poison_what_is_not_held(generator.cache)
        outputs.append(np.stack([generator.decode_step(token) for token in ids[700:]]))
    assert np.isfinite(outputs[0]).all() and np.array_equal(*outputs)


def test_a_pass_longer_than_a_ring_takes_is_refused_before_anything_is_written(q8_engine):
    generator, ids = make_generator(q8_engine), text_ids(q8_engine, 101 + MAX_PASS_TOKENS + 32)
    generator.prefill(ids[:100], NEVER, reuse_prefix=False)
    with pytest.raises(InvalidArgumentError, match="a ring of its window of 32 and a pass of at most 512"):
        generator.verify(ids[100:100 + MAX_PASS_TOKENS + 32])
    assert generator.cache.length == 100
    assert np.array_equal(generator.decode_step(ids[100]), fresh_logits(q8_engine, ids[:101]))
