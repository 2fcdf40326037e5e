"""How big the next token tree should be: hardware-aware sizing from measured costs (Sequoia).

A verify pass over n tokens costs about what a pass over one does while the target is
memory-bound or streamed, and grows once it turns compute-bound; a draft's cost grows with the
tree. So the budget that gives the most tokens per second depends on the machine and the text:
TreeBudget keeps, for each size tried, moving averages of the tokens a pass gained (accepted
guesses plus the target's own token) and of the seconds it took (draft plus verify), and picks
the size with the best ratio. It climbs to the next larger size while the best is the largest
tried, and tries a neighbouring size every few passes so the estimates around it stay current.
"""

SIZES = (1, 2, 4, 8, 16, 32, 64)
SMOOTHING = 0.3  # weight of the newest pass in the moving averages
EXPLORE_EVERY = 4  # passes between tries of a neighbouring size


class TreeBudget:
    def __init__(self, max_size: int, start: int = 8):
        self.sizes = [s for s in SIZES if s <= max_size] or [max_size]
        self.start = start
        self.current = min(self.sizes, key=lambda s: abs(s - start))
        self.gained: dict[int, float] = {}  # size -> tokens per pass
        self.seconds: dict[int, float] = {}  # size -> seconds per pass
        self._passes = 0

    def next(self, timed: bool = True) -> int:
        """The tree size (guesses, the root not counted) for the next pass. timed=False sizes by
        acceptance alone, which is deterministic (a seeded sampled generation must not depend on
        the machine's timings): the largest size whose passes gained at least half their
        guesses' worth, else the smallest."""
        self._passes += 1
        best = self._best(timed)
        i = self.sizes.index(best)
        up, down = self.sizes[min(i + 1, len(self.sizes) - 1)], self.sizes[max(i - 1, 0)]
        if up not in self.gained:  # climb while the best is the largest tried
            i = self.sizes.index(up)
        elif self._passes % EXPLORE_EVERY == 0:  # alternately the next size up and down
            i = self.sizes.index(up if (self._passes // EXPLORE_EVERY) % 2 else down)
        self.current = self.sizes[i]
        return self.current

    def update(self, size: int, accepted: int, seconds: float) -> None:
        bucket = min(self.sizes, key=lambda s: abs(s - size))
        for table, value in ((self.gained, accepted + 1.0), (self.seconds, seconds)):
            old = table.get(bucket)
            table[bucket] = value if old is None else (1 - SMOOTHING) * old + SMOOTHING * value
        self.current = bucket

    def _best(self, timed: bool) -> int:
        if not self.gained:
            return self.current
        if not timed:
            good = [s for s in self.gained if self.gained[s] - 1 >= s / 2]
            return max(good) if good else min(self.gained)
        return max(self.gained, key=lambda s: self.gained[s] / self.seconds[s])
