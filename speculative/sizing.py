"""How big the next token tree should be: hardware-aware sizing from measured costs (Sequoia).

A verify pass over n tokens costs about what a pass over one does while the target is
memory-bound or streamed, and grows once it turns compute-bound; a draft's cost grows with the
tree. So the budget that gives the most tokens per second depends on the machine and the text:
TreeBudget keeps, for each size tried, moving averages of the tokens a pass gained (accepted
guesses plus the target's own token) and of the seconds it took (draft plus verify), and picks
the size with the best ratio. The neighbours of the best size are tried as soon as they are
unmeasured (so it climbs or descends quickly; not while the best gains what a prior predicted,
whose estimates then stand in for them), then again every few passes (less often
while that changes nothing) so the estimates around it stay current. Size 0 is a plain decode
step: where no draft pays, speculation all but switches itself off.

Before a size is measured, a prior may stand in for it (`seed`: the cost model's predictions and
an acceptance prior, speculative/first_sizes.py, or what earlier runs of the pair measured): the
first pass then goes to the size predicted best rather than a fixed one. A measured size's
seconds replace the prior's at once, and the prior's seconds of the sizes not yet measured are
scaled by how far off it was at the measured ones (a machine slower than profiled is slower at
every size). Its tokens per pass count for 1 - FIRST_PASS_WEIGHT beside the first pass's (one
pass's acceptance is a noisy sample), then fade as the moving average goes on.
"""

from tierflow.speculative.first_sizes import SizePredictions, calibrated

SIZES = (0, 1, 2, 4, 8, 16, 32, 64)  # 0: no guesses, a plain decode step (the draft does not run)
SMOOTHING = 0.3  # weight of the newest pass in the moving averages
EXPLORE_EVERY = 4  # passes between tries of a neighbouring size, doubling while they change nothing
MAX_EXPLORE_EVERY = 32
FIRST_PASS_WEIGHT = 0.7  # of a size's first measured pass beside its prior's tokens per pass


class TreeBudget:
    def __init__(self, max_size: int, start: int = 8, fixed: bool = False):
        """fixed: always max_size (no sizing)."""
        self.sizes = [max_size] if fixed else [s for s in SIZES if s <= max_size]
        self.start = start
        self.current = min(self.sizes, key=lambda s: abs(s - start))
        self.gained: dict[int, float] = {}  # size -> tokens per pass
        self.seconds: dict[int, float] = {}  # size -> seconds per pass
        self._since_explored = 0
        self._explore_every = EXPLORE_EVERY
        self._best_when_explored: int | None = None
        self._explore_up = False
        self.prior: SizePredictions | None = None

    def seed(self, prior: SizePredictions) -> None:
        """Estimates for the sizes not measured yet; the next pass goes to the best of them."""
        self.prior = SizePredictions({s: prior.gained[s] for s in self.sizes},
                                     {s: prior.seconds[s] for s in self.sizes})
        self.current = self.prior.best

    def next(self, timed: bool = True) -> int:
        """The tree size (guesses, the root not counted) for the next pass. timed=False sizes by
        acceptance alone, which is deterministic (a seeded sampled generation must not depend on
        the machine's timings): the largest size whose passes gained at least half their
        guesses' worth, else the smallest."""
        best = self._best(timed)
        if self._best_when_explored is not None:  # the last try of a neighbour is in
            unchanged = best == self._best_when_explored
            longer = min(2 * self._explore_every, MAX_EXPLORE_EVERY)
            self._explore_every = longer if unchanged else EXPLORE_EVERY
            self._best_when_explored = None
        i = self.sizes.index(best)
        up, down = self.sizes[min(i + 1, len(self.sizes) - 1)], self.sizes[max(i - 1, 0)]
        self._since_explored += 1
        if best not in self.gained:  # the start, or the prior's best: measured first
            self.current = best
        elif (up not in self.gained or down not in self.gained) and not self._prior_held(best):
            # each neighbour of the best is tried at once, unless a prior borne out stands in for them
            self.current = up if up not in self.gained else down
        elif self._since_explored >= self._explore_every:  # the next size up and down in turn
            self._explore_up = not self._explore_up
            self.current = up if self._explore_up else down
            self._since_explored, self._best_when_explored = 0, best
        else:
            self.current = best
        return self.current

    def update(self, size: int, accepted: int, seconds: float) -> None:
        """A pass asked for `size` guesses took `seconds` and the target accepted `accepted`."""
        bucket = min(self.sizes, key=lambda s: abs(s - size))
        gained = accepted + 1.0
        if bucket not in self.gained and self.prior is not None:
            gained = FIRST_PASS_WEIGHT * gained + (1 - FIRST_PASS_WEIGHT) * self.prior.gained[bucket]
        for table, value in ((self.gained, gained), (self.seconds, seconds)):
            old = table.get(bucket)
            table[bucket] = value if old is None else (1 - SMOOTHING) * old + SMOOTHING * value
        self.current = bucket

    def _best(self, timed: bool) -> int:
        if not timed:
            if not self.gained:
                return self.current
            good = [s for s in self.gained if self.gained[s] - 1 >= s / 2]
            return max(good) if good else min(self.gained)
        estimates = self._estimates()
        if not estimates:
            return self.current
        return max(estimates, key=lambda s: estimates[s][0] / estimates[s][1])

    def _prior_held(self, size: int) -> bool:
        """Whether the passes of `size` gained at least the tokens the prior predicted (the draft
        is as good as it assumed): its estimates of the other sizes (their seconds calibrated by
        the measured ones) are then trusted until the periodic tries."""
        return self.prior is not None and self.gained[size] >= self.prior.gained[size]

    def _estimates(self) -> dict[int, tuple[float, float]]:
        """size -> (tokens per pass, seconds per pass): measured, else the prior's (its seconds
        scaled by the median ratio of measured to prior seconds)."""
        estimates = {s: (self.gained[s], self.seconds[s]) for s in self.gained}
        if self.prior is None:
            return estimates
        seconds = calibrated(self.prior.seconds, self.seconds)
        return estimates | {s: (self.prior.gained[s], seconds[s]) for s in self.sizes if s not in self.gained}
