"""Prompt lookup: a draft that costs nothing, proposed from the tokens already in the context.

Text often repeats what came before it (names, code, quoted passages, a model's own phrasing):
when the last few tokens occurred earlier, the tokens that followed them then are a good guess for
what follows now. The target model verifies the guesses in one pass; on tierflow's CPU kernels a
pass over 16 tokens of a small model costs about what a pass over one does (the weights are read
once either way), so every accepted guess is a token for free.
"""

import numpy as np


def propose(tokens: list[int], max_draft: int, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """Up to max_draft tokens that followed the latest earlier occurrence of the context's last
    n tokens, trying n = max_ngram down to min_ngram (one shared token predicts little); [] when
    none occurred."""
    found = continuations(tokens, max_draft, 1, max_ngram, min_ngram)
    return found[0] if found else []


def continuations(tokens: list[int], max_draft: int, max_count: int, max_ngram: int = 4,
                  min_ngram: int = 2) -> list[list[int]]:
    """Up to max_count different continuations (each up to max_draft tokens) of earlier
    occurrences of the context's last n tokens: longer matches first, later ones first within a
    length. Where text repeats with variations, the branches cover more than one guess can."""
    if max_draft < 1 or len(tokens) <= min_ngram:
        return []
    ids, found = np.asarray(tokens), []
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # starts 0 .. len - 1 - n
        for match in np.flatnonzero((windows == ids[-n:]).all(axis=1))[::-1]:
            guess = ids[match + n: match + n + max_draft].tolist()
            if guess and guess not in found:
                found.append(guess)
                if len(found) == max_count:
                    return found
    return found


class DraftLength:
    """How many guesses to verify next: doubles while every guess is accepted, shrinks to what
    was accepted (plus one) otherwise, and after a pass that accepted nothing, rests for a number
    of steps that doubles with each such pass in a row, so text that does not repeat costs almost
    no verify passes."""

    def __init__(self, maximum: int):
        self.maximum, self.length, self.rest, self._misses = maximum, min(4, maximum), 0, 0

    def next(self) -> int:
        if self.rest:
            self.rest -= 1
            return 0
        return self.length

    def update(self, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            self.length, self._misses = min(2 * self.length, self.maximum), 0
        elif accepted:
            self.length, self._misses = accepted + 1, 0
        else:
            self._misses += 1
            self.length, self.rest = 1, min(2 ** self._misses, 64)
