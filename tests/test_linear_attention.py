"""Hybrid linear-attention models (qwen35, qwen35moe, qwen3next): Gated DeltaNet layers whose
recurrent state lives in the cache, against llama.cpp, and everything that goes back in a cache
(prefix reuse, rejected guesses, token trees, drafts, a context shift) going back in that state too,
there and in the state-space families' states (Mamba-2's, a Granite 4.0-H hybrid's and Jamba's
Mamba-1 layers beside attention and experts)."""

import dataclasses

import numpy as np
import pytest

from tests.support.budgets import ram_beside_weights
from tests.support.gguf_bytes import UINT32, Typed
from tests.support.gguf_writing import rewrite_metadata
from tests.support.make_model import ModelSpec, write_model
from tests.support.model_spec import family_spec
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    PROMPTS,
    assert_greedy_agrees,
    assert_logits_agree,
    llama_cpp_logits,
    llama_cpp_model,
    long_prompt,
)
from tierflow import Engine
from tierflow.errors import InvalidArgumentError, ModelFileError
from tierflow.kv_types import KV_TYPES
from tierflow.offload.plan.budgets import layer_kv_bytes
from tierflow.runtime.generation.context_shift import fit_chat
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.runtime.memory.recurrent_state import STEPWISE_TOKENS, recurrent_state_bytes

SHAPE = dict(num_layers=4, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2, head_size=32,
             rope_dim=16, context_length=2048)
MOE = dict(num_experts=4, experts_used=2, expert_ffn_size=64, shared_expert_ffn_size=96)
SPECS = {"qwen35": ModelSpec(arch="qwen35", **SHAPE),
         "qwen35moe": ModelSpec(arch="qwen35moe", **SHAPE, **MOE),
         "qwen3next": ModelSpec(arch="qwen3next", **SHAPE, **MOE)}
F32 = dict(weight_type="F32", embedding_type="F32")


@pytest.fixture(scope="module", params=SPECS)
def f32_model(request, tmp_path_factory):
    spec = dataclasses.replace(SPECS[request.param], **F32)
    return write_model(tmp_path_factory.mktemp(request.param) / "model.gguf", spec)


@pytest.fixture(scope="module")
def quantized_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("qwen35q") / "model.gguf", SPECS["qwen35"])


QUANTIZED_4_LAYERS = dict(weight_type="Q8_0", embedding_type="Q8_0", context_length=2048, num_layers=4)
RECURRENT_SPECS = {"qwen35": SPECS["qwen35"],  # four layers each: streaming some needs a ring of two
                   **{name: dataclasses.replace(family_spec(name), **QUANTIZED_4_LAYERS)
                      for name in ("mamba2", "granitehybrid", "jamba")}}


SLOW_SPECS = ("granitehybrid", "jamba")  # as Mamba-2's, with more layers of more kinds: in the slow run


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.slow if name in SLOW_SPECS else ()) for name in RECURRENT_SPECS])
def recurrent_model(request, tmp_path_factory):
    """A quantized model of each family whose layers keep a recurrent state."""
    return write_model(tmp_path_factory.mktemp(request.param) / "model.gguf", RECURRENT_SPECS[request.param])


@pytest.fixture(scope="module", params=[name for name, spec in RECURRENT_SPECS.items()
                                        if not spec.num_experts])
def dense_recurrent_model(request, tmp_path_factory):
    """As recurrent_model, of the dense families: a MoE model streams its experts, not its layers
    (Jamba's: tests/test_jamba.py)."""
    return write_model(tmp_path_factory.mktemp(request.param) / "model.gguf", RECURRENT_SPECS[request.param])


def test_f32_logits_match_llama_cpp_exactly(f32_model):
    llama = llama_cpp_model(f32_model, n_ctx=256, f32_kv=True)
    with Engine.load(f32_model, threads=2, context_length=256, kv_cache_type="f32") as engine:
        ids = engine.tokenize(LONG_TEXT)[:200]  # one pass: chunked but for its last token
        assert_logits_agree(engine, llama, ids, max_mean_diff=0.01, near_tie=EXACT_TIE)
        assert_greedy_agrees(engine, llama, PROMPTS[0], near_tie=EXACT_TIE, max_tokens=24)


@pytest.mark.slow
def test_greedy_output_through_prefix_reuse_and_a_draft_is_llama_cpps(f32_model):
    llama = llama_cpp_model(f32_model, n_ctx=256, f32_kv=True)
    for draft in (None, "ngram"):
        with Engine.load(f32_model, threads=2, context_length=256, kv_cache_type="f32",
                         draft=draft) as engine:
            first = engine.generate(PROMPTS[0], max_tokens=16, temperature=0)
            follow_up = PROMPTS[0] + first.text + " " + PROMPTS[0]  # its prefix reused, then looked up
            assert_greedy_agrees(engine, llama, follow_up, near_tie=EXACT_TIE, max_tokens=24)


