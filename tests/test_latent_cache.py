"""deepseek2's latent cache in llama.cpp's quantized types (q8_0, q4_0): the rows stored
Walsh-Hadamard rotated, the logits' drift from the f32 cache against llama.cpp's, agreement with
llama.cpp's q8_0 cache, the cache's size, and a context shift. The f32/f16 latent cache and the
family itself: test_deepseek2.py.

The generated model's latent rows are shaped as DeepSeek-V2's: a rotary part of 64 and a latent of
128 (V2: 64 and 512), which a quantized cache rotates in blocks of 64, the size llama.cpp's cache
takes for them (attn_rot_k; its deepseek2 graph in llama-cpp-python 0.3.36 stores them unrotated,
though: the same logits with LLAMA_ATTN_ROT_DISABLE=1).
"""

import contextlib

import numpy as np
import pytest
import torch

from tests.support.kv_shift import NEVER, text_ids
from tests.support.make_model import ModelSpec, write_model
from tests.support.oracle import (
    LONG_TEXT,
    assert_moe_agrees_but_where_routing_is_a_near_tie,
    llama_cpp_logits,
    llama_cpp_model,
)
from tierflow import Engine
from tierflow.cpu_kernels.hadamard import cache_rotation_sizes, hadamard
from tierflow.cpu_kernels.kv_layout import encode, read_rows
from tierflow.kv_types import KV_TYPES, CacheRows

LATENT, ROPE = 128, 64
DEEPSEEK = dict(arch="deepseek2", hidden_size=64, num_heads=4, head_size=32 + ROPE, num_experts=4,
                experts_used=2, expert_ffn_size=32, kv_lora_rank=LATENT, rope_dim=ROPE, context_length=512,
                weight_type="F32", embedding_type="F32")
CONTEXT, TOKENS = 256, 160
QUANTIZED = ["q8_0", "q4_0"]
KEEP, DROP = 10, 30  # the context shift's
FOLLOWING = " Every summer the town holds a regatta"  # what is fed after it


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two layers, and one: a one-layer model's cached rows depend only on their token and position,
    so a context shift there must leave what a fresh prefill of the kept tokens would."""
    folder = tmp_path_factory.mktemp("latent-cache")
    return {layers: write_model(folder / f"{layers}.gguf", ModelSpec(**DEEPSEEK, num_layers=layers,
                                                                     seed=layers)) for layers in (1, 2)}


@pytest.fixture(scope="module")
def engines(models):
    """The two-layer model with its cache in each type."""
    with contextlib.ExitStack() as stack:
        yield {kv: stack.enter_context(Engine.load(models[2], threads=2, context_length=CONTEXT,
                                                   kv_cache_type=kv)) for kv in ["f32", *QUANTIZED]}


@pytest.fixture(scope="module")
def llamas(models):
    """llama.cpp on it with its cache in each type (flash attention on all, as a quantized cache
    needs it there)."""
    from llama_cpp import GGML_TYPE_F32, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0

    types = {"f32": GGML_TYPE_F32, "q8_0": GGML_TYPE_Q8_0, "q4_0": GGML_TYPE_Q4_0}
    llamas = {kv: llama_cpp_model(models[2], n_ctx=CONTEXT, cache_type=ggml_type)
              for kv, ggml_type in types.items()}
    yield llamas
    for llama in llamas.values():
        llama.close()


@pytest.fixture(scope="module")
def ids(engines) -> list[int]:
    return engines["f32"].tokenize(LONG_TEXT * 3)[:TOKENS]


@pytest.fixture(scope="module")
def logits(engines, llamas, ids) -> dict[str, dict[str, np.ndarray]]:
    """Ours and llama.cpp's logits of ids with the cache in each type."""
    return {"ours": {kv: engine.logits(ids) for kv, engine in engines.items()},
            "llama.cpp": {kv: llama_cpp_logits(llama, ids) for kv, llama in llamas.items()}}


def drift(logits: np.ndarray, exact: np.ndarray) -> float:
    """Mean absolute difference over the exact logits' standard deviation."""
    return float(np.abs(logits - exact).mean() / exact.std())


@pytest.mark.parametrize("rotary, latent, kv, size", [
    (64, 512, "q8_0", 64),  # DeepSeek-V2/V3, Kimi K2: llama.cpp's block too
    (64, 128, "q4_0", 64),
    (128, 256, "q8_0", 128),
    (64, 64, "q8_0", 64),   # llama.cpp: 128, a block straddling the rotary part and the latent
    (32, 96, "q8_0", 0),    # a part not a multiple of 64
    (64, 512, "f16", 0),
])
def test_latent_rows_are_rotated_in_the_largest_power_of_two_blocks_dividing_both_parts(rotary, latent, kv,
                                                                                       size):
    rows = CacheRows(1, rotary + latent, 0, latent=True, rotary_dim=rotary)
    assert cache_rotation_sizes(KV_TYPES[kv], rows) == (size, 0)


