"""The first passes' tree sizes from predictions, before any pass has been measured.

A pass of a tree of s guesses gains 1 + E[accepted] tokens, where E[accepted] is the sum over
the tree's nodes of the chance that the target reaches each (Sequoia's positional acceptance:
a node's chance is its parent's times the chance that the target takes the parent's r-th
candidate, r the node's rank among its siblings). The tree is the one ModelDraft grows: level
by level, the best (node, rank) pairs by that chance. It costs the draft's passes (the new
tokens, then one batched pass per level but the last) and a verify pass over s + 1 tokens,
both from the planner's cost model (offload/plan/pass_costs.py), with the reads the ring lets
run during the draft hidden. The predicted best size maximises gain over seconds; TreeBudget
starts there and measured passes refine it.

The acceptance prior is a constant per draft kind (conservative: a good draft beats it
quickly), or what earlier runs of the same pair learned (learned.py).
"""

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.writer import PackSizes, pack_sizes
from tierflow.offload.plan.pass_costs import PassCosts
from tierflow.offload.plan.planner import ProfileSource
from tierflow.offload.plan.probe import read_profile
from tierflow.offload.plan.profile import profile_path
from tierflow.runtime.loading.loader import GpuTier, LoadedModel, model_profile
from tierflow.runtime.loading.overhead import shape_key
from tierflow.speculative.learned import Learned, LearnedStore

# Acceptance priors per kind of draft, conservative (passes soon replace them): the chance the target
# takes prompt lookup's next guess (a chain: one candidate), and for a draft model the chance it
# takes the first candidate, then another given it took none before.
NGRAM_TAKEN = 0.4
OTHER_MODEL_RATES = (0.7, 0.2)  # a smaller model with the vocabulary (Sequoia measures 0.6-0.8 for the first)
SAME_MODEL_RATES = (0.9, 0.2)  # a conversion of the target itself (its shapes): mostly the target's picks
MIN_REACH = 0.01  # ModelDraft's: a node less likely than this to be reached is not proposed


@dataclass(frozen=True)
class SizePredictions:
    """Per tree size: predicted tokens per pass and seconds per pass (draft and verify)."""

    gained: dict[int, float]
    seconds: dict[int, float]

    def rate(self, size: int) -> float:
        """Predicted tokens/s at `size`."""
        return self.gained[size] / self.seconds[size]

    @property
    def best(self) -> int:
        return max(self.gained, key=self.rate)


def grown_tree(taken: np.ndarray, size: int, min_reach: float = MIN_REACH) -> tuple[float, list[int]]:
    """The tree ModelDraft grows with `size` guesses when the target takes a node's r-th
    candidate with chance taken[r]: its expected accepted guesses and its level widths."""
    frontier, expected, widths, room = [1.0], 0.0, [], size
    while room > 0:
        level = sorted((reach * p for reach in frontier for p in taken if reach * p >= min_reach),
                       reverse=True)[:room]
        if not level:
            break
        widths.append(len(level))
        expected += sum(level)
        room -= len(level)
        frontier = level
    return expected, widths


def predict_sizes(sizes: Sequence[int], taken: np.ndarray, verify: PassCosts,
                  draft_pass: Callable[[int], float] | None) -> SizePredictions:
    """Predictions for each size, for a draft whose candidates the target takes with chance
    taken[r] by rank, and whose pass over n tokens costs draft_pass(n) (None: prompt lookup,
    which costs nothing and proposes whatever it finds, however unlikely)."""
    gained, seconds = {}, {}
    min_reach = MIN_REACH if draft_pass is not None else 0.0
    for size in sizes:
        expected, widths = grown_tree(taken, size, min_reach)
        draft_s = 0.0
        if draft_pass is not None and size:
            # the tokens new since the last pass, then every level that has children
            draft_s = draft_pass(1) + sum(draft_pass(width) for width in widths[:-1])
        gained[size] = 1.0 + expected
        seconds[size] = verify.seconds(1 + sum(widths), between_s=draft_s)
    return SizePredictions(gained, seconds)


