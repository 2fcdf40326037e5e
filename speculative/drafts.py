"""Drafts: what proposes the token tree the target verifies.

Two kinds, one interface (`propose`, then `accepted` with the path the target took):
- NgramDraft: prompt lookup, a chain of the tokens that followed the context's last few tokens
  the last time they occurred (ngram.py). Costs nothing to run.
- ModelDraft: a smaller model with the target's vocabulary (another GGUF, or the target's own
  low-bit conversion), run ahead of the target with its own KV cache. It grows a tree level by
  level, SpecExec-style: each level's nodes go to the draft in one batched tree pass, and the
  level's budget goes to the children with the highest chance of being reached. That chance is
  Sequoia's positional estimate: how often the target has taken the draft's first, second, ...
  candidate, measured as it goes (the draft's own probabilities understate a good draft: a
  draft whose favourite has probability 0.4 can still be the target's choice 90% of the time).
  How many children a node gets is thus decided before they are drawn, and a sampled tree's
  are drawn without replacement, which is what the acceptance rule (acceptance.py) needs to
  stay exact.
"""

import contextlib
import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np

from tierflow.runtime.generation.token_loop import TokenGenerator
from tierflow.runtime.sampling.sampler import Sampler
from tierflow.speculative.first_sizes import MIN_REACH, OTHER_MODEL_RATES
from tierflow.speculative.ngram import DraftLength, continuations
from tierflow.speculative.tree import TokenTree

NEVER = threading.Event()  # the target's generation loop checks cancellation between passes


class NgramDraft:
    BRANCHES = 4  # continuations of different earlier occurrences in one greedy tree

    def __init__(self, vocab_size: int, max_draft: int):
        self.vocab_size = vocab_size
        self.length = DraftLength(max_draft)
        self.turn = contextlib.nullcontext()  # no state of its own between propose and accepted

    def fresh(self) -> "NgramDraft":
        return NgramDraft(self.vocab_size, self.length.maximum)

    def propose(self, history: Sequence[int], budget: int, sampler: Sampler,
                target: TokenGenerator | None = None) -> TokenTree:
        """Greedy: a tree of the continuations of up to BRANCHES earlier occurrences, within
        the budget. Sampled: the latest one's chain, each guess a certain draft (q one point;
        a second candidate at a node would need a distribution to be drawn from)."""
        tree, length = TokenTree.root(history[-1]), min(budget, self.length.next())
        found = continuations(list(history), length, self.BRANCHES if sampler.greedy else 1)
        for guesses in found:
            node = 0
            for guess in guesses:
                if len(tree) - 1 >= min(budget, self.length.maximum):
                    return tree
                if not sampler.greedy:
                    tree.draft_probs[node] = np.zeros(self.vocab_size)
                    tree.draft_probs[node][guess] = 1.0
                child = next((c for c in tree.children(node) if tree.tokens[c] == guess), None)
                node = tree.add(node, guess) if child is None else child
        return tree

    def accepted(self, tree: TokenTree, path: list[int]) -> None:
        if len(tree) > 1:
            self.length.update(self._depth(tree), len(path) - 1)

    @staticmethod
    def _depth(tree: TokenTree) -> int:
        return max(len(tree.path_tokens(node)) for node in range(len(tree)))


