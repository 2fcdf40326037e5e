"""A draft model beside the target: its tree verified in one pass, the target's output kept."""

from types import SimpleNamespace

import pytest

from tests.support.budgets import ram_beside_weights
from tierflow import Engine
from tierflow.errors import BudgetError, InvalidArgumentError
from tierflow.offload.gguf.convert import convert_model
from tierflow.speculative.draft_loader import _check_vocabulary

PROMPTS = ["The sky is blue because", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
           "Name three colours."]
# The budgets below are for this context: at 256 positions the bundled model needs 45.5 MiB
# (embeddings, two streaming slots, KV cache and activations), the 3-bit draft 79.6 MiB and
# with its cache and activations 92.1 MiB.
CONTEXT = 256


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    """The bundled model at 3 bits: a real draft that agrees with it about half the time."""
    return convert_model(None, tmp_path_factory.mktemp("draft") / "smollm2-3bit.gguf", 3, "rtn").path


@pytest.fixture(scope="module", params=["tree", "chain"])
def drafting(request, model_path, draft_path):
    with Engine.load(model_path, threads=2, context_length=512, draft=draft_path,
                     draft_shape=request.param, draft_tokens=6) as engine:
        yield engine


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_the_targets_token_for_token(engine, drafting, prompt):
    plain = engine.generate(prompt, max_tokens=48, temperature=0)
    fast = drafting.generate(prompt, max_tokens=48, temperature=0)
    assert fast.tokens == plain.tokens and fast.finish_reason == plain.finish_reason


def test_the_stats_count_guesses_passes_and_time(drafting):
    stats = drafting.generate(PROMPTS[0], max_tokens=32, temperature=0).stats  # ends by the limit, not EOS
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    assert stats.decode_steps + stats.accepted_tokens == stats.generated_tokens - 1
    assert stats.tokens_per_pass == pytest.approx((stats.generated_tokens - 1) / stats.decode_steps)
    assert 0 < stats.draft_seconds + stats.verify_seconds <= stats.decode_seconds
    assert {"draft_seconds", "verify_seconds", "tokens_per_pass"} <= stats.as_dict().keys()


@pytest.mark.slow
def test_seeded_sampling_with_a_draft_repeats_itself(drafting):
    first = drafting.generate(PROMPTS[2], max_tokens=32, temperature=0.8, seed=7)
    again = drafting.generate(PROMPTS[2], max_tokens=32, temperature=0.8, seed=7)
    assert first.tokens == again.tokens and first.stats.drafted_tokens > 0


def test_cancel_and_max_tokens_hold_with_a_draft(drafting):
    assert len(drafting.generate(PROMPTS[0], max_tokens=5, temperature=0).tokens) == 5
    stream = drafting.stream(PROMPTS[0], max_tokens=200, temperature=0)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        if len(pieces) == 3:
            stream.cancel()
    assert stream.result.finish_reason == "cancelled" and len(stream.result.tokens) < 200


@pytest.mark.slow
def test_the_draft_is_placed_first_within_the_cpu_budget(model_path, draft_path):
    with Engine.load(model_path, threads=2, draft=draft_path, context_length=CONTEXT) as alone:
        draft_bytes = alone.draft.bytes_by_tier()["cpu"]  # its weights and KV cache
        target_bytes = alone.weights.bytes_by_tier()["cpu"]
    budget = draft_bytes + target_bytes // 2 + ram_beside_weights(model_path, CONTEXT)
    with Engine.load(model_path, threads=2, draft=draft_path, cpu_memory=budget, draft_tokens=4,
                     context_length=CONTEXT) as engine:
        held = engine.draft.bytes_by_tier()["cpu"] + engine.plan.used_bytes["cpu"]
        assert held + engine.plan.activation_bytes <= budget and engine.weights.streamed_layers
        fast = engine.generate(PROMPTS[0], max_tokens=16, temperature=0)
        assert fast.stats.accepted_tokens > 0


@pytest.mark.slow
def test_a_streamed_target_gives_its_own_tokens_with_a_draft(engine, model_path, draft_path):
    plain = engine.generate(PROMPTS[1], max_tokens=24, temperature=0)
    with Engine.load(model_path, threads=2, draft=draft_path, cpu_memory="150MiB", context_length=CONTEXT,
                     draft_tokens=8) as streamed:
        assert streamed.weights.streamed_layers
        assert streamed.generate(PROMPTS[1], max_tokens=24, temperature=0).tokens == plain.tokens


def test_the_draft_goes_to_the_gpu_tier_first(model_path, draft_path):
    """With the CPU standing in for a GPU: the draft's layers and KV cache take the GPU budget
    before the target."""
    with Engine.load(model_path, threads=2, draft=draft_path, gpu_memory="80MiB", gpu_device="cpu",
                     context_length=256) as engine:
        draft_gpu, target_gpu = engine.draft.bytes_by_tier()["gpu"], engine.weights.bytes_by_tier()["gpu"]
        assert draft_gpu > 0 and draft_gpu + target_gpu <= 80 * 2**20
        assert engine.generate(PROMPTS[0], max_tokens=8, temperature=0).tokens


def test_a_budget_too_small_for_the_draft_names_it(model_path, draft_path):
    with pytest.raises(BudgetError, match="draft"):
        Engine.load(model_path, draft=draft_path, cpu_memory="60MiB", context_length=CONTEXT)


def test_a_budget_the_draft_leaves_too_small_for_the_target_says_so(model_path, draft_path):
    with pytest.raises(BudgetError, match="after the draft model"):
        Engine.load(model_path, draft=draft_path, cpu_memory="100MiB", context_length=CONTEXT)


def test_a_draft_with_another_vocabulary_is_refused():
    def gguf(tokens):
        return SimpleNamespace(metadata={"tokenizer.ggml.tokens": tokens},
                               path=SimpleNamespace(name="d.gguf"))

    with pytest.raises(InvalidArgumentError, match="vocabulary of 2 tokens"):
        _check_vocabulary(gguf(["a", "b"]), gguf(["a", "b", "c"]))
    with pytest.raises(InvalidArgumentError, match="token 1 is 'x'"):
        _check_vocabulary(gguf(["a", "x"]), gguf(["a", "b"]))


def test_the_draft_cache_follows_the_accepted_path(drafting):
    drafting.generate(PROMPTS[0], max_tokens=24, temperature=0)
    target, draft = drafting._generator, drafting.speculator.draft.generator
    assert draft.cached_tokens == target.cached_tokens[: len(draft.cached_tokens)]


def test_draft_tokens_outside_one_to_64_are_refused(model_path):
    with pytest.raises(InvalidArgumentError, match="draft_tokens"):
        Engine.load(model_path, draft="ngram", draft_tokens=0)
