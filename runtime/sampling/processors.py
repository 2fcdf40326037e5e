"""The logits processors: each changes a position's logits [V] (float64, in place) given the
history (the prompt's ids, then the generated ones), and the sampler runs them in order before it
filters and picks. A new constraint is one more processor, with no edit to the sampler.

make_logits_processors builds llama.cpp's order from SamplingParams: the logit bias, the repeat
penalty, OpenAI's frequency and presence penalties, then the logprobs' record (the model's own
distribution after those, before any mask), then any extra processors, then a grammar's mask.
"""

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tierflow.errors import InvalidArgumentError

if TYPE_CHECKING:
    from tierflow.runtime.sampling.sampler import SamplingParams


class LogitsProcessor(Protocol):
    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> None: ...  # in place


class LogitsConstraint(Protocol):
    """What may come next after history: a grammar's matcher (runtime/sampling/structured.py)."""

    def mask(self, logits: np.ndarray, history: Sequence[int]) -> None:
        """Sets the logits [V] of forbidden tokens to -inf, in place."""


class LogitBias:
    """Adds each listed token's bias to its logit (OpenAI's logit_bias)."""

    def __init__(self, bias: Mapping[int, float], vocab_size: int | None):
        self.ids = np.fromiter(bias.keys(), np.int64, len(bias))
        self.values = np.fromiter(bias.values(), np.float64, len(bias))
        if vocab_size is not None and len(bias) and self.ids.max() >= vocab_size:
            raise InvalidArgumentError(f"logit_bias: token id {self.ids.max()} is outside the "
                                       f"vocabulary (0..{vocab_size - 1})")

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> None:
        logits[self.ids] += self.values


class RepeatPenalty:
    """llama.cpp's rule over the last `last_n` ids of the history: a seen token's logit is divided
    by the penalty if positive, multiplied if negative."""

    def __init__(self, penalty: float, last_n: int):
        self.penalty, self.last_n = penalty, last_n

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> None:
        if len(history):
            apply_repeat_penalty(logits, history[-self.last_n:], self.penalty)


class OpenAIPenalties:
    """OpenAI's frequency and presence penalties over the generated tokens (the history after the
    prompt's num_prompt_tokens)."""

    def __init__(self, frequency: float, presence: float, num_prompt_tokens: int):
        self.frequency, self.presence, self.num_prompt_tokens = frequency, presence, num_prompt_tokens

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> None:
        generated = history[self.num_prompt_tokens:]
        if len(generated):
            apply_openai_penalties(logits, generated, self.frequency, self.presence)


class LogprobRecorder:
    """Records the log-softmax of the logits it sees, by the position a token is picked for
    (len(history)), until the generation takes them."""

    def __init__(self):
        self.recorded: dict[int, np.ndarray] = {}

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> None:
        self.recorded[len(history)] = log_softmax(logits)


class GrammarMask:
    """A constraint's mask: forbidden tokens' logits to -inf."""

    def __init__(self, constraint: LogitsConstraint):
        self.constraint = constraint

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> None:
        self.constraint.mask(logits, history)


def make_logits_processors(params: "SamplingParams", num_prompt_tokens: int = 0,
                           vocab_size: int | None = None, constraint: LogitsConstraint | None = None,
                           extra: Sequence[LogitsProcessor] = ()) -> list[LogitsProcessor]:
    """The processors the settings ask for, in the order they run (see the module's docstring)."""
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(LogitBias(params.logit_bias, vocab_size))
    if params.repeat_penalty != 1.0 and params.repeat_last_n:
        processors.append(RepeatPenalty(params.repeat_penalty, params.repeat_last_n))
    if params.frequency_penalty or params.presence_penalty:
        processors.append(OpenAIPenalties(params.frequency_penalty, params.presence_penalty,
                                          num_prompt_tokens))
    if params.logprobs:
        processors.append(LogprobRecorder())
    processors.extend(extra)
    if constraint is not None:
        processors.append(GrammarMask(constraint))
    return processors


def apply_repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> None:
    """llama.cpp's rule, in place: a seen token's logit is divided by the penalty if positive,
    multiplied if negative."""
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    seen = logits[ids]
    logits[ids] = np.where(seen > 0, seen / penalty, seen * penalty)


def apply_openai_penalties(logits: np.ndarray, generated: Sequence[int], frequency: float,
                           presence: float) -> None:
    """OpenAI's rule, in place: logit -= count * frequency + (count > 0) * presence."""
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    logits[ids] -= counts * frequency + presence


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())
