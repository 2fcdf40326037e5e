"""Each layer's kind of memory is an object: the KV cache holds it and the planner counts it by
asking it, so a kind neither has seen before takes no change to either."""

from dataclasses import dataclass, replace

import numpy as np
import pytest

from tests.support.model_spec import family_spec, spec_config
from tierflow.errors import InvalidArgumentError, ModelFileError
from tierflow.kv_types import KV_TYPES
from tierflow.offload.plan.budgets import kv_cache_bytes, layer_kv_bytes
from tierflow.runtime.memory.kinds import FullCache, LatentCache, RecurrentState, RingCache
from tierflow.runtime.memory.kv_cache import KVCache

F32 = KV_TYPES["f32"]
CONTEXT = 128


class Ledger:
    """A toy store: remembers which lengths a pass ended at, and can go back only to those."""

    can_shift = False

    def __init__(self, layers: dict):
        self.layers, self.ends, self.num_bytes = sorted(layers), [0], 64 * len(layers)

    def begin_pass(self, start, count, parents, tree_start, exact) -> None:
        self.pending = start + count

    def layer_pass(self, layer: int) -> dict:
        return {}

    def end_pass(self) -> None:
        self.ends.append(self.pending)

    def reachable(self, length: int) -> int:
        return max(end for end in self.ends if end <= length)

    def truncate(self, length: int) -> None:
        if self.reachable(length) != length:
            raise InvalidArgumentError(f"the ledger cannot go back to {length}")
        self.ends = [end for end in self.ends if end <= length]

    def keep_path(self, start: int, offsets: list[int]) -> None:
        self.ends.append(start + len(offsets))

    def checkpoint(self, length: int) -> None:
        self.ends.append(length)


@dataclass(frozen=True)
class LedgerKind:
    """A kind of memory that neither the KV cache nor the planner names."""

    window = 0

    def positions(self, context_length: int) -> int:
        return 0

    def num_bytes(self, context_length: int, kv) -> int:
        return 64

    def pass_bytes(self, tokens: int) -> int:
        return 0

    @staticmethod
    def sequence_store(layers: dict, allocate) -> Ledger:
        return Ledger(layers)


def config_of(family: str):
    return spec_config(family_spec(family), 300)


@pytest.mark.parametrize("family, kinds", [("llama", {FullCache}), ("gemma3", {FullCache, RingCache}),
                                           ("deepseek2", {LatentCache}),
                                           ("qwen35", {FullCache, RecurrentState})])
def test_a_familys_fields_give_each_layer_its_kind(family, kinds):
    assert {type(kind) for kind in config_of(family).memory} == kinds


@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek2", "qwen35"])
def test_the_planner_counts_what_each_kind_says(family):
    config = config_of(family)
    assert kv_cache_bytes(config, CONTEXT, F32) == sum(kind.num_bytes(CONTEXT, F32) for kind in config.memory)


def test_a_kind_declared_by_a_family_is_held_and_counted_with_no_change_to_the_cache_or_the_planner():
    base = config_of("llama")
    config = replace(base, layer_kinds=(FullCache(base.cache_rows), LedgerKind()))
    assert layer_kv_bytes(config, 1, CONTEXT, F32) == 64
    cache = KVCache(config, CONTEXT)
    ledger = cache.memories[-1]
    assert isinstance(ledger, Ledger) and ledger.layers == [1]
    assert cache.capacities == [FullCache(base.cache_rows).positions(CONTEXT), 0]
    for count in (5, 3):
        cache.begin_pass(count, None, None, exact=False)
        cache.end_pass(cache.length + count)
    assert cache.reachable(7) == 5  # the ledger holds 0, 5 and 8 only
    cache.truncate(5)
    assert cache.length == 5 and not cache.can_truncate_to(2)
    with pytest.raises(InvalidArgumentError, match="ledger"):
        cache.truncate(2)


def test_a_familys_kinds_must_be_one_per_layer():
    base = config_of("llama")
    with pytest.raises(ModelFileError, match="one per layer"):
        replace(base, layer_kinds=(FullCache(base.cache_rows),))


def test_a_ring_without_a_window_is_refused_by_name():
    with pytest.raises(ModelFileError, match="sliding window must be positive"):
        RingCache(config_of("llama").cache_rows, window=0)


def test_a_latent_cache_of_per_head_rows_is_refused_by_name():
    with pytest.raises(ModelFileError, match="latent cache needs latent rows"):
        LatentCache(config_of("llama").cache_rows)


def test_no_kind_but_the_rows_means_no_store_beside_them():
    cache = KVCache(config_of("gemma3"), CONTEXT)
    assert cache.memories == [cache.rows]
    assert np.all(np.array(cache.capacities) > 0)
