"""Which of a token tree's guesses the target accepts, so that the output is the target's own.

Greedy: a guess is accepted when it is the token the target picks itself, so the output is the
target's greedy output token for token.

Sampled: recursive rejection sampling without replacement (as in SpecInfer, Sequoia and
"Recursive Speculative Decoding"). At a node whose children c1, c2, ... were drawn without
replacement from the draft's distribution q, and p is the target's:

    accept c_i with probability min(1, p(c_i) / q(c_i));
    on rejection  p <- normalise(max(p - q, 0))    (what p still owes beyond what q covered)
                  q <- normalise(q with c_i removed) (the distribution c_{i+1} was drawn from);
    when every child is rejected, draw the next token from what is left of p.

Each step emits a token distributed as p (the one-candidate argument of Leviathan et al.,
applied to the updated pair), so the tokens follow the target's distribution exactly, whatever
the draft. A deterministic guess (prompt lookup) is the case q = one point: it is accepted with
probability p(guess), and otherwise the token is drawn from p without the guess.
"""

from collections.abc import Sequence

import numpy as np

from tierflow.runtime.sampling.sampler import Sampler
from tierflow.speculative.tree import TokenTree


def accept_tree(tree: TokenTree, rows: np.ndarray, sampler: Sampler,
                history: Sequence[int]) -> tuple[list[int], int]:
    """Walks the tree from the root with the target's logits rows [len(tree), V] (row i: after
    node i). Returns the accepted path (node indices from the root, root included) and the
    target's next token after it. history ends with the root's token."""
    path = [0]
    while True:
        node = path[-1]
        context = [*history, *tree.path_tokens(node)]
        children = tree.children(node)
        if sampler.greedy:
            token = sampler.sample(rows[node], context)
            accepted = next((c for c in children if tree.tokens[c] == token), None)
        else:
            p = sampler.distribution(rows[node], context)
            accepted, p = _rejection_sample(p, tree.draft_probs.get(node), children, tree.tokens,
                                            sampler.rng)
            token = None if accepted is not None else int(sampler.rng.choice(len(p), p=p))
        if accepted is None:
            return path, token
        path.append(accepted)


def _rejection_sample(p: np.ndarray, q: np.ndarray | None, children: list[int], tokens: list[int],
                      rng: np.random.Generator) -> tuple[int | None, np.ndarray]:
    """The first child accepted (or None) and the target's distribution left after the
    rejections."""
    if children and q is None:
        raise ValueError("a sampled tree needs the draft's distribution at every node with children")
    for child in children:
        token = tokens[child]
        if rng.random() * q[token] < p[token]:  # probability min(1, p / q)
            return child, p
        residual = np.maximum(p - q, 0.0)
        if residual.sum() > 0:  # zero only when p == q, where the guess was accepted surely
            p = residual / residual.sum()
        q = q.copy()
        q[token] = 0.0
        if q.sum() > 0:
            q /= q.sum()
    return None, p
