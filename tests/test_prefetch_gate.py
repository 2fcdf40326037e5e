"""The prefetch gate: which confidence a prediction needs to be fetched ahead, chosen by what decode
tokens cost under each (the bytes fetched, and those of the reads the compute waited for)."""

import numpy as np

from tests.support.budgets import ram_beside_weights
from tests.support.make_model import ModelSpec, write_model
from tests.test_expert_cache import array_cache
from tierflow import Engine
from tierflow.offload.experts.prefetch_gate import EXPLORE_EVERY, THRESHOLDS, TRIAL, PrefetchGate


def run(gate: PrefetchGate, cost_at, tokens: int) -> list[float]:
    """The thresholds in force over `tokens` decode tokens whose cost is cost_at(threshold)."""
    seen = []
    for _ in range(tokens):
        seen.append(gate.threshold)
        gate.update(cost_at(gate.threshold))
    return seen


def test_the_gate_starts_by_fetching_nothing_ahead():
    gate = PrefetchGate()
    assert gate.threshold > 1.0 and not gate.reads_ahead


def test_the_gate_stops_prefetching_where_every_guess_makes_tokens_cost_more():
    gate = PrefetchGate()
    run(gate, lambda threshold: 0.2 - 0.05 * min(threshold, 1.0), 60)
    assert gate.best == THRESHOLDS[-1]


def test_the_gate_keeps_every_prediction_where_prefetching_pays():
    gate = PrefetchGate()
    seen = run(gate, lambda threshold: 0.1 + 0.05 * min(threshold, 1.0), 64)
    assert gate.best == 0.0
    assert seen[-EXPLORE_EVERY:].count(0.0) == EXPLORE_EVERY - TRIAL  # one trial of a neighbour a period


def test_the_gate_settles_between_the_extremes_where_only_confident_guesses_pay():
    gate = PrefetchGate()
    run(gate, lambda threshold: 0.1 + 0.1 * abs(threshold - 0.5), 80)
    assert gate.best == 0.5


def test_the_gate_prefetches_guesses_that_are_right_more_often_than_not():
    # per token, 10 guesses at each threshold's precision; a right one saves a waited-for read of an
    # expert (100 bytes), a wrong one reads one for nothing
    precision = {0.0: 0.3, 0.25: 0.4, 0.5: 0.55, 0.75: 0.7, 0.9: 0.8, 1.01: None}
    guesses = {0.0: 10, 0.25: 8, 0.5: 6, 0.75: 4, 0.9: 2, 1.01: 0}

    def cost(threshold: float) -> float:
        right = guesses[threshold] * (precision[threshold] or 0)
        return 1000 - 100 * right + 100 * (guesses[threshold] - right)

    gate = PrefetchGate()
    run(gate, cost, 80)
    assert gate.best == 0.75


def test_a_prefetch_fetches_only_the_predictions_as_confident_as_asked():
    cache = array_cache(budget_bytes=64)
    cache.predict(1, np.array([2, 3, 4]), [0.9, 0.3, 0.6])
    assert sorted(cache.prefetch(1, min_confidence=0.5)) == [(1, 2), (1, 4)]


def test_a_streamed_engine_counts_its_decode_tokens_reads_for_the_gate(tmp_path):
    spec = ModelSpec(arch="qwen3moe", num_layers=3, hidden_size=128, ffn_size=128, num_experts=8,
                     experts_used=2, expert_ffn_size=64, weight_type="Q8_0", embedding_type="Q8_0", seed=3)
    path = write_model(tmp_path / "moe.gguf", spec)
    with Engine.load(path, threads=2, context_length=128) as resident:
        packed = resident.weights.packed
        base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
        one = max(x.nbytes for layer in packed.experts for x in layer)
    budget = base + ram_beside_weights(path, 128) + 8 * one  # the experts streamed through a cache of 8
    with Engine.load(path, threads=2, context_length=128, cpu_memory=budget) as engine:
        engine.generate("Once upon a time", max_tokens=12, temperature=0)
        experts = engine.weights.experts
        assert experts.waited_bytes > 0  # a cold cache's first misses are waited for
        assert sum(experts.gate.costs.values()) > 0
