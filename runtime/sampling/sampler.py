"""Next-token sampling: logit bias, penalties, top-k, top-p, min-p, temperature, seeded draws.

The filters run in llama.cpp's default order (logit bias, penalties, top-k, top-p, min-p, then
temperature), on the untempered distribution, so the same settings select the same candidate set
as llama.cpp. The bias and OpenAI's frequency and presence penalties adjust the logits before the
rest, as OpenAI defines them.
"""

import copy
import difflib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from numbers import Integral, Real

import numpy as np

from tierflow.arguments import flag
from tierflow.errors import InvalidArgumentError, ModelFileError
from tierflow.runtime.sampling.processors import (
    LogitsConstraint,
    LogitsProcessor,
    LogprobRecorder,
    make_logits_processors,
)

log = logging.getLogger(__name__)

# The real-valued settings: what a value must satisfy, and how to say so. Each must also be a
# finite number (numpy's included; a bool is not a number here).
_REAL_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda t: t >= 0, "a finite number >= 0 (0 is greedy)"),
    "top_p": (lambda p: 0 < p <= 1, "a number in (0, 1]"),
    "min_p": (lambda p: 0 <= p <= 1, "a number in [0, 1]"),
    "repeat_penalty": (lambda r: r > 0, "a finite number > 0"),
    "frequency_penalty": (lambda f: -2 <= f <= 2, "a number in [-2, 2]"),
    "presence_penalty": (lambda f: -2 <= f <= 2, "a number in [-2, 2]"),
}
MAX_LOGIT_BIAS = 100  # OpenAI's bound: +-100 bans or forces a token
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on the alternatives reported per token


# Without it the bundled model loops: in chat answers of 256 tokens at temperature 0.8, 5 of 24
# ended repeating themselves (15% of their 4-grams repeated), none with 1.1 (0.8%); other top-p
# and min-p settings did not help (python -m benchmarks.repetition). ollama's default too.
SAMPLED_REPEAT_PENALTY = 1.1


