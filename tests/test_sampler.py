import numpy as np
import pytest

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.sampler import Sampler, SamplingParams

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
