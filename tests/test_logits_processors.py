"""The sampler runs its logits processors in order; a new constraint is one more processor."""

import numpy as np

from tierflow.runtime.sampling.processors import (
    GrammarMask,
    LogitBias,
    LogprobRecorder,
    OpenAIPenalties,
    RepeatPenalty,
    log_softmax,
    make_logits_processors,
)
from tierflow.runtime.sampling.sampler import Sampler, SamplingParams

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, -1.0], dtype=np.float32)


class BanToken:
    """A constraint the sampler was not written for: one token never comes next."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, logits: np.ndarray, history) -> None:
        logits[self.token] = -np.inf


class AllowOnly:
    def __init__(self, token: int):
        self.token = token

    def mask(self, logits: np.ndarray, history) -> None:
        keep = logits[self.token]
        logits[:] = -np.inf
        logits[self.token] = keep


def test_the_processors_run_in_llama_cpps_order_with_the_record_before_any_mask():
    params = SamplingParams(temperature=0, logit_bias={0: 1.0}, repeat_penalty=1.2, frequency_penalty=0.1,
                            logprobs=True)
    kinds = [type(p) for p in make_logits_processors(params, constraint=AllowOnly(3), extra=[BanToken(1)])]
    assert kinds == [LogitBias, RepeatPenalty, OpenAIPenalties, LogprobRecorder, BanToken, GrammarMask]


def test_settings_that_change_nothing_add_no_processor():
    assert make_logits_processors(SamplingParams(temperature=0)) == []


def test_an_extra_processor_constrains_every_pick_without_a_change_to_the_sampler():
    sampler = Sampler(SamplingParams(temperature=0), extra=[BanToken(1)])
    assert sampler.sample(LOGITS) == 2  # the best, token 1, is banned
    sampled = Sampler(SamplingParams(temperature=5.0, seed=0, top_k=0, top_p=1.0, min_p=0.0),
                      extra=[BanToken(1)])
    assert sampled.distribution(LOGITS)[1] == 0
    assert 1 not in {sampled.sample(LOGITS) for _ in range(200)}


def test_the_logprobs_stay_the_models_own_under_a_mask():
    sampler = Sampler(SamplingParams(temperature=0, logprobs=True), constraint=AllowOnly(3))
    assert sampler.sample(LOGITS, [4]) == 3
    assert np.allclose(sampler.take_logprobs(1), log_softmax(LOGITS.astype(np.float64)))


def test_a_drafts_sampler_records_nothing_but_masks_alike():
    sampler = Sampler(SamplingParams(temperature=0, logprobs=True), constraint=AllowOnly(3))
    draft = sampler.for_draft()
    assert draft.sample(LOGITS) == 3
    assert not any(isinstance(p, LogprobRecorder) for p in draft.processors)