@dataclass(frozen=True)
class SamplingParams:
    """Validated on construction; numpy scalars become Python numbers."""

    temperature: float = 0.8  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1 disables
    min_p: float = 0.05  # 0 disables
    # 1 disables. None: SAMPLED_REPEAT_PENALTY when sampling, off when greedy (greedy stays the
    # model's own most likely token, as llama.cpp's).
    repeat_penalty: float | None = None
    repeat_last_n: int = 64
    seed: int | None = None  # None: a fresh random seed
    # OpenAI's penalties over the tokens generated so far (not the prompt's): a token's logit
    # loses count * frequency_penalty + (count > 0) * presence_penalty.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # Report each generated token's log-probability (runtime/sampling/logprobs.py), and the top_logprobs
    # most likely tokens at its position.
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.repeat_penalty is None:
            greedy = _is_finite_number(self.temperature) and self.temperature == 0
            object.__setattr__(self, "repeat_penalty", 1.0 if greedy else SAMPLED_REPEAT_PENALTY)
        for name, (accepts, must) in _REAL_RULES.items():
            object.__setattr__(self, name, _real(name, getattr(self, name), accepts, must))
        for name in ("top_k", "repeat_last_n"):
            object.__setattr__(self, name, as_count(name, getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", as_count("seed", self.seed, "a non-negative integer or None"))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        self._check_logprobs()

    def _check_logprobs(self) -> None:
        flag("logprobs", self.logprobs)
        top = as_count("top_logprobs", self.top_logprobs, f"an integer in 0..{MAX_TOP_LOGPROBS}")
        if top > MAX_TOP_LOGPROBS:
            raise InvalidArgumentError(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {top}")
        if top and not self.logprobs:
            raise InvalidArgumentError("top_logprobs needs logprobs=True")
        object.__setattr__(self, "top_logprobs", top)

    @classmethod
    def from_keywords(cls, settings: Mapping[str, object]) -> "SamplingParams":
        """SamplingParams(**settings), where a misspelt name is an InvalidArgumentError naming it
        (not a TypeError from the constructor)."""
        names = [field.name for field in fields(cls)]
        for name in settings:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InvalidArgumentError(f"unknown sampling keyword {name!r}{hint}: the sampling "
                                           f"keywords are {', '.join(names)}")
        return cls(**settings)


# The sampling a model's makers recommend, stored in its file as llama.cpp reads it: key -> keyword.
_RECOMMENDED_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n",
}


def recommended_sampling(metadata: Mapping[str, object], context_length: int) -> dict[str, float | int]:
    """The sampling keywords a model file recommends (`general.sampling.*`). A value no setting
    accepts is left out with a warning: a bad hint is no reason to refuse the model. A
    penalty_last_n of -1 means the whole context, as in llama.cpp."""
    settings = {}
    for key, name in _RECOMMENDED_KEYS.items():
        if key not in metadata:
            continue
        value = metadata[key]
        if name == "repeat_last_n" and value == -1:
            value = context_length
        try:
            settings[name] = getattr(SamplingParams(**{name: value}), name)
        except InvalidArgumentError as error:
            log.warning("ignoring the model file's %s: %s", key, error)
    return settings


def as_count(name: str, value: object, must: str = "a non-negative integer") -> int:
    """value as an int, if it is an integer >= 0 (numpy's too; not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise InvalidArgumentError(f"{name} must be {must}, got {value!r}")
    return int(value)


def _logit_bias(bias: object) -> dict[int, float]:
    """bias as {token id: bias}, each id an integer >= 0 and each bias a number in [-100, 100]."""
    if not isinstance(bias, Mapping):
        raise InvalidArgumentError(f"logit_bias must be a mapping of token id to bias, not "
                                   f"{type(bias).__name__}")
    must = f"a number in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"
    return {as_count("logit_bias's token id", token): _real(f"logit_bias[{token}]", value,
                                                            lambda b: abs(b) <= MAX_LOGIT_BIAS, must)
            for token, value in bias.items()}


def _real(name: str, value: object, accepts: Callable[[float], bool], must: str) -> float:
    if not _is_finite_number(value) or not accepts(float(value)):
        raise InvalidArgumentError(f"{name} must be {must}, got {value!r}")
    return float(value)


def _is_finite_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range
        return False


class Sampler:
    """Picks tokens from logits; owns the random generator so a seed fixes the whole output.

    One per generation. history (what sample() and candidates() take) is the prompt's ids, then
    the generated ones: num_prompt_tokens says where the generated ones start (for OpenAI's
    penalties). With params.logprobs it records, at each position it picks a token for, the
    log-softmax of the logits after the bias and penalties and before temperature and the
    top-k/top-p/min-p cut (OpenAI's logprobs do not change with temperature; llama-server's
    default probabilities are untempered too), for take_logprobs. With a constraint, every pick
    (and every distribution speculative acceptance reads) is over the tokens it allows after the
    history given: the constraint follows that history; the logprobs stay the model's own.
    """

    def __init__(self, params: SamplingParams, num_prompt_tokens: int = 0, vocab_size: int | None = None,
                 constraint: LogitsConstraint | None = None, extra: Sequence[LogitsProcessor] = ()):
        self.params = params
        self.constraint = constraint
        self.rng = np.random.default_rng(params.seed)
        self.num_prompt_tokens = num_prompt_tokens
        # the logits processors in order (processors.py): bias, penalties, the logprobs' record, extra, mask
        self.processors = make_logits_processors(params, num_prompt_tokens, vocab_size, constraint, extra)

    def for_draft(self) -> "Sampler":
        """This sampler (same settings, same random generator) for a draft's guesses: it records
        nothing, since only the target's logits give a token's log-probability."""
        draft = copy.copy(self)
        draft.processors = [p for p in self.processors if not isinstance(p, LogprobRecorder)]
        return draft

    def take_logprobs(self, position: int) -> np.ndarray:
        """The log-probabilities [V] recorded where the token at `position` of history was picked
        (the target's: a speculative token's come from the verify pass that accepted it)."""
        recorder = next((p for p in self.processors if isinstance(p, LogprobRecorder)), None)
        if recorder is None:
            raise InvalidArgumentError("this generation was not asked for logprobs")
        return recorder.recorded.pop(position)

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
        return candidates, tempered_softmax(logits[candidates], p.temperature)

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The same distribution as a dense vector [V] (float64)."""
        candidates, probs = self.candidates(logits, history)
        dense = np.zeros(logits.shape[-1])
        dense[candidates] = probs
        return dense

    def scores(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The logits [V] picks are made from (float64): penalised, and -inf where the constraint
        forbids; what a greedy draft ranks its guesses by under a constraint."""
        return self._penalised(logits, history)

    def _penalised(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logits as float64 after every logits processor: the bias and penalties applied, the
        logprobs recorded, the constraint's forbidden tokens at -inf. Every token is picked from
        these, so this is where a broken model is caught (not in numpy's draw)."""
        if not np.isfinite(logits).all():
            raise ModelFileError("the model produced non-finite logits (NaN or infinity): its weights "
                                 "may be damaged")
        logits = logits.astype(np.float64, copy=True)
        for process in self.processors:
            process(logits, history)
        return logits


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


def tempered_softmax(sorted_logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(logits / temperature) of logits sorted in descending order, for any temperature > 0.
    They are shifted to the best first, so that a tiny temperature gives the best token(s) all the
    mass (llama.cpp's limit) instead of inf - inf."""
    with np.errstate(over="ignore"):  # a gap over a tiny temperature is -inf: probability 0
        return softmax((sorted_logits - sorted_logits[0]) / temperature)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
