"""Sampled speculation follows the target's distribution exactly, whatever the draft proposes.

The acceptance rule is checked the way it is proved: by frequencies. Each test runs thousands of
seeded trials (so it gives the same answer every run) and compares the counts with the target's
exact probabilities by a chi-square statistic against its 99.99th percentile.
"""

from collections import Counter

import numpy as np
import pytest

from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.runtime.sampling.sampler import Sampler, SamplingParams
from tierflow.speculative.acceptance import accept_tree
from tierflow.speculative.drafts import _draw
from tierflow.speculative.tree import TokenTree

VOCAB = 5
CHI2_9999 = {2: 18.4, 24: 59.0}  # 99.99th percentile of chi-square by degrees of freedom
rng = np.random.default_rng(0)
TARGET_LOGITS = rng.normal(size=(VOCAB, VOCAB)) * 1.5  # next-token logits after token i
DRAFT_LOGITS = TARGET_LOGITS + rng.normal(size=(VOCAB, VOCAB)) * 1.5  # a draft that is often wrong


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def chi2(counts: Counter, probs: dict, trials: int) -> float:
    return sum((counts[k] - trials * p) ** 2 / (trials * p) for k, p in probs.items() if p > 0)


def speculate_two_tokens(sampler: Sampler, first: int, width: int) -> tuple[int, int]:
    """A two-level tree after `first`, verified; passes repeat until two tokens are out."""
    out = []
    while len(out) < 2:
        history = [first, *out]
        tree = TokenTree.root(history[-1])
        q = softmax(DRAFT_LOGITS[history[-1]])
        tree.draft_probs[0] = q
        for token in _draw(q, width, sampler.rng):
            child = tree.add(0, int(token))
            tree.draft_probs[child] = softmax(DRAFT_LOGITS[token])
            for grandchild in _draw(tree.draft_probs[child], width, sampler.rng):
                tree.add(child, int(grandchild))
        rows = np.stack([TARGET_LOGITS[token] for token in tree.tokens])
        path, token = accept_tree(tree, rows, sampler, history)
        out += [*tree.path_tokens(path[-1]), token]
    return out[0], out[1]


def exact_pairs(first: int) -> dict:
    p1 = softmax(TARGET_LOGITS[first])
    return {(a, b): p1[a] * softmax(TARGET_LOGITS[a])[b] for a in range(VOCAB) for b in range(VOCAB)}


@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 2, 3])
def test_tree_acceptance_gives_the_targets_joint_distribution(width):
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=width))
    trials = 6000
    counts = Counter(speculate_two_tokens(sampler, 0, width) for _ in range(trials))
    assert chi2(counts, exact_pairs(0), trials) < CHI2_9999[24]


def test_the_check_would_catch_output_that_follows_the_draft():
    sampler = Sampler(SamplingParams(seed=0))
    q1 = softmax(DRAFT_LOGITS[0])
    pairs = Counter()
    for _ in range(6000):
        a = int(sampler.rng.choice(VOCAB, p=q1))
        pairs[a, int(sampler.rng.choice(VOCAB, p=softmax(DRAFT_LOGITS[a])))] += 1
    assert chi2(pairs, exact_pairs(0), 6000) > CHI2_9999[24]


def test_a_deterministic_guess_keeps_the_targets_distribution():
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5))
    p = softmax(TARGET_LOGITS[0])
    counts = Counter()
    for _ in range(6000):
        tree = TokenTree.root(0)
        tree.draft_probs[0] = np.eye(VOCAB)[3]  # prompt lookup's guess: always token 3
        tree.add(0, 3)
        rows = np.stack([TARGET_LOGITS[0], TARGET_LOGITS[3]])
        path, token = accept_tree(tree, rows, sampler, [0])
        counts[tree.tokens[path[1]] if len(path) > 1 else token] += 1
    assert chi2(counts, dict(enumerate(p)), 6000) < CHI2_9999[24]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    target = write_model(folder / "target.gguf", ModelSpec(num_layers=2, hidden_size=64, seed=1))
    draft = write_model(folder / "draft.gguf", ModelSpec(num_layers=1, hidden_size=64, seed=2))
    return target, draft


@pytest.mark.slow
def test_sampled_tokens_of_a_drafted_tiny_model_follow_the_target(tiny_pair):
    target, draft = tiny_pair
    params = dict(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0)
    with Engine.load(target, threads=1, context_length=64, draft=draft) as engine:
        prompt = engine.tokenize("Once upon a time")
        runs = [engine.generate(prompt, max_tokens=2, seed=seed, **params).tokens for seed in range(1500)]
        first = Counter(tokens[0] for tokens in runs).most_common(1)[0][0]
        seconds = Counter(tokens[1] for tokens in runs if tokens[0] == first)
        sampler = Sampler(SamplingParams(**params))
        history = [*prompt, first]  # what the repetition penalty sees
        candidates, probs = sampler.candidates(engine.logits(history)[-1], history)
        stats = engine.generate(prompt, max_tokens=8, seed=0, **params).stats
    trials = sum(seconds.values())
    assert stats.drafted_tokens > 0 and trials > 300
    assert set(seconds) <= set(candidates.tolist())
    assert chi2(seconds, dict(zip(candidates.tolist(), probs)), trials) < CHI2_9999[2]