@pytest.mark.slow
def test_a_prompt_longer_than_a_prefill_chunk_matches_llama_cpp(f32_model):
    llama = llama_cpp_model(f32_model, n_ctx=1024, f32_kv=True)
    with Engine.load(f32_model, threads=2, context_length=1024, kv_cache_type="f32") as engine:
        ids = engine.tokenize(long_prompt(60))[:700]
        assert len(ids) == 700  # two prefill chunks, the state carried from the first to the second
        last = engine.generate(ids, max_tokens=1, temperature=0, logprobs=True)
        theirs = llama_cpp_logits(llama, ids)[-1]
        assert last.tokens[0] == int(theirs.argmax())
    ours = engine_logits_of_last(f32_model, ids)
    assert np.abs(ours - theirs).mean() < 0.01


def engine_logits_of_last(path, ids) -> np.ndarray:
    with Engine.load(path, threads=2, context_length=1024, kv_cache_type="f32") as engine:
        return engine.logits(ids)[-1]


def test_quantized_logits_match_llama_cpp_within_its_rounding(quantized_model):
    llama = llama_cpp_model(quantized_model, n_ctx=256)
    with Engine.load(quantized_model, threads=2, context_length=256, kv_cache_type="f32") as engine:
        assert_logits_agree(engine, llama, engine.tokenize(LONG_TEXT)[:64], max_mean_diff=0.25, near_tie=1.0)


def test_a_regenerated_prompt_reuses_all_but_its_last_token_and_gives_the_same_tokens(recurrent_model):
    with Engine.load(recurrent_model, threads=2, context_length=1024) as engine:
        for prompt in (PROMPTS[0], long_prompt(12)):  # prefilled token by token, and chunked
            first = engine.generate(prompt, max_tokens=16, temperature=0)
            again = engine.generate(prompt, max_tokens=16, temperature=0)
            assert again.stats.cached_prompt_tokens == first.stats.prompt_tokens - 1
            assert again.tokens == first.tokens


def test_a_continued_conversation_gives_a_fresh_engines_tokens(recurrent_model):
    with Engine.load(recurrent_model, threads=2, context_length=1024) as engine:
        first = engine.generate(PROMPTS[0], max_tokens=16, temperature=0)
        follow_up = PROMPTS[0] + first.text + " Then the"
        continued = engine.generate(follow_up, max_tokens=16, temperature=0)
        assert continued.stats.cached_prompt_tokens > 0
    with Engine.load(recurrent_model, threads=2, context_length=1024) as engine:
        assert engine.generate(follow_up, max_tokens=16, temperature=0).tokens == continued.tokens


def test_a_conversation_that_outgrows_the_context_prefills_its_kept_turns_again(recurrent_model):
    """A recurrent state cannot drop tokens from its middle: the shifted turn is computed afresh."""
    questions = [f"Question {i}: name a colour and a tree." for i in range(8)]
    with Engine.load(recurrent_model, threads=2, context_length=128) as engine:
        messages, turns = [], []
        for question in questions:
            fitted = fit_chat(messages + [{"role": "user", "content": question}], engine.tokenize_chat,
                              engine.context_length, max_tokens=24)
            result = engine.generate(fitted.prompt_ids, max_tokens=24, temperature=0, context_shift=True)
            messages = fitted.messages + [{"role": "assistant", "content": result.text}]
            turns.append((fitted, result))
    fitted, result = next((fitted, result) for fitted, result in reversed(turns) if fitted.dropped)
    with Engine.load(recurrent_model, threads=2, context_length=128) as engine:
        assert engine.generate(fitted.prompt_ids, max_tokens=24, temperature=0).tokens == result.tokens


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculative_greedy_output_is_the_targets_own(recurrent_model, draft):
    with Engine.load(recurrent_model, threads=2, context_length=1024) as engine:
        first = engine.generate(PROMPTS[0], max_tokens=24, temperature=0).text
        prompts = [PROMPTS[0] + first + " " + PROMPTS[0], PROMPTS[1]]  # something to look up
        plain = [engine.generate(p, max_tokens=48, temperature=0).tokens for p in prompts]
    with Engine.load(recurrent_model, threads=2, context_length=1024,
                     draft=recurrent_model if draft == "model" else draft) as engine:
        results = [engine.generate(p, max_tokens=48, temperature=0) for p in prompts]
    assert [r.tokens for r in results] == plain
    if draft == "model":  # a random model seldom repeats itself: prompt lookup may find nothing to guess
        assert sum(r.stats.accepted_tokens for r in results) > 0


