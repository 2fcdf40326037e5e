"""HiddenTrail: the target's hidden states by cache slot, moved as the KV cache moves."""

import numpy as np

from tierflow.runtime.memory.hidden_trail import HiddenTrail


def rows(first: int, last: int) -> np.ndarray:
    """Rows whose values name their slot."""
    return np.repeat(np.arange(first, last, dtype=np.float32)[:, None], 3, axis=1)


def test_a_pass_after_the_last_slot_extends_the_trail():
    trail = HiddenTrail(3, 8)
    trail.record(0, rows(0, 4))
    trail.record(4, rows(4, 6))
    assert np.array_equal(trail.rows_for(0, 6), rows(0, 6))


def test_only_the_last_max_rows_slots_are_held_across_the_ring():
    trail = HiddenTrail(3, 4)
    trail.record(0, rows(0, 3))
    trail.record(3, rows(3, 7))
    assert trail.rows_for(2, 7) is None
    assert np.array_equal(trail.rows_for(3, 7), rows(3, 7))


def test_a_pass_longer_than_the_ring_keeps_its_last_rows():
    trail = HiddenTrail(3, 4)
    trail.record(0, rows(0, 10))
    assert (trail.first, trail.end) == (6, 10)
    assert np.array_equal(trail.rows_for(6, 10), rows(6, 10))


def test_a_kept_tree_path_moves_its_rows_down_to_the_root():
    trail = HiddenTrail(3, 8)
    trail.record(0, rows(0, 5))
    trail.record(5, rows(5, 9))  # a tree of 4 nodes from slot 5
    trail.keep_path(5, [0, 2, 3])
    assert trail.end == 8
    assert np.array_equal(trail.rows_for(5, 8), rows(5, 9)[[0, 2, 3]])


def test_a_truncated_trail_takes_a_pass_where_it_ends():
    trail = HiddenTrail(3, 8)
    trail.record(0, rows(0, 6))
    trail.truncate(4)
    assert trail.rows_for(0, 5) is None
    trail.record(4, rows(40, 42))
    assert np.array_equal(trail.rows_for(3, 6), np.concatenate([rows(3, 4), rows(40, 42)]))


def test_rows_read_and_forgotten_are_no_longer_held():
    trail = HiddenTrail(3, 8)
    trail.record(0, rows(0, 6))
    trail.forget_before(4)
    assert trail.rows_for(3, 6) is None
    assert np.array_equal(trail.rows_for(4, 6), rows(4, 6))


def test_a_pass_away_from_the_held_slots_starts_the_trail_over():
    trail = HiddenTrail(3, 8)
    trail.record(0, rows(0, 4))
    trail.forget_before(3)
    trail.record(1, rows(1, 3))
    assert (trail.first, trail.end) == (1, 3)
