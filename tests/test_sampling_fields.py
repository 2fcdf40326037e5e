"""logit_bias, OpenAI's frequency and presence penalties, and logprobs/top_logprobs: in the Sampler
and through the Engine on the bundled model, checked against the model's own logits."""

import numpy as np
import pytest

from tierflow import Engine
from tierflow.errors import InvalidArgumentError
from tierflow.runtime.sampling.processors import log_softmax
from tierflow.runtime.sampling.sampler import Sampler, SamplingParams

PROMPT = "The capital of France is"
COUNTING = " ".join(["one two three four"] * 4)  # prompt lookup's guesses are accepted here
LOGITS = np.array([1.0, 3.0, 2.0, 0.5, -1.0], dtype=np.float32)


@pytest.fixture(scope="module")
def speculating(model_path):
    with Engine.load(model_path, threads=2, context_length=1024, draft="ngram", draft_tokens=16) as engine:
        yield engine


def model_logprobs(engine: Engine, prompt_ids: list[int], tokens: list[int]) -> np.ndarray:
    """log-softmax of the model's logits [len(tokens), V] at the positions that picked tokens."""
    logits = engine.logits(prompt_ids + tokens[:-1])[len(prompt_ids) - 1:]
    return np.stack([log_softmax(row.astype(np.float64)) for row in logits])


def chosen_logprobs(result) -> list[float]:
    return [entry.logprob for entry in result.logprobs]


def recorded(params: SamplingParams, history: list[int], num_prompt_tokens: int) -> np.ndarray:
    sampler = Sampler(params, num_prompt_tokens)
    sampler.sample(LOGITS, history)
    return sampler.take_logprobs(len(history))


# -- the Sampler --------------------------------------------------------------------------------

def test_frequency_and_presence_penalties_follow_openais_formula():
    params = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=True)
    # generated so far: token 1 twice, token 2 once
    expected = LOGITS - np.array([0, 2 * 0.5 + 0.25, 0.5 + 0.25, 0, 0])
    assert np.allclose(recorded(params, [1, 1, 2], 0), log_softmax(expected.astype(np.float64)))


def test_penalties_count_only_generated_tokens():
    params = SamplingParams(temperature=0, frequency_penalty=2, presence_penalty=2, logprobs=True)
    assert np.allclose(recorded(params, [1, 1, 2], 3), log_softmax(LOGITS.astype(np.float64)))


def test_frequency_penalty_turns_greedy_away_from_a_repeated_token():
    sampler = Sampler(SamplingParams(temperature=0, frequency_penalty=0.6), num_prompt_tokens=1)
    assert sampler.sample(LOGITS, [1, 1]) == 1  # one generated: 3 - 0.6 still beats 2
    assert sampler.sample(LOGITS, [1, 1, 1]) == 2  # two: 3 - 1.2 does not


def test_logit_bias_is_added_to_the_logits():
    params = SamplingParams(temperature=0, logit_bias={4: 5.0, 1: -1.5}, logprobs=True)
    expected = LOGITS + np.array([0, -1.5, 0, 0, 5.0])
    assert np.allclose(recorded(params, [], 0), log_softmax(expected.astype(np.float64)))


