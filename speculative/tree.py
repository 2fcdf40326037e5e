"""Token trees: a draft's guesses at what comes next, verified by the target in one pass."""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TokenTree:
    """Node 0 is the root, the token just sampled (not yet in the target's cache); every other
    node is a guess at the token after its parent. Nodes come after their parents, and a node's
    children in the order the draft proposed them: for a sampled tree, the order they were drawn
    without replacement from draft_probs[parent], which the acceptance rule relies on."""

    tokens: list[int]
    parents: list[int]
    draft_probs: dict[int, np.ndarray] = field(default_factory=dict)  # node -> [V], sampled trees

    @classmethod
    def root(cls, token: int) -> "TokenTree":
        return cls([token], [-1])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self.parents)) if self.parents[i] == node]

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from the root's child down to node."""
        tokens = []
        while node > 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]