class ModelDraft:
    """A draft model's token generator (its own decoder and KV cache). Generations running together
    share it and take turns (`turn`, held from propose to accepted): its cache holds one history."""

    def __init__(self, generator: TokenGenerator, max_width: int = 4, min_reach: float = MIN_REACH,
                 turn: "threading.Lock | None" = None, rates: tuple[float, float] = OTHER_MODEL_RATES,
                 learned: tuple[list[float], list[float]] | None = None):
        self.generator = generator
        self.turn = threading.Lock() if turn is None else turn
        self.max_width = max_width  # children per node at most (1: a chain)
        self.min_reach = min_reach  # a child less likely than this to be reached is not proposed
        self.rates = rates  # the acceptance prior of this kind of draft
        self.ranks = RankAcceptance(max_width, rates, learned)
        self._root_slot = 0
        self._fed = 0  # tree nodes in the draft's cache (the last level never is)

    def fresh(self) -> "ModelDraft":
        """The same model and cache (which give the same bits whatever they hold) with the
        counts of which candidates were taken started over, from the prior of its kind."""
        return ModelDraft(self.generator, self.max_width, self.min_reach, self.turn, self.rates)

    def propose(self, history: Sequence[int], budget: int, sampler: Sampler,
                target: TokenGenerator | None = None) -> TokenTree:
        """The tree for the tokens after history (target: the sequence's generator, which only
        the MTP draft reads)."""
        generator, tree = self.generator, TokenTree.root(history[-1])
        logits, _ = generator.prefill(list(history), NEVER)  # reuses what the cache holds
        self._root_slot, self._fed = len(history) - 1, 1
        frontier, reach = {0: logits}, {0: 1.0}  # node -> the draft's logits after it
        while len(tree) - 1 < budget:
            counts = self._allocate(list(frontier), reach, budget - (len(tree) - 1))
            if not counts:
                break
            level, taken = [], self.ranks.probabilities()
            for node, count in sorted(counts.items()):
                for rank, token in enumerate(self._candidates(tree, node, frontier[node], count, history,
                                                              sampler)):
                    child = tree.add(node, int(token))
                    reach[child] = reach[node] * taken[rank]
                    level.append(child)
            if len(tree) - 1 >= budget:
                break
            rows = generator.verify_tree([tree.tokens[c] for c in level], tree.parents, self._root_slot)
            self._fed = len(tree)
            frontier = dict(zip(level, rows))
        return tree

    def accepted(self, tree: TokenTree, path: list[int]) -> None:
        """Keeps the accepted path's nodes that the draft has seen, forgets the other branches,
        and counts which candidate the target took at each node on the path."""
        self.generator.keep_path(self._root_slot, [node for node in path if node < self._fed])
        for i, node in enumerate(path):
            children = tree.children(node)
            taken = children.index(path[i + 1]) if i + 1 < len(path) else None
            self.ranks.record(len(children), taken)

    def _candidates(self, tree: TokenTree, node: int, logits: np.ndarray, count: int, history: Sequence[int],
                    sampler: Sampler) -> np.ndarray:
        """The node's children: for greedy output the draft's count likeliest tokens (the target
        will pick one token; the best guesses are the draft's favourites); for sampled output
        count tokens drawn without replacement from the draft's distribution, which the tree
        keeps for the acceptance rule."""
        if sampler.greedy:
            if sampler.constraint is not None:  # a guess the grammar forbids could only be rejected
                logits = sampler.scores(logits, [*history, *tree.path_tokens(node)])
                count = min(count, int(np.count_nonzero(logits > -np.inf)))
            top = np.argpartition(-logits, count - 1)[:count]
            return top[np.argsort(-logits[top], kind="stable")]
        q = sampler.distribution(logits, [*history, *tree.path_tokens(node)])
        tree.draft_probs[node] = q
        return _draw(q, count, sampler.rng)

    def _allocate(self, frontier: list[int], reach: dict[int, float], room: int) -> Counter:
        """Children per frontier node: the `room` best (node, rank) pairs by the chance that the
        node's rank-th child is reached (never by what is drawn)."""
        taken = self.ranks.probabilities()
        pairs = [(reach[node] * p, node) for node in frontier for p in taken]
        pairs = [pair for pair in pairs if pair[0] >= self.min_reach]
        pairs.sort(reverse=True)
        return Counter(node for _, node in pairs[:room])


class RankAcceptance:
    """How often the target takes a node's r-th candidate, given it took none before it
    (counted from the passes so far, starting from a prior: `rates` (the first candidate's, the
    others') counted as PRIOR_TRIES passes, or the counts an earlier run of the same pair learned)."""

    PRIOR_TRIES = 2.0

    def __init__(self, max_width: int, rates: tuple[float, float] = OTHER_MODEL_RATES,
                 learned: tuple[list[float], list[float]] | None = None):
        if learned is not None and len(learned[0]) == len(learned[1]) == max_width:
            self.taken, self.tries = np.array(learned[0]), np.array(learned[1])
            if np.all(self.tries > 0) and np.all(self.taken <= self.tries):
                return
        self.taken = np.array([rates[min(r, 1)] * self.PRIOR_TRIES for r in range(max_width)])
        self.tries = np.full(max_width, self.PRIOR_TRIES)

    def record(self, num_children: int, taken: int | None) -> None:
        """A node with num_children candidates at which the target took the one at index taken
        (None: none of them)."""
        tried = num_children if taken is None else taken + 1
        self.tries[:tried] += 1
        if taken is not None:
            self.taken[taken] += 1

    def probabilities(self) -> np.ndarray:
        """[max_width]: the chance the target's token is a node's r-th candidate."""
        rate = self.taken / self.tries
        return rate * np.concatenate([[1.0], np.cumprod(1 - rate)[:-1]])


def _draw(q: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """count tokens drawn from q without replacement (Gumbel-top-k), in the order drawn."""
    keys = np.log(q, out=np.full_like(q, -np.inf), where=q > 0) + rng.gumbel(size=q.shape)
    count = min(count, int(np.count_nonzero(q)))
    top = np.argpartition(-keys, count - 1)[:count]
    return top[np.argsort(-keys[top], kind="stable")]