def test_streamed_layers_and_layers_on_the_stand_in_gpu_give_the_resident_tokens(dense_recurrent_model):
    with Engine.load(dense_recurrent_model, threads=2, context_length=256) as engine:
        resident = engine.generate(PROMPTS[0], max_tokens=24, temperature=0).tokens
        packed = engine.weights.packed
        weights = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
        half_a_layer = max(layer.nbytes for layer in packed.layers) // 2
    streaming = dict(cpu_memory=weights - half_a_layer + ram_beside_weights(dense_recurrent_model, 256))
    on_gpu = dict(gpu_memory="4MiB", gpu_device="cpu")  # its states there too
    for budgets in (streaming, on_gpu):
        with Engine.load(dense_recurrent_model, threads=2, context_length=256, **budgets) as engine:
            assert engine.generate(PROMPTS[0], max_tokens=24, temperature=0).tokens == resident
            assert engine.weights.streamed_layers if budgets is streaming else engine.plan.gpu_layers


def test_a_kept_tree_path_leaves_the_state_its_tokens_fed_one_by_one_leave(recurrent_model):
    with Engine.load(recurrent_model, threads=2, context_length=256) as engine:
        generator = engine._generator
        ids = engine.tokenize(PROMPTS[2])
        generator.prefill(ids, _never())
        #       0 -> 1 -> 3
        #        \-> 2
        tree, parents = [11, 12, 13, 14], [-1, 0, 0, 1]
        start = generator.cache.length
        generator.verify_tree(tree, parents)
        generator.keep_path(start, [0, 1, 3])
        after_tree = generator.decode_step(99)
        generator.prefill(ids, _never(), reuse_prefix=False)
        for token in (11, 12, 14):
            generator.decode_step(token)
        assert np.array_equal(after_tree, generator.decode_step(99))


def test_rejected_guesses_are_forgotten_by_the_state(recurrent_model):
    with Engine.load(recurrent_model, threads=2, context_length=256) as engine:
        generator = engine._generator
        ids = engine.tokenize(PROMPTS[2])
        generator.prefill(ids, _never())
        start = generator.cache.length
        generator.verify([5, 6, 7, 8])
        generator.keep(start + 2)
        kept = generator.decode_step(9)
        generator.prefill(ids, _never(), reuse_prefix=False)
        generator.decode_step(5)
        generator.decode_step(6)
        assert np.array_equal(kept, generator.decode_step(9))


def test_the_state_goes_back_only_to_what_it_kept(recurrent_model):
    with Engine.load(recurrent_model, threads=2, context_length=1024) as engine:
        cache: KVCache = engine._generator.cache
        ids = engine.tokenize(long_prompt(12))
        assert len(ids) > STEPWISE_TOKENS + 10
        engine._generator.prefill(ids, _never())
        assert cache.reachable(len(ids) - 1) == len(ids) - 1  # the prompt's last token is recorded
        assert cache.reachable(len(ids) - 5) == 0  # inside a chunked pass: from the start again
        with pytest.raises(InvalidArgumentError, match="recurrent state cannot go back to 10"):
            cache.truncate(10)
        with pytest.raises(InvalidArgumentError, match="recurrent state"):
            cache.shift(2, 4, [], neox=True)


def test_the_state_is_counted_in_the_budget_whatever_the_context(quantized_model):
    with Engine.load(quantized_model, threads=2, context_length=256) as engine:
        config = engine.config
    recurrent = [i for i in range(config.num_layers) if config.is_recurrent(i)]
    assert recurrent == [0, 1, 2]
    kv = KV_TYPES["f16"]
    for context in (256, 1024):
        assert layer_kv_bytes(config, 0, context, kv) == recurrent_state_bytes(config.recurrent)
    assert layer_kv_bytes(config, 3, 1024, kv) > layer_kv_bytes(config, 3, 256, kv)  # full attention


def test_the_cache_counts_the_states_it_holds_within_the_budgets_promise(recurrent_model):
    with Engine.load(recurrent_model, threads=2, context_length=256) as engine:
        empty = engine.kv_cache_bytes
        engine.generate(long_prompt(6), max_tokens=8, temperature=0)
        held = engine.kv_cache_bytes - empty
        config = engine.config
    most = sum(layer_kv_bytes(config, i, 256, KV_TYPES["f16"]) for i in range(config.num_layers)
               if config.is_recurrent(i))
    assert 0 < held <= most


@pytest.mark.parametrize("key, value, refusal", [
    ("ssm.conv_kernel", 3, r"'blk.0.ssm_conv1d.weight' has shape \[4, 128\], the metadata implies "
                           r"\[3, 128\]"),
    ("full_attention_interval", 2, r"missing tensor 'blk.1.attn_q.weight'.*layer 1 is full attention by "
                                   r"the metadata, whose full_attention_interval is 2"),
    ("rope.dimension_sections", 8, r"'qwen35.rope.dimension_sections' must be an array of 4 counts"),
])
def test_tensors_the_metadata_does_not_explain_are_refused_naming_both(quantized_model, tmp_path, key,
                                                                      value, refusal):
    broken = rewrite_metadata(quantized_model, tmp_path / "broken.gguf",
                              {f"qwen35.{key}": Typed(UINT32, value)})
    with pytest.raises(ModelFileError, match=refusal):
        Engine.load(broken, threads=2, context_length=256)


def _never():
    import threading

    return threading.Event()