@pytest.mark.parametrize("kv", QUANTIZED)
def test_a_quantized_latent_cache_stores_the_rows_hadamard_rotated_in_its_type(engines, ids, kv):
    """The first layer's rows depend only on their token and position: the bytes a q8_0/q4_0 cache
    holds are those of the f32 cache's rows, rotated in blocks of 64, then encoded."""
    stored = {}
    for name in ("f32", kv):
        with engines[name].exclusive() as generator:
            generator.prefill(ids, NEVER, reuse_prefix=False)
            cache = generator.cache
            keys, values = (torch.as_tensor(layers[0]) for layers in (cache.keys, cache.values))
            stored[name] = read_rows(keys, values, torch.arange(len(ids)))[0]
    assert torch.equal(stored[kv], encode(hadamard(stored["f32"], 64), KV_TYPES[kv]))


@pytest.mark.slow
@pytest.mark.parametrize("kv", QUANTIZED)
def test_a_quantized_latent_cache_moves_the_logits_no_more_than_llama_cpps(logits, kv):
    """Each against its own f32 cache, whose rows llama.cpp stores unrotated (measured: q8_0
    0.0063 here, 0.0066 in llama.cpp; q4_0 0.088 and 0.097; without rotating the output back,
    0.68 for both)."""
    ours, theirs = (drift(logits[who][kv], logits[who]["f32"]) for who in ("ours", "llama.cpp"))
    print(f"latent cache {kv}: logits drift from f32 {ours:.4f} (llama.cpp {theirs:.4f})")
    assert ours <= 1.25 * theirs


def test_a_q8_0_latent_cache_agrees_with_llama_cpps_within_quantization_noise(engines, llamas, ids):
    """Two q8_0 caches, ours rotated and llama.cpp's not: their rounding differs, which flips a
    router's choice where two experts nearly tie, as llama.cpp's 8-bit activations do in a
    quantized MoE (tests/support/oracle.py). (Measured: a median of 0.056.)"""
    median = assert_moe_agrees_but_where_routing_is_a_near_tie(engines["q8_0"], llamas["q8_0"], ids)
    print(f"latent cache q8_0: median |logit difference| vs llama.cpp's q8_0 cache {median:.4f}")


def test_a_q8_0_latent_cache_holds_one_row_of_blocks_per_position_and_layer(engines):
    engine, row_bytes = engines["q8_0"], (ROPE + LATENT) // 32 * 34
    assert engine.kv_cache_bytes == engine.plan.kv_bytes == 2 * CONTEXT * row_bytes  # 2 layers


def continuation(path, kv: str, shifted: bool) -> np.ndarray:
    """The logits of FOLLOWING after the tokens kept when DROP of 120 are dropped: after a context
    shift of the cache holding the 120, or after a fresh prefill of those kept."""
    with Engine.load(path, threads=2, context_length=CONTEXT, kv_cache_type=kv) as engine:
        ids, following = text_ids(engine, 120), engine.tokenize(FOLLOWING, add_bos=False)
        kept = ids[:KEEP] + ids[KEEP + DROP:]
        with engine.exclusive() as generator:
            if shifted:
                generator.prefill(ids, NEVER, reuse_prefix=False)
                generator.shift(KEEP, DROP)
            logits, reused = generator.prefill(kept + following, NEVER, reuse_prefix=shifted, all_logits=True,
                                               shifted=shifted)
    assert reused == (len(kept) if shifted else 0)
    return logits[-len(following):]


@pytest.mark.slow
def test_a_context_shift_of_a_q8_0_latent_cache_continues_as_a_fresh_prefill_of_the_kept_tokens(models):
    """One layer: the moved rows are a fresh prefill's but for their rotary parts' second rounding
    (their latents move as stored), which moves the logits less than the q8_0 cache itself moves
    them from the f32 cache's (measured: 0.0011 and 0.0028; without turning the rotary parts,
    the shift moves them by 0.13). llama.cpp cannot be the oracle here: its context shift of a
    quantized MLA cache aborts (llama-cpp-python 0.3.36: "not implemented" in ggml's dup)."""
    shifted, fresh = (continuation(models[1], "q8_0", shifted) for shifted in (True, False))
    exact = continuation(models[1], "f32", shifted=False)
    shift_drift, cache_drift = drift(shifted, fresh), drift(fresh, exact)
    print(f"latent cache q8_0: a context shift moves the logits by {shift_drift:.4f}, "
          f"the type by {cache_drift:.4f}")
    assert shift_drift < cache_drift
