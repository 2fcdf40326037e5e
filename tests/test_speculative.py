"""Prompt-lookup speculation: guesses from the context, verified in one pass, the same output."""

import pytest

from tierflow import Engine
from tierflow.errors import InvalidArgumentError, TierflowError
from tierflow.runtime.sampling.sampler import Sampler, SamplingParams
from tierflow.speculative.drafts import NgramDraft
from tierflow.speculative.ngram import DraftLength, continuations, propose

REPETITIVE = "The capital of France is"  # the small model soon repeats itself
COUNTING = " ".join(["one two three four"] * 4)  # the model goes on counting, whatever the cache type
PROMPTS = [REPETITIVE, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "Name three colours."]


@pytest.fixture(scope="module")
def speculating(model_path):
    with Engine.load(model_path, threads=2, context_length=1024, draft="ngram",
                     draft_tokens=16) as engine:  # fixed: the guesses must not depend on timing
        yield engine


def test_propose_continues_the_latest_earlier_occurrence_of_the_last_tokens():
    assert propose([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]


def test_propose_prefers_the_longest_match_and_needs_at_least_two_tokens():
    assert propose([7, 2, 3, 8, 5, 3, 6, 2, 3], 1) == [8]  # [2, 3] beats [3]
    assert propose([1, 2, 3, 4, 3], 2) == []  # only [3] recurs
    assert propose([5], 4) == [] and propose([1, 2, 1, 2], 0) == []


def test_the_draft_length_grows_on_success_and_rests_after_misses():
    length = DraftLength(16)
    assert length.next() == 4
    length.update(4, 4)
    assert length.next() == 8
    length.update(8, 2)
    assert length.next() == 3
    length.update(3, 0)
    assert [length.next() for _ in range(3)] == [0, 0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_token_for_token_the_same(engine, speculating, prompt):
    plain = engine.generate(prompt, max_tokens=80, temperature=0)
    fast = speculating.generate(prompt, max_tokens=80, temperature=0)
    assert fast.tokens == plain.tokens and fast.finish_reason == plain.finish_reason


def test_repetitive_text_accepts_guesses_in_fewer_passes(speculating):
    result = speculating.generate(COUNTING, max_tokens=32, temperature=0)  # it counts for ~30 tokens
    stats = result.stats
    assert stats.decode_steps < stats.generated_tokens / 2
    # the prefill gives the first token, each pass one more and what it accepted; a pass that
    # sampled the end of text gave no token
    end_of_text = result.finish_reason == "stop"
    assert stats.decode_steps + stats.accepted_tokens == stats.generated_tokens - 1 + end_of_text


def test_max_tokens_and_stop_strings_hold_while_speculating(engine, speculating):
    assert len(speculating.generate(REPETITIVE, max_tokens=7, temperature=0).tokens) == 7
    plain = engine.generate(REPETITIVE, max_tokens=80, temperature=0, stop=["Paris"])
    fast = speculating.generate(REPETITIVE, max_tokens=80, temperature=0, stop=["Paris"])
    assert fast.text == plain.text


@pytest.mark.slow
def test_sampled_generations_speculate_and_stay_seeded(speculating):
    first = speculating.generate(REPETITIVE, max_tokens=48, temperature=0.8, seed=3)
    again = speculating.generate(REPETITIVE, max_tokens=48, temperature=0.8, seed=3)
    assert first.tokens == again.tokens and first.stats.drafted_tokens > 0


def test_a_missing_draft_file_is_a_clear_error(model_path):
    with pytest.raises(TierflowError, match="big-model.gguf"):
        Engine.load(model_path, draft="big-model.gguf")


def test_an_unknown_draft_shape_is_refused(model_path):
    with pytest.raises(InvalidArgumentError, match="draft_shape"):
        Engine.load(model_path, draft="ngram", draft_shape="bush")


def test_continuations_branch_over_different_earlier_occurrences():
    assert continuations([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 3, 4) == [[4, 5, 1], [9, 1, 2]]


def test_greedy_prompt_lookup_proposes_a_tree_of_the_branches():
    tree = NgramDraft(vocab_size=16, max_draft=16).propose([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 16,
                                                            Sampler(SamplingParams(temperature=0)))
    # the first draft length is 4: two branches of four guesses
    assert tree.tokens == [3, 4, 5, 1, 2, 9, 1, 2, 3] and tree.parents == [-1, 0, 1, 2, 3, 0, 5, 6, 7]
