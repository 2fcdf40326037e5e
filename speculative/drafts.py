"""Drafts: what proposes the token tree the target verifies.

Two kinds, one interface (`propose`, then `accepted` with the path the target took):
- NgramDraft: prompt lookup, a chain of the tokens that followed the context's last few tokens
  the last time they occurred (ngram.py). Costs nothing to run.
- ModelDraft: a smaller model with the target's vocabulary (another GGUF, or the target's own
  low-bit conversion), run ahead of the target with its own KV cache. It grows a tree level by
  level, SpecExec-style: each level's nodes go to the draft in one batched tree pass, and the
  level's budget goes to the children with the highest probability of being reached (the draft's
  probability of their path). For a sampled tree, how many children a node gets is decided from
  its distribution before they are drawn, and they are drawn without replacement, which is what
  the acceptance rule (acceptance.py) needs to stay exact.
"""

import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np

from tierflow.runtime.generation import TokenGenerator
from tierflow.runtime.sampler import Sampler, softmax
from tierflow.speculative.ngram import DraftLength, propose
from tierflow.speculative.tree import TokenTree

NEVER = threading.Event()  # the target's generation loop checks cancellation between passes


class NgramDraft:
    def __init__(self, vocab_size: int, max_draft: int):
        self.vocab_size = vocab_size
        self.length = DraftLength(max_draft)

    def fresh(self) -> "NgramDraft":
        return NgramDraft(self.vocab_size, self.length.maximum)

    def propose(self, history: Sequence[int], budget: int, sampler: Sampler) -> TokenTree:
        tree, node = TokenTree.root(history[-1]), 0
        for guess in propose(list(history), min(budget, self.length.next())):
            if not sampler.greedy:  # a certain guess: q is one point
                tree.draft_probs[node] = np.zeros(self.vocab_size)
                tree.draft_probs[node][guess] = 1.0
            node = tree.add(node, guess)
        return tree

    def accepted(self, tree: TokenTree, path: list[int]) -> None:
        if len(tree) > 1:
            self.length.update(len(tree) - 1, len(path) - 1)


class ModelDraft:
    """A draft model's token generator (its own decoder and KV cache)."""

    def __init__(self, generator: TokenGenerator, max_width: int = 4, min_reach: float = 0.02):
        self.generator = generator
        self.max_width = max_width  # children per node at most (1: a chain)
        self.min_reach = min_reach  # a child less likely than this to be reached is not proposed
        self._root_slot = 0
        self._fed = 0  # tree nodes in the draft's cache (the last level never is)

    def fresh(self) -> "ModelDraft":
        return self  # its only state, the cache, gives the same bits whatever it holds

    def propose(self, history: Sequence[int], budget: int, sampler: Sampler) -> TokenTree:
        generator, tree = self.generator, TokenTree.root(history[-1])
        logits, _ = generator.prefill(list(history), NEVER)  # reuses what the cache holds
        self._root_slot, self._fed = len(history) - 1, 1
        frontier, reach = {0: logits[None]}, {0: 1.0}
        while len(tree) - 1 < budget:
            dists = {node: self._distribution(rows[-1], [*history, *tree.path_tokens(node)], sampler)
                     for node, rows in frontier.items()}
            counts = self._allocate(dists, reach, budget - (len(tree) - 1))
            if not counts:
                break
            level = []
            for node, count in sorted(counts.items()):
                q = dists[node]
                if not sampler.greedy:
                    tree.draft_probs[node] = q
                for token in _draw(q, count, None if sampler.greedy else sampler.rng):
                    child = tree.add(node, int(token))
                    reach[child] = reach[node] * q[token]
                    level.append(child)
            if len(tree) - 1 >= budget:
                break
            rows = generator.verify_tree([tree.tokens[c] for c in level], tree.parents, self._root_slot)
            self._fed = len(tree)
            frontier = {child: rows[i:i + 1] for i, child in enumerate(level)}
        return tree

    def accepted(self, tree: TokenTree, path: list[int]) -> None:
        """Keeps the accepted path's nodes that the draft has seen, forgets the other branches."""
        self.generator.keep_path(self._root_slot, [node for node in path if node < self._fed])

    def _distribution(self, logits: np.ndarray, context: list[int], sampler: Sampler) -> np.ndarray:
        if sampler.greedy:  # guesses are matched against the target's choice: rank by the draft's
            return softmax(logits.astype(np.float64))
        return sampler.distribution(logits, context)  # the children are drawn from this

    def _allocate(self, dists: dict[int, np.ndarray], reach: dict[int, float], room: int) -> Counter:
        """Children per frontier node: the `room` best (node, rank) pairs by the chance that the
        rank-th child is reached, from the node's distribution alone (not from what is drawn)."""
        pairs = []
        for node, q in dists.items():
            top = -np.partition(-q, self.max_width)[: self.max_width] if q.size > self.max_width else q
            pairs += [(reach[node] * prob, node) for prob in top if reach[node] * prob >= self.min_reach]
        pairs.sort(reverse=True)
        return Counter(node for _, node in pairs[:room])


def _draw(q: np.ndarray, count: int, rng: np.random.Generator | None) -> np.ndarray:
    """The count most probable tokens of q (rng None), or count tokens drawn from q without
    replacement (Gumbel-top-k), in the order drawn."""
    keys = np.log(q, out=np.full_like(q, -np.inf), where=q > 0)
    if rng is not None:
        keys = keys + rng.gumbel(size=q.shape)
    count = min(count, int(np.count_nonzero(q)))
    top = np.argpartition(-keys, count - 1)[:count]
    return top[np.argsort(-keys[top], kind="stable")]
