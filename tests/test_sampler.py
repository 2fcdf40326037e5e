import numpy as np
import pytest

from tierflow.errors import InvalidArgumentError, ModelFileError
from tierflow.runtime.sampling.sampler import (
    SAMPLED_REPEAT_PENALTY,
    Sampler,
    SamplingParams,
    recommended_sampling,
)

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, -1.0], dtype=np.float32)


def draws(params: SamplingParams, n: int = 400, logits=LOGITS, history=()) -> set[int]:
    sampler = Sampler(params)
    return {sampler.sample(logits, history) for _ in range(n)}


def test_temperature_zero_is_greedy():
    assert draws(SamplingParams(temperature=0)) == {1}


def test_top_k_limits_candidates():
    assert draws(SamplingParams(temperature=5, top_k=2, top_p=1, min_p=0)) == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # softmax(LOGITS): 0.63 for id 1, 0.23 for id 2; top_p 0.7 needs both.
    assert draws(SamplingParams(temperature=5, top_k=0, top_p=0.7, min_p=0)) == {1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    assert draws(SamplingParams(temperature=5, top_k=0, top_p=1, min_p=0.3)) == {1, 2}


def test_repeat_penalty_demotes_recent_tokens():
    params = SamplingParams(temperature=0, repeat_penalty=10.0)
    assert draws(params, history=[1]) == {2}


def test_same_seed_gives_same_draws():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1, min_p=0, seed=7)
    a, b = Sampler(params), Sampler(params)
    assert [a.sample(LOGITS) for _ in range(50)] == [b.sample(LOGITS) for _ in range(50)]


def test_sampled_frequencies_follow_the_tempered_distribution():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1, min_p=0, seed=0)
    sampler = Sampler(params)
    counts = np.bincount([sampler.sample(LOGITS) for _ in range(20000)], minlength=5)
    expected = np.exp(LOGITS - LOGITS.max()) / np.exp(LOGITS - LOGITS.max()).sum()
    assert np.allclose(counts / counts.sum(), expected, atol=0.015)


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
     dict(repeat_penalty=0)],
)
def test_out_of_range_settings_are_rejected(bad):
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**bad)


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-30])
def test_a_tiny_temperature_gives_the_top_token_all_the_mass(temperature):
    assert draws(SamplingParams(temperature=temperature, top_k=0, top_p=1, min_p=0), n=50) == {1}


def test_a_tiny_temperature_shares_the_mass_between_tied_top_tokens():
    tied = np.array([3.0, 1.0, 3.0], dtype=np.float32)
    params = SamplingParams(temperature=1e-320, top_k=0, top_p=1, min_p=0)
    assert np.array_equal(Sampler(params).distribution(tied), [0.5, 0.0, 0.5])


@pytest.mark.parametrize("temperature", [0, 0.8])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_are_a_model_file_error(temperature, bad):
    logits = LOGITS.copy()
    logits[3] = bad
    with pytest.raises(ModelFileError, match="non-finite logits.*damaged"):
        Sampler(SamplingParams(temperature=temperature)).sample(logits)


@pytest.mark.parametrize(
    "name, bad",
    [("temperature", "0.5"), ("temperature", None), ("temperature", True), ("temperature", float("nan")),
     ("temperature", float("inf")), pytest.param("temperature", 10**400, id="temperature-past-float"),
     ("top_p", float("nan")), ("top_p", "0.9"), ("min_p", float("nan")), ("repeat_penalty", float("inf")),
     ("repeat_penalty", float("nan")), ("top_k", 1.5), ("top_k", 2.0), ("top_k", "3"), ("top_k", True),
     ("repeat_last_n", 8.0), ("seed", "abc"), ("seed", 1.5), ("seed", -1), ("seed", False)],
)
def test_non_numbers_and_non_finite_settings_are_rejected_by_name(name, bad):
    with pytest.raises(InvalidArgumentError, match=f"^{name} must be"):
        SamplingParams(**{name: bad})


@pytest.mark.parametrize(
    "name, value, expected",
    [("temperature", np.float32(0.5), 0.5), ("temperature", 1, 1.0), ("top_p", np.float64(0.5), 0.5),
     ("top_k", np.int64(5), 5), ("repeat_last_n", np.uint8(3), 3), ("seed", np.int32(7), 7)],
)
def test_numpy_and_integer_settings_become_python_numbers(name, value, expected):
    setting = getattr(SamplingParams(**{name: value}), name)
    assert setting == expected and type(setting) is type(expected)


def test_an_unknown_sampling_keyword_is_named_with_the_likely_one():
    with pytest.raises(InvalidArgumentError, match="unknown sampling keyword 'temprature'.*'temperature'"):
        SamplingParams.from_keywords({"temprature": 1})


def test_a_model_files_recommended_sampling_becomes_keywords():
    metadata = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.9,
                "general.sampling.min_p": 0.0, "general.sampling.penalty_repeat": 1.05,
                "general.sampling.penalty_last_n": 128, "general.name": "x"}
    assert recommended_sampling(metadata, 4096) == {"temperature": 0.6, "top_k": 20, "top_p": 0.9,
                                                    "min_p": 0.0, "repeat_penalty": 1.05,
                                                    "repeat_last_n": 128}


def test_a_penalty_window_of_minus_one_is_the_whole_context():
    assert recommended_sampling({"general.sampling.penalty_last_n": -1}, 4096) == {"repeat_last_n": 4096}


def test_a_recommended_value_no_setting_accepts_is_left_out_with_a_warning(caplog):
    metadata = {"general.sampling.temp": float("nan"), "general.sampling.top_k": 20}
    assert recommended_sampling(metadata, 4096) == {"top_k": 20}
    assert "general.sampling.temp" in caplog.text


def test_sampling_penalises_repetition_by_default_and_greedy_does_not():
    assert SamplingParams(temperature=0.8).repeat_penalty == SAMPLED_REPEAT_PENALTY
    assert SamplingParams(temperature=0).repeat_penalty == 1.0
    assert SamplingParams(temperature=0.8, repeat_penalty=1.0).repeat_penalty == 1.0
