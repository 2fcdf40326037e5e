"""Choosing a draft: by the planner's prediction first, then by measurement.

Each candidate (prompt lookup, the self-draft at a depth, a draft model) is a Speculator with a
predicted tokens/s. The prediction is a chain of k guesses, each the target's token with the
candidate's acceptance prior a (ACCEPTANCE_PRIOR; for a self-draft self_acceptance): a pass
gains (1 - a^(k+1)) / (1 - a) tokens and costs k draft levels plus a verify pass over k + 1
tokens, each as the planner's cost model predicts it (offload/plan/pass_costs.py, which also
sizes the first trees: the target's layers as planned, a streamed target's reads included, and
the head over every row a verify pass wants; the draft's held layers and head, one token a
level); the best k, or a plain decode step if none pays.

`AutoSpeculator` runs the candidate predicted fastest for TRIAL_PASSES passes and measures its
tokens/s (the tokens its passes gave over their seconds, draft and verify), after one pass that
does not count: a draft model's first pass also reads what it has not seen (the prompt, or what
another candidate generated), which cost a streamed 1.5B's 0.5B draft a second, and so the trial,
to prompt lookup, on most prompts; then each candidate
predicted at least CLOSE_CALL as fast as the best measured one was predicted gets as many
passes, in order of prediction (the cost model's absolute figures can be off on a machine, their
ratios less so: a close call is measured, a clear one is not); then the best measured runs from
then on. A seeded sampled generation runs the predicted best
alone, without measuring: its output must not depend on timings.
"""

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierflow.offload.gguf.model_file import ModelFile, open_model_file
from tierflow.offload.pack.writer import PackSizes, pack_sizes
from tierflow.offload.plan.pass_costs import PassCosts
from tierflow.offload.plan.planner import Plan, ProfileSource
from tierflow.runtime.generation.stats import GenerationStats
from tierflow.runtime.generation.token_loop import TokenGenerator
from tierflow.runtime.loading.loader import Budgets, LoadedModel, plan_load
from tierflow.runtime.sampling.sampler import Sampler
from tierflow.speculative.drafts import NgramDraft
from tierflow.speculative.first_sizes import SpeculationPrior
from tierflow.speculative.mtp import mtp_draft
from tierflow.speculative.self_draft import (
    DraftRequest,
    SelfDraft,
    self_draft_budgets,
    self_draft_depths,
    self_draft_generators,
)
from tierflow.speculative.sizing import SIZES, TreeBudget
from tierflow.speculative.speculator import (
    MAX_GUESSES,
    Speculator,
    draft_width,
    make_speculator,
    model_budget,
)

log = logging.getLogger("tierflow.speculative")

TRIAL_PASSES = 6  # passes each candidate runs before its tokens/s counts
CLOSE_CALL = 0.8  # a candidate predicted this fast relative to the best measured one is measured too
# A trial ends after two passes below this share of the best rate measured: a self-draft of the
# Qwen2.5-Coder-1.5B ran at 1.4 tokens/s against 12 for the others, and its trial took seconds.
HOPELESS = 0.5
# The chance that a draft's next guess is the target's token, before any is measured: prompt
# lookup guesses only where the text repeats (code, quotes; on open prose it rarely has a guess);
# a draft model of the target's vocabulary agrees often (a 3-bit conversion of SmolLM2 about half
# the time, the Q4_1 file drafting for its F32 copy nine times in ten).
ACCEPTANCE_PRIOR = {"ngram": 0.15, "file": 0.6}
NO_DRAFT = "no draft"  # auto's candidate of plain decode steps


def self_acceptance(depth: int, num_layers: int) -> float:
    """The prior of a self-draft of `depth` of the target's layers: an untrained early exit agrees
    little until near the top (SmolLM2-135M: 11% at 16 of 30 layers, 41% at 24, 48% at 27)."""
    return 0.6 * (depth / num_layers) ** 3


def predicted_tokens_per_s(acceptance: float, level_s: float, verify_s: Callable[[int], float],
                           max_guesses: int) -> float:
    """The best over chain lengths k <= max_guesses of a pass's expected tokens over its seconds."""
    best = 1.0 / verify_s(1)
    for k in (size for size in SIZES if 0 < size <= max_guesses):
        expected = (1 - acceptance ** (k + 1)) / (1 - acceptance)
        best = max(best, expected / (k * level_s + verify_s(k + 1)))
    return best


