"""How sure a prediction must be for an expert tier to fetch it ahead: chosen by what tokens cost.

A prefetch that proves right has its read done under compute; a wrong one reads an expert for
nothing, and where the reads are what a token waits for (a disk slower than the compute, or the
copies to the GPU) that read delays the demand reads behind it. Which wins depends on the machine,
the model and its routing, so the gate measures instead of guessing: for each threshold on the
predictor's confidence (0: every prediction, as far as the cache admits it; above 1: none), a
moving average of what a decode token cost while it was in force; it keeps the cheapest.

A token's cost is counted, not timed: the bytes its layers fetched (demand reads and reads ahead,
right or wrong) plus the bytes of the reads its compute had to wait for. A wrong guess costs its
bytes; a right one turns a read the compute would have waited for into one done under compute,
saving its bytes once; so a threshold pays where its guesses are right more often than not, and
the disk's speed, which only scales both, does not enter. Wall time would: it varies 2x between
identical tokens on a shared machine, more than the choice it is meant to inform.

The gate starts where nothing is read ahead, and a token under that threshold makes no prediction
either (the early router and the affinity tables cost a streamed decode token 15% of its time on
two cores, for nothing when no guess is read): a fresh engine's first tokens read no wrong guess,
and the thresholds below are tried as the cost of each proves itself. Each unmeasured neighbour of
the best is tried at once, and after that a neighbour (the one above and the one below in turn)
every EXPLORE_EVERY tokens, so the averages near the best stay current
as the text and the cache's contents change. A threshold, once chosen, stays for TRIAL tokens: how
many experts a token misses varies with its routing, and one token says little. Prefetching changes
only what is read when, never a token's result.
"""

THRESHOLDS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.01)  # the last fetches nothing ahead
NOTHING_AHEAD = len(THRESHOLDS) - 1
SMOOTHING = 0.25  # weight of the newest token in the moving averages
EXPLORE_EVERY = 16  # decode tokens between tries of a neighbouring threshold
TRIAL = 4  # decode tokens a threshold stays in force once chosen


class PrefetchGate:
    def __init__(self, start: int = NOTHING_AHEAD, fixed: bool = False):
        """start: the index in THRESHOLDS of the first threshold in force; fixed: it stays (for
        comparisons), only measured."""
        self.current, self.fixed = start, fixed
        self.costs: dict[int, float] = {}  # threshold index -> cost (bytes) per decode token
        self._tokens = 0
        self._trial_left = TRIAL
        self._explore_up = False

    @property
    def threshold(self) -> float:
        """The least confidence a prediction needs to be fetched ahead now."""
        return THRESHOLDS[self.current]

    @property
    def reads_ahead(self) -> bool:
        """Whether any prediction is fetched ahead now (if not, none need be made)."""
        return self.current != NOTHING_AHEAD

    @property
    def best(self) -> float:
        """The threshold of the cheapest tokens measured so far (the first one before any)."""
        return THRESHOLDS[min(self.costs, key=self.costs.get) if self.costs else self.current]

    def update(self, cost: float) -> None:
        """A decode token cost `cost` (bytes fetched and waited for) under the current threshold;
        sets the next one."""
        old = self.costs.get(self.current)
        self.costs[self.current] = cost if old is None else (1 - SMOOTHING) * old + SMOOTHING * cost
        self._tokens += 1
        self._trial_left -= 1
        if self.fixed or self._trial_left > 0:
            return
        self._trial_left = TRIAL
        best = min(self.costs, key=self.costs.get)
        neighbours = [i for i in (best - 1, best + 1) if 0 <= i < len(THRESHOLDS)]
        unmeasured = [i for i in neighbours if i not in self.costs]
        if unmeasured:
            self.current = unmeasured[0]
        elif self._tokens % EXPLORE_EVERY == 0:
            self._explore_up = not self._explore_up
            self.current = neighbours[-1] if self._explore_up else neighbours[0]
        else:
            self.current = best