def calibrated(predicted: dict[int, float], measured: dict[int, float]) -> dict[int, float]:
    """The predicted seconds per size scaled by the median ratio of measured to predicted over the
    sizes measured (1 with none): a machine slower than its profile is slower at every size, while
    the curve's shape stays the cost model's."""
    ratios = [t / predicted[s] for s, t in measured.items() if predicted.get(s, 0) > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    return {s: scale * t for s, t in predicted.items()}


def ngram_taken() -> np.ndarray:
    return np.array([NGRAM_TAKEN])


@dataclass(frozen=True)
class SpeculationPrior:
    """What sizes the first passes of a (target, draft) pair: the predicted costs of a verify
    pass and of a draft pass (verify None: not predicted, the machine was never profiled), and
    what earlier runs of the pair learned, kept in `store`."""

    verify: PassCosts | None
    draft_pass: Callable[[int], float] | None
    store: LearnedStore
    learned: Learned | None
    rates: tuple[float, float] = OTHER_MODEL_RATES  # a draft model's acceptance prior

    def sizes(self, sizes: Sequence[int], taken: np.ndarray) -> SizePredictions | None:
        """Predictions for each size: the tokens per pass learned where there are some, else the
        prior's; the cost model's seconds scaled by the median ratio of the learned seconds to
        them (the machine's speed under this placement: the curve's shape stays the cost model's,
        so one size timed while the machine was busy does not decide the next load's first trees).
        Without a profile, what was learned alone, if it covers every size; else None."""
        learned = self.learned or Learned()
        if self.verify is None:
            if not all(s in learned.gained and s in learned.seconds for s in sizes):
                return None
            return SizePredictions(dict(learned.gained), dict(learned.seconds))
        predicted = predict_sizes(sizes, taken, self.verify, self.draft_pass)
        seconds = calibrated(predicted.seconds, learned.seconds)
        return SizePredictions(predicted.gained | learned.gained, seconds)

    def save(self, gained: dict[int, float], seconds: dict[int, float],
             ranks: tuple[list[float], list[float]] | None) -> None:
        """Keeps what this run measured beside what earlier runs did, for the pair's next load."""
        learned = self.learned or Learned()
        taken, tries = ranks if ranks is not None else (learned.rank_taken, learned.rank_tries)
        self.store.save(Learned(learned.gained | gained, learned.seconds | seconds, learned.other_seconds,
                                list(taken), list(tries)))


def speculation_prior(target: LoadedModel, sizes: PackSizes, profile: ProfileSource, threads: int,
                      gpu: GpuTier, draft: LoadedModel | None, shape: str) -> SpeculationPrior:
    """The prior of a loaded target (its pack's `sizes`) and draft (None: prompt lookup) of
    `shape` ("tree" or "chain"). The costs are predicted only where the machine has a profile: a
    load whose plan did not need one does not measure it for this (the first passes then start
    from fixed sizes, as before)."""
    plan = target.plan
    placement = (f"{threads} threads; target gpu {plan.gpu_layers}, streamed {plan.streamed_layers}, "
                 f"depth {plan.prefetch_depth}, kv {plan.kv_type}{' on cpu' if plan.kv_on_cpu else ''}; "
                 f"draft gpu {draft.plan.gpu_layers if draft is not None else ()}")
    store = LearnedStore(target.path, None if draft is None else draft.path, shape, placement)
    same_model = draft is not None and (shape_key(draft.config), draft.config.num_layers) == (
        shape_key(target.config), target.config.num_layers)
    rates = SAME_MODEL_RATES if same_model else OTHER_MODEL_RATES
    if target.plan.decode is None and read_profile(profile_path(threads)) is None:
        return SpeculationPrior(None, None, store, store.load(), rates)
    verify = PassCosts(target.plan, target.config, sizes, profile() if callable(profile) else profile)
    draft_pass = None
    if draft is not None:
        with open_model_file(draft.path) as opened:
            draft_costs = PassCosts(draft.plan, draft.config, pack_sizes(opened),
                                    model_profile(opened, threads, gpu))
        draft_pass = draft_costs.seconds
    return SpeculationPrior(verify, draft_pass, store, store.load(), rates)
