"""Token trees in one pass: every node gets the bits it would get decoded after its ancestors."""

import threading

import numpy as np
import pytest

from tierflow.kv_types import KV_TYPES
from tierflow.runtime.decoder.decoder import Decoder, tree_depths
from tierflow.runtime.generation.token_loop import TokenGenerator
from tierflow.runtime.memory.kv_cache import KVCache

PROMPT = "Once upon a time, in a small village,"
# A tree over three branches of different depths; parents precede children.
TREE_TOKENS = [11, 260, 1050, 370, 42, 503, 260, 9, 31]
TREE_PARENTS = [-1, 0, 1, 2, 0, 4, 4, 6, 1]


@pytest.fixture(scope="module", params=list(KV_TYPES))
def generator(engine, request):
    """A generator over a KV cache of each type: a tree's tokens read their ancestors' stored rows."""
    decoder = Decoder(engine.config, engine.arch.block, engine.weights, 256)
    return TokenGenerator(decoder, KVCache(engine.config, 256, kv_type=KV_TYPES[request.param]))


def path_to(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = TREE_PARENTS[node]
    return path[::-1]


def sequential_logits(generator, prompt_ids, tokens):
    generator.prefill(prompt_ids, threading.Event(), reuse_prefix=False)
    return generator.verify(tokens)


def test_tree_depths_follow_the_parents():
    assert tree_depths(np.array(TREE_PARENTS)).tolist() == [0, 1, 2, 3, 1, 2, 2, 3, 2]


def test_every_tree_node_matches_decoding_its_path_bit_for_bit(engine, generator):
    prompt_ids = engine.tokenize(PROMPT)
    generator.prefill(prompt_ids, threading.Event(), reuse_prefix=False)
    tree_rows = generator.verify_tree(TREE_TOKENS, TREE_PARENTS)
    for node in range(len(TREE_TOKENS)):
        path = path_to(node)
        rows = sequential_logits(generator, prompt_ids, [TREE_TOKENS[i] for i in path])
        assert np.array_equal(tree_rows[node], rows[-1]), f"node {node}"


@pytest.mark.parametrize("leaf", [3, 7, 8])
def test_keeping_a_path_leaves_the_cache_of_decoding_that_path(engine, generator, leaf):
    prompt_ids = engine.tokenize(PROMPT)
    path = path_to(leaf)
    expected = sequential_logits(generator, prompt_ids, [TREE_TOKENS[i] for i in path] + [5, 6])
    generator.prefill(prompt_ids, threading.Event(), reuse_prefix=False)
    start = generator.cache.length
    generator.verify_tree(TREE_TOKENS, TREE_PARENTS)
    generator.keep_path(start, path)
    assert generator.cached_tokens == prompt_ids + [TREE_TOKENS[i] for i in path]
    assert np.array_equal(generator.verify([5, 6]), expected[-2:])


def test_a_parent_after_its_child_is_refused(engine, generator):
    generator.prefill(engine.tokenize(PROMPT), threading.Event(), reuse_prefix=False)
    with pytest.raises(ValueError, match="earlier token"):
        generator.verify_tree([1, 2, 3], [-1, 2, 0])


def test_a_tree_grown_over_several_passes_matches_one_pass(engine, generator):
    prompt_ids = engine.tokenize(PROMPT)
    generator.prefill(prompt_ids, threading.Event(), reuse_prefix=False)
    one_pass = generator.verify_tree(TREE_TOKENS, TREE_PARENTS)
    generator.prefill(prompt_ids, threading.Event(), reuse_prefix=False)
    start = generator.cache.length
    levels = [generator.verify_tree(TREE_TOKENS[a:b], TREE_PARENTS[:b], tree_start=start)
              for a, b in [(0, 1), (1, 5), (5, 9)]]
    assert np.array_equal(np.concatenate(levels), one_pass)
