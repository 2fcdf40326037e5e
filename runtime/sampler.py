"""Next-token sampling: repetition penalty, top-k, top-p, min-p, temperature, seeded draws.

The filters run in llama.cpp's default order (penalty, top-k, top-p, min-p, then temperature), on
the untempered distribution, so the same settings select the same candidate set as llama.cpp.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierflow.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1 disables
    min_p: float = 0.05  # 0 disables
    repeat_penalty: float = 1.0  # 1 disables
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidArgumentError(message)


class Sampler:
    """Picks tokens from logits; owns the random generator so a seed fixes the whole output."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """One token id from logits [V], given the ids seen so far (for the penalty)."""
        if self.greedy:
            return int(np.argmax(self._penalised(logits, history)))
        candidates, probs = self.candidates(logits, history)
        return int(candidates[self.rng.choice(len(candidates), p=probs)])

    def candidates(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The distribution sample() draws from: candidate ids (most probable first) and their
        probabilities (for greedy, the one best token with probability 1)."""
        p = self.params
        logits = self._penalised(logits, history)
        if self.greedy:
            return np.array([np.argmax(logits)]), np.ones(1)
        candidates = top_k_candidates(logits, p.top_k)  # ids, most probable first
        probs = softmax(logits[candidates])
        keep = nucleus_size(probs, p.top_p)
        if p.min_p > 0:
            keep = min(keep, int(np.count_nonzero(probs >= p.min_p * probs[0])))
        candidates = candidates[: max(keep, 1)]
        return candidates, softmax(logits[candidates] / p.temperature)

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The same distribution as a dense vector [V] (float64)."""
        candidates, probs = self.candidates(logits, history)
        dense = np.zeros(logits.shape[-1])
        dense[candidates] = probs
        return dense

    def _penalised(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        logits = logits.astype(np.float64, copy=True)
        if p.repeat_penalty != 1.0 and p.repeat_last_n and len(history):
            apply_repeat_penalty(logits, history[-p.repeat_last_n:], p.repeat_penalty)
        return logits


def apply_repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> None:
    """llama.cpp's rule, in place: a seen token's logit is divided by the penalty if positive,
    multiplied if negative."""
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    seen = logits[ids]
    logits[ids] = np.where(seen > 0, seen / penalty, seen * penalty)


def top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Token ids sorted by descending logit, at most k of them (all when k is 0)."""
    if 0 < k < logits.shape[0]:
        top = np.argpartition(-logits, k - 1)[:k]
        return top[np.argsort(-logits[top], kind="stable")]
    return np.argsort(-logits, kind="stable")


def nucleus_size(sorted_probs: np.ndarray, top_p: float) -> int:
    """How many of the descending probabilities reach a cumulative mass of top_p."""
    if top_p >= 1.0:
        return sorted_probs.shape[0]
    return int(np.searchsorted(np.cumsum(sorted_probs), top_p) + 1)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