@pytest.mark.parametrize("setting, named", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": [5, 1]}, "logit_bias"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_setting_is_refused_by_name(setting, named):
    with pytest.raises(InvalidArgumentError, match=named):
        SamplingParams(**setting)


# -- through the Engine -------------------------------------------------------------------------

def test_logprobs_are_the_log_softmax_of_the_models_logits(engine):
    result = engine.generate(PROMPT, max_tokens=12, temperature=0, logprobs=True)
    expected = model_logprobs(engine, engine.tokenize(PROMPT), result.tokens)
    assert len(result.logprobs) == len(result.tokens)
    assert [entry.token for entry in result.logprobs] == result.tokens
    assert np.allclose(chosen_logprobs(result), expected[np.arange(len(result.tokens)), result.tokens],
                       atol=1e-5)


def test_top_logprobs_are_the_likeliest_tokens_most_likely_first(engine):
    result = engine.generate(PROMPT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    expected = model_logprobs(engine, engine.tokenize(PROMPT), result.tokens)
    for entry, row in zip(result.logprobs, expected):
        top = [alternative.logprob for alternative in entry.top]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert np.allclose(top, np.sort(row)[::-1][:5], atol=1e-5)
        assert entry.top[0].token == entry.token  # greedy picks the likeliest
        assert np.exp(top).sum() <= 1 + 1e-9


def test_top_logprobs_carry_each_tokens_bytes(engine):
    result = engine.generate(PROMPT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    for entry in result.logprobs:
        for item in (entry, *entry.top):
            assert item.bytes == engine.tokenizer.token_bytes(item.token)


def test_logprobs_do_not_depend_on_temperature(engine):
    result = engine.generate(PROMPT, max_tokens=12, temperature=1.5, seed=3, repeat_penalty=1.0,
                             logprobs=True)
    expected = model_logprobs(engine, engine.tokenize(PROMPT), result.tokens)
    assert np.allclose(chosen_logprobs(result), expected[np.arange(len(result.tokens)), result.tokens],
                       atol=1e-5)


def test_logprobs_are_of_the_penalised_logits(engine):
    result = engine.generate(PROMPT, max_tokens=12, temperature=0, frequency_penalty=1.0, logprobs=True)
    logits = engine.logits(engine.tokenize(PROMPT) + result.tokens[:-1])[-len(result.tokens):]
    for i, (row, entry) in enumerate(zip(logits, result.logprobs)):
        ids, counts = np.unique(np.array(result.tokens[:i], np.int64), return_counts=True)
        penalised = row.astype(np.float64)
        penalised[ids] -= counts * 1.0
        assert entry.logprob == pytest.approx(log_softmax(penalised)[entry.token], abs=1e-5)


def test_speculative_decoding_reports_the_same_logprobs_as_plain_decoding(engine, speculating):
    plain = engine.generate(COUNTING, max_tokens=40, temperature=0, logprobs=True, top_logprobs=3)
    fast = speculating.generate(COUNTING, max_tokens=40, temperature=0, logprobs=True, top_logprobs=3)
    assert fast.stats.accepted_tokens > 0 and fast.tokens == plain.tokens
    assert np.allclose(chosen_logprobs(fast), chosen_logprobs(plain), atol=1e-6)
    assert [[t.token for t in e.top] for e in fast.logprobs] == \
        [[t.token for t in e.top] for e in plain.logprobs]


def test_sampled_speculative_logprobs_are_the_targets(engine, speculating):
    result = speculating.generate(COUNTING, max_tokens=40, temperature=0.7, seed=5, repeat_penalty=1.0,
                                  logprobs=True)
    expected = model_logprobs(engine, engine.tokenize(COUNTING), result.tokens)
    assert result.stats.accepted_tokens > 0
    assert np.allclose(chosen_logprobs(result), expected[np.arange(len(result.tokens)), result.tokens],
                       atol=1e-5)


def test_stream_pieces_carry_the_logprobs_of_their_tokens(engine):
    stream = engine.stream("Write a word in French:", max_tokens=16, temperature=0, logprobs=True)
    pieces = list(stream)
    per_piece = [stream.piece_logprobs(i) for i in range(len(pieces))]
    for piece, entries in zip(pieces, per_piece):
        assert b"".join(entry.bytes for entry in entries).decode() == piece
    assert [e for entries in per_piece for e in entries] == stream.result.logprobs


def test_chat_reports_logprobs(engine):
    result = engine.chat([{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, logprobs=True)
    assert len(result.logprobs) == len(result.tokens) > 0


def test_logprobs_are_none_unless_asked_for(engine):
    assert engine.generate(PROMPT, max_tokens=2, temperature=0).logprobs is None


def test_logit_bias_of_100_forces_a_token(engine):
    forced = engine.tokenize(" Rome", add_bos=False)[0]
    result = engine.generate(PROMPT, max_tokens=4, temperature=0, logit_bias={forced: 100})
    assert result.tokens == [forced] * 4


def test_logit_bias_of_minus_100_bans_a_token(engine):
    favourite = engine.generate(PROMPT, max_tokens=1, temperature=0).tokens[0]
    result = engine.generate(PROMPT, max_tokens=8, temperature=0, logit_bias={favourite: -100})
    assert favourite not in result.tokens


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        engine.generate(PROMPT, max_tokens=1, logit_bias={engine.config.vocab_size: 1})


def test_presence_penalty_stops_greedy_repeating_itself(engine):
    plain = engine.generate(COUNTING, max_tokens=24, temperature=0)
    penalised = engine.generate(COUNTING, max_tokens=24, temperature=0, presence_penalty=2.0)
    assert len(set(plain.tokens)) < len(plain.tokens)  # it counts on, repeating its words
    assert len(set(penalised.tokens)) > len(set(plain.tokens))