@dataclass
class Candidate:
    name: str  # as --draft names it: "ngram", "self:N", the draft file's name; or NO_DRAFT
    speculator: Speculator
    predicted: float  # tokens/s
    measured: float | None = None
    passes: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def count(self, tokens: int, seconds: float, bar: float) -> bool:
        """Counts a pass, but its first (see the module docstring); True once TRIAL_PASSES have given
        its measured tokens/s, or sooner when two passes ran below `bar` tokens/s."""
        self.passes += 1
        if self.passes == 1:
            return False
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        hopeless = self.passes >= 3 and self.tokens / self.seconds < bar
        if self.passes == TRIAL_PASSES + 1 or hopeless:
            self.measured = self.tokens / self.seconds
        return self.measured is not None


class AutoSpeculator:
    """A Speculator that runs one of its candidates: see the module docstring for which."""

    def __init__(self, candidates: Sequence[Candidate], plain: float):
        """plain: the predicted tokens/s of a decode step without a draft."""
        self.candidates = sorted(candidates, key=lambda c: -c.predicted)
        self.plain = plain
        self.current = self.candidates[0]
        self.settled = len(self.candidates) == 1
        self._lock = threading.Lock()  # generations running together count their passes here

    def describe(self) -> str:
        """The choice and why, for the load's notices."""
        others = ", ".join(f"{c.name} {c.predicted:.1f}" for c in self.candidates[1:])
        return (f"draft: {self.current.name} first, predicted {self.current.predicted:.1f} tokens/s, "
                f"{self.predicted_speedup():.2f}x a decode without a draft"
                + (f" (others predicted: {others})" if others else ""))

    def predicted_speedup(self) -> float:
        """The first candidate's predicted tokens/s over a plain decode step's."""
        return self.candidates[0].predicted / self.plain

    def save(self) -> None:
        """Keeps what each candidate's passes measured for the next load of its pair."""
        for candidate in self.candidates:
            candidate.speculator.save()

    def for_generation(self, sampler: Sampler) -> "AutoSpeculator | Speculator":
        if sampler.greedy or sampler.params.seed is None:
            return self
        return self.candidates[0].speculator.for_generation(sampler)

    def step(self, target: TokenGenerator, history: Sequence[int], sampler: Sampler, room: int,
             stats: GenerationStats) -> tuple[list[int], int]:
        candidate, started = self.current, time.perf_counter()
        accepted, token = candidate.speculator.step(target, history, sampler, room, stats)
        if not self.settled:
            with self._lock:
                if candidate is self.current and candidate.count(len(accepted) + 1,
                                                                 time.perf_counter() - started, self._bar()):
                    self._next(candidate)
        return accepted, token

    def _bar(self) -> float:
        """The tokens/s under which a trial ends early: HOPELESS of the best measured so far, or of
        the plain decode step's prediction before any was measured."""
        measured = [c.measured for c in self.candidates if c.measured is not None]
        return HOPELESS * (max(measured) if measured else self.plain)

    def _next(self, done: Candidate) -> None:
        best = max((c for c in self.candidates if c.measured is not None), key=lambda c: c.measured)
        untried = [c for c in self.candidates
                   if c.measured is None and c.predicted >= CLOSE_CALL * best.predicted]
        self.current = untried[0] if untried else best
        self.settled = not untried
        log.info("draft: %s measured %.1f tokens/s; now %s", done.name, done.measured, self.current.name)


@dataclass(frozen=True)
class Predictions:
    """Each kind of draft's predicted tokens/s for a target as planned (see the module docstring)."""

    verify: PassCosts  # the target's passes
    num_layers: int
    most: int  # a draft model's guesses per pass at most
    file_level_s: float | None  # the draft file's pass over one token; None: no file

    @classmethod
    def of(cls, target: ModelFile, sizes: PackSizes, plan: Plan, drafted: LoadedModel | None,
           profile: ProfileSource, shape: str, tokens: int | None) -> "Predictions":
        hardware = profile() if callable(profile) else profile
        verify = PassCosts(plan, target.config, sizes, hardware)
        level_s = None
        if drafted is not None:
            with open_model_file(drafted.path) as opened:
                level_s = PassCosts(drafted.plan, drafted.config, pack_sizes(opened), hardware).seconds(1)
        return cls(verify, target.config.num_layers, max(model_budget(shape, tokens).sizes), level_s)

    def self_draft(self, depth: int) -> float:
        level_s = self.verify.seconds(1, num_layers=depth)
        return predicted_tokens_per_s(self_acceptance(depth, self.num_layers), level_s, self.verify.seconds,
                                      self.most)

    def plain(self) -> float:
        return 1.0 / self.verify.seconds(1)

    def ngram(self) -> float:
        return predicted_tokens_per_s(ACCEPTANCE_PRIOR["ngram"], 0.0, self.verify.seconds, MAX_GUESSES)

    def file(self) -> float:
        return predicted_tokens_per_s(ACCEPTANCE_PRIOR["file"], self.file_level_s, self.verify.seconds,
                                      self.most)


