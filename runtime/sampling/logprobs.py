"""Per-token log-probabilities, as `logprobs=True, top_logprobs=N` asks for them.

The values are the Sampler's (runtime/sampling/sampler.py): the log-softmax of the model's logits after the
logit bias and penalties, before temperature and the top-k/top-p/min-p cut, at the position where
the token was picked.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierflow.runtime.sampling.sampler import top_k_candidates


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    bytes: bytes  # the token's piece: may be part of a UTF-8 character
    logprob: float
    top: tuple["TokenLogprob", ...] = ()  # the most likely tokens at its position, most likely first

    @property
    def text(self) -> str:
        return self.bytes.decode("utf-8", errors="replace")


def token_logprob(row: np.ndarray, token: int, num_top: int,
                  token_bytes: Callable[[int], bytes]) -> TokenLogprob:
    """The token's entry from the log-probabilities row [V] of its position, with its num_top
    likeliest alternatives (ties by lower id)."""
    top = top_k_candidates(row, num_top) if num_top else ()
    alternatives = tuple(TokenLogprob(int(i), token_bytes(int(i)), float(row[i])) for i in top)
    return TokenLogprob(token, token_bytes(token), float(row[token]), alternatives)
