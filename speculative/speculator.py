"""One speculative step: the draft proposes a token tree, the target verifies it in one pass, the
accepted path and the target's next token come back; both models' caches keep only that path."""

import time
from collections.abc import Callable, Sequence

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.generation.stats import GenerationStats
from tierflow.runtime.generation.token_loop import TokenGenerator
from tierflow.runtime.sampling.sampler import Sampler
from tierflow.speculative.acceptance import accept_tree
from tierflow.speculative.drafts import ModelDraft, NgramDraft
from tierflow.speculative.first_sizes import OTHER_MODEL_RATES, SpeculationPrior, ngram_taken
from tierflow.speculative.sizing import TreeBudget
from tierflow.speculative.tree import TokenTree

MAX_GUESSES = 16  # prompt lookup's guesses per pass: 16 tokens cost about what 1 does here
MAX_TREE = 64  # a draft model's tree; TreeBudget finds the size that pays on this machine
MAX_CHAIN = 16


def check_draft_options(shape: str, tokens: int | None) -> None:
    """Refuses a draft shape other than "tree" or "chain", and a guess count out of range."""
    if shape not in ("tree", "chain"):
        raise InvalidArgumentError(f"draft_shape must be 'tree' or 'chain', not {shape!r}")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                               or not 1 <= tokens <= MAX_TREE):
        raise InvalidArgumentError(f"draft_tokens must be an integer from 1 to {MAX_TREE}, got {tokens!r}")


def make_speculator(draft_model: TokenGenerator | None, shape: str, tokens: int | None,
                    vocab_size: int, prior: SpeculationPrior | None = None) -> "Speculator":
    """Prompt lookup when there is no draft model, else the draft model's tree (or chain); sized by
    measured cost unless `tokens` fixes the guesses per pass, its first passes by `prior`."""
    learned = prior and prior.learned
    if draft_model is None:
        size = tokens or MAX_GUESSES
        draft, budget = NgramDraft(vocab_size, size), TreeBudget(size, start=4, fixed=tokens is not None)
        taken = ngram_taken()
    else:
        budget = model_budget(shape, tokens)
        draft = ModelDraft(draft_model, max_width=draft_width(shape),
                           rates=prior.rates if prior else OTHER_MODEL_RATES,
                           learned=learned and (learned.rank_taken, learned.rank_tries))
        taken = draft.ranks.probabilities()
    predicted = prior and tokens is None and prior.sizes(budget.sizes, taken)
    if predicted:
        budget.seed(predicted)
    return Speculator(draft, budget, prior=prior)


def draft_width(shape: str) -> int:
    """Children per node of a draft model's tree: 1 makes it a chain."""
    return 1 if shape == "chain" else 4


def model_budget(shape: str, tokens: int | None) -> TreeBudget:
    """A draft model's guesses per pass: `tokens`, or sized by measured cost from a start."""
    chain = shape == "chain"
    return TreeBudget(tokens or (MAX_CHAIN if chain else MAX_TREE), start=4 if chain else 8,
                      fixed=tokens is not None)


class Speculator:
    def __init__(self, draft: NgramDraft | ModelDraft, budget: TreeBudget | None, timed: bool = True,
                 prior: SpeculationPrior | None = None):
        self.draft = draft
        self.budget = budget  # None: the draft sizes itself (prompt lookup's DraftLength)
        self.timed = timed  # whether sizes follow measured time (else acceptance alone)
        self.prior = prior  # what sized the first passes; where save() keeps what was learned

    def predicted_speedup(self) -> float | None:
        """The prior's tokens/s at the tree size it predicts best over a plain decode step's (size
        0); None when no prior sized the first passes (a fixed size, a seeded sampled run)."""
        prior = self.budget and self.budget.prior
        if not prior or 0 not in prior.gained:
            return None
        return prior.rate(prior.best) / prior.rate(0)

    def save(self) -> None:
        """Keeps what the passes so far measured for the next load of the same pair."""
        if self.prior is None or self.budget is None or len(self.budget.sizes) == 1 or not self.budget.gained:
            return  # nothing measured: what earlier loads learned stays as it is
        ranks = self.draft.ranks if isinstance(self.draft, ModelDraft) else None
        self.prior.save(self.budget.gained, self.budget.seconds,
                        ranks and (ranks.taken.tolist(), ranks.tries.tolist()))

    def for_generation(self, sampler: Sampler) -> "Speculator":
        """This speculator, or for a seeded sampled generation a fresh one whose sizes depend on
        nothing but the generation itself (not on timings or earlier generations), so that the
        seed fixes the output."""
        if sampler.greedy or sampler.params.seed is None:
            return self
        budget = self.budget and TreeBudget(max(self.budget.sizes), self.budget.start,
                                            fixed=len(self.budget.sizes) == 1)
        return Speculator(self.draft.fresh(), budget, timed=False)

    def step(self, target: TokenGenerator, history: Sequence[int], sampler: Sampler, room: int,
             stats: GenerationStats) -> tuple[list[int], int]:
        """history ends with the token just sampled (the tree's root, not yet in the target's
        cache); room bounds the tree's guesses. Returns the accepted guesses and the target's
        next token after them."""
        asked = self.budget.next(self.timed) if self.budget else room
        budget = min(room, asked)
        reading = _read_clock(target)
        with self.draft.turn:
            started, read_before = time.perf_counter(), reading()
            draft_sampler = sampler.for_draft()  # the draft's distributions are no token's logprobs
            tree = (self.draft.propose(history, budget, draft_sampler, target) if budget
                    else TokenTree.root(history[-1]))
            drafted = time.perf_counter()
            stats.draft_hidden_seconds += reading() - read_before
            start = target.cache.length
            rows = target.verify_tree(tree.tokens, tree.parents)
            path, token = accept_tree(tree, rows, sampler, history)
            target.keep_path(start, path)
            if budget:  # else the draft did not run (its cache catches up at its next run)
                self.draft.accepted(tree, path)
            verified = time.perf_counter()
        guesses, accepted = len(tree) - 1, len(path) - 1
        stats.drafted_tokens += guesses
        stats.accepted_tokens += accepted
        stats.draft_seconds += drafted - started
        stats.verify_seconds += verified - drafted
        if self.budget and budget == asked:  # a tree cut short by the generation's end samples no size
            self.budget.update(budget, accepted, verified - started)
        return tree.path_tokens(path[-1]), token


def _read_clock(target: TokenGenerator) -> Callable[[], float]:
    """Seconds so far during which the target's streamed layers were being read (0 when nothing
    streams): its change over the draft's run is the share of the draft hidden under reads."""
    streamer = getattr(target.decoder.weights, "streamer", None)
    return (lambda: 0.0) if streamer is None else (lambda: streamer.read_seconds)