def draft_budgets(request: DraftRequest, target: ModelFile, sizes: PackSizes, budgets: Budgets,
                  profile: ProfileSource, drafted: LoadedModel | None, shape: str, tokens: int | None
                  ) -> Budgets:
    """budgets with the self-draft's layers (Budgets.draft_layers) where the request has one:
    "self" and "self:N" always (a BudgetError if they cannot fit); "auto" when they fit and some
    depth is predicted faster than plain decode steps and at least CLOSE_CALL as fast as prompt
    lookup or the draft file (else its layers and KV cache would be held for a draft that is never
    measured)."""
    if not request.wants_self:
        return budgets
    with_self = self_draft_budgets(target, sizes, budgets, profile, request.layers, request.kind == "self")
    if request.kind == "self" or with_self is None:
        return with_self or budgets
    predicted = Predictions.of(target, sizes, plan_load(target, sizes, with_self, profile), drafted, profile,
                               shape, tokens)
    others = max(predicted.ngram(), predicted.file() if drafted is not None else 0.0)
    selves = max(map(predicted.self_draft, self_draft_depths(with_self.draft_layers, None)))
    return with_self if selves > predicted.plain() and selves >= CLOSE_CALL * others else budgets


def draft_speculator(request: DraftRequest, target: ModelFile, sizes: PackSizes, loaded: LoadedModel,
                     drafted: LoadedModel | None, profile: ProfileSource, shape: str, tokens: int | None,
                     prior: Callable[[LoadedModel | None], SpeculationPrior]
                     ) -> tuple["Speculator | AutoSpeculator", tuple[str, ...]]:
    """The speculator a draft request asks for (loaded: the target as planned, with the self-draft's
    layers if draft_budgets gave it some; drafted: the draft file's model; prior(draft): what sizes
    the first trees of prompt lookup (None) or of that draft model, and keeps what they learn), and
    what the load says about it."""
    vocab_size = target.config.vocab_size
    if request.kind == "mtp":
        return Speculator(mtp_draft(target, loaded, draft_width(shape)), model_budget(shape, tokens)), ()
    if request.kind in ("ngram", "file"):
        speculator = make_speculator(drafted and drafted.generator, shape, tokens, vocab_size, prior(drafted))
        speedup = speculator.predicted_speedup()
        name = drafted.path.name if drafted is not None else "prompt lookup"
        return speculator, (() if speedup is None else
                            (f"draft: {name}, predicted {speedup:.2f}x a decode without a draft",))
    selves = _self_speculators(request, loaded, shape, tokens)
    if request.layers is not None:
        return selves[request.layers], ()
    predicted = Predictions.of(target, sizes, loaded.plan, drafted, profile, shape, tokens)
    candidates = [Candidate(f"self:{depth}", speculator, predicted.self_draft(depth))
                  for depth, speculator in selves.items()]
    if request.kind == "auto":
        lookup = make_speculator(None, shape, tokens, vocab_size, prior(None))
        candidates.append(Candidate("ngram", lookup, predicted.ngram()))
    if request.kind == "auto" and drafted is not None:
        speculator = make_speculator(drafted.generator, shape, tokens, vocab_size, prior(drafted))
        candidates.append(Candidate(drafted.path.name, speculator, predicted.file()))
    plain = predicted.plain()
    if request.kind == "auto":  # plain decode steps are a candidate, and a draft predicted no faster is not
        candidates = [c for c in candidates if c.predicted > plain]
        plain_steps = Speculator(NgramDraft(vocab_size, 1), TreeBudget(0, fixed=True))
        candidates.append(Candidate(NO_DRAFT, plain_steps, plain))
    chooser = AutoSpeculator(candidates, plain)
    return chooser, (chooser.describe(),)


def _self_speculators(request: DraftRequest, loaded: LoadedModel, shape: str, tokens: int | None
                      ) -> dict[int, Speculator]:
    """The self-draft's speculator at each depth it may run at (none when it has no layers)."""
    if not loaded.plan.draft_layers:
        return {}
    depths = self_draft_depths(loaded.plan.draft_layers, request.layers)
    owner, turn = [None], threading.Lock()  # the depths share one KV cache, one at a time
    generators = self_draft_generators(loaded, depths)
    return {depth: Speculator(SelfDraft(generators[depth], owner, turn, draft_width(shape)),
                              model_budget(shape, tokens)) for depth in depths}
