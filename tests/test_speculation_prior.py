"""The first passes' tree sizes from the plan's predicted costs and an acceptance prior, what a
pair learned kept for its next load (speculative/first_sizes.py, speculative/learned.py), and a
streamed target's reads going on while the draft proposes."""

import json
from dataclasses import replace

import numpy as np
import pytest

from tests.support.budgets import ram_beside_weights
from tierflow import Engine
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan.pass_costs import PassCosts
from tierflow.offload.plan.probe import load_profile
from tierflow.speculative.first_sizes import (
    SAME_MODEL_RATES,
    SizePredictions,
    SpeculationPrior,
    grown_tree,
    predict_sizes,
)
from tierflow.speculative.learned import Learned, LearnedStore
from tierflow.speculative.sizing import TreeBudget

CONTEXT = 256
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"


@pytest.fixture(scope="module")
def streamed_budget(model_path) -> int:
    """cpu_memory for the bundled model drafting for itself with half the target's layers streamed."""
    with Engine.load(model_path, threads=2, draft=model_path, context_length=CONTEXT) as alone:
        draft_bytes = alone.draft.bytes_by_tier()["cpu"]
        target_bytes = alone.weights.bytes_by_tier()["cpu"]
    return draft_bytes + target_bytes // 2 + ram_beside_weights(model_path, CONTEXT)


@pytest.fixture(scope="module")
def streamed(model_path, streamed_budget):
    with Engine.load(model_path, threads=2, draft=model_path, cpu_memory=streamed_budget,
                     context_length=CONTEXT) as engine:
        yield engine


@pytest.fixture(scope="module")
def resident(model_path):
    with Engine.load(model_path, threads=2, draft=model_path, context_length=CONTEXT) as engine:
        yield engine


def first_size(engine: Engine) -> int:
    """The size the engine's next pass would ask for, from a copy of its budget's state."""
    budget = engine.speculator.budget
    fresh = TreeBudget(max(budget.sizes), budget.start)
    fresh.seed(budget.prior)
    return fresh.next()


@pytest.fixture(scope="module")
def pass_costs(streamed, resident, model_path) -> tuple[PassCosts, PassCosts]:
    """The streamed and the resident target's predicted passes, on a machine whose disk reads a
    tenth as fast as the test profile's: where the sweep, not the compute, sets a pass's cost."""
    with open_model_file(model_path) as opened:
        sizes = pack_sizes(opened)
    profile = load_profile(2)
    slow_disk = replace(profile, disk_read_gbps=profile.disk_read_gbps / 10)
    return (PassCosts(streamed.plan, streamed.config, sizes, slow_disk),
            PassCosts(resident.plan, resident.config, sizes, profile))


@pytest.mark.slow
def test_a_streamed_verify_pass_costs_about_what_one_token_does(pass_costs):
    on_disk, in_ram = pass_costs
    assert on_disk.seconds(65) < 1.5 * on_disk.seconds(1)
    assert in_ram.seconds(65) > 3 * in_ram.seconds(1)


def test_a_good_draft_for_a_streamed_target_is_predicted_to_pay_most_with_the_largest_tree(pass_costs):
    on_disk, in_ram = pass_costs
    sizes = (0, 1, 2, 4, 8, 16, 32, 64)
    assert predict_sizes(sizes, np.array([0.9, 0.3]), on_disk, in_ram.seconds).best == 64


def test_a_resident_target_starts_with_a_smaller_tree_than_a_streamed_one(streamed, resident):
    assert first_size(resident) < first_size(streamed)


def test_the_first_pass_goes_to_the_predicted_best_size():
    budget = TreeBudget(64, start=8)
    gained = {s: 1 + min(s, 20) for s in budget.sizes}
    budget.seed(SizePredictions(gained, {s: 1.0 + s / 16 for s in budget.sizes}))
    assert budget.next() == 16  # 17 tokens in 2 s beat 9 in 1.5 s and 21 in 3 s


def test_measured_passes_take_over_from_the_prior():
    budget = TreeBudget(64, start=8)
    budget.seed(SizePredictions({s: 1 + s for s in budget.sizes}, {s: 1.0 for s in budget.sizes}))
    sizes = []
    for _ in range(40):  # the draft is in fact never right: plain decoding pays
        size = budget.next()
        budget.update(size, 0, 0.01 * (1 + size))
        sizes.append(size)
    assert sizes[0] == 64 and sizes[-10:].count(0) >= 8


def test_the_expected_gain_is_the_sum_of_the_nodes_chances_of_being_reached():
    assert grown_tree(np.array([1.0]), 8) == (8.0, [1] * 8)
    expected, widths = grown_tree(np.array([0.5, 0.25]), 3, min_reach=0.0)
    assert widths == [2, 1] and expected == pytest.approx(0.5 + 0.25 + 0.25)


@pytest.mark.slow
def test_what_a_pair_learned_starts_its_next_load(model_path):
    with Engine.load(model_path, threads=2, draft="ngram", context_length=CONTEXT) as first:
        first.generate(PROMPT, max_tokens=48, temperature=0)
        measured = dict(first.speculator.budget.gained)
    with Engine.load(model_path, threads=2, draft="ngram", context_length=CONTEXT) as second:
        prior = second.speculator.budget.prior
        assert measured and all(prior.gained[s] == pytest.approx(g) for s, g in measured.items())


@pytest.fixture(scope="module")
def another_pairs_file(model_path) -> tuple[dict, SizePredictions, dict]:
    """What the pair (bundled model, prompt lookup) learned; and the pair (bundled model, itself
    as the draft) with nothing learned: its predicted sizes and its identity."""
    with Engine.load(model_path, threads=2, draft="ngram", context_length=CONTEXT) as ngram:
        ngram.generate(PROMPT, max_tokens=32, temperature=0)
    LearnedStore(model_path, model_path, "tree", "").path.unlink(missing_ok=True)
    with Engine.load(model_path, threads=2, draft=model_path, context_length=CONTEXT) as drafting:
        predicted, pair = drafting.speculator.budget.prior, drafting.speculator.prior.store.pair
    return json.loads(ngram.speculator.prior.store.path.read_text()), predicted, pair


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["another pair's file", "not JSON", "a negative value"])
def test_a_learned_file_that_is_not_the_pairs_is_ignored(model_path, another_pairs_file, damage):
    others, predicted, pair = another_pairs_file
    texts = {"another pair's file": json.dumps(others), "not JSON": '{"version": 1, "pair"',
             "a negative value": json.dumps(others | {"pair": pair, "gained": {"8": -3.0}})}
    pair_file = LearnedStore(model_path, model_path, "tree", "").path
    pair_file.write_text(texts[damage])
    try:
        with Engine.load(model_path, threads=2, draft=model_path, context_length=CONTEXT) as again:
            assert again.speculator.prior.learned is None
            assert again.speculator.budget.prior == predicted
    finally:
        pair_file.unlink()


@pytest.mark.slow
def test_a_seeded_sampled_generation_ignores_what_was_learned(model_path):
    def seeded() -> list[int]:
        with Engine.load(model_path, threads=2, draft=model_path, context_length=CONTEXT) as engine:
            tokens = engine.generate(PROMPT, max_tokens=24, temperature=0.8, seed=11).tokens
            engine.generate(PROMPT, max_tokens=24, temperature=0)  # learns from greedy passes
            return tokens

    LearnedStore(model_path, model_path, "tree", "").path.unlink(missing_ok=True)
    assert seeded() == seeded()


def test_the_whole_ring_reads_the_next_pass_while_the_draft_runs(model_path):
    """Once a pass's layers are done, every slot reads ahead, the last streamed layer's too (every
    layer streams under this budget, so the last is)."""
    with Engine.load(model_path, threads=2, cpu_memory="45MiB", context_length=CONTEXT) as engine:
        streamer = engine.weights.streamer
        assert len(engine.plan.streamed_layers) == engine.config.num_layers
        engine.generate(PROMPT, max_tokens=4, temperature=0)
        assert streamer.read_ahead == len(streamer.slots)


def test_the_draft_time_hidden_under_reads_is_part_of_the_draft_time(streamed):
    stats = streamed.generate(PROMPT, max_tokens=24, temperature=0).stats
    assert 0 <= stats.draft_hidden_seconds <= stats.draft_seconds
    assert stats.as_dict()["draft_hidden_seconds"] == round(stats.draft_hidden_seconds, 4)


def test_a_conversion_of_the_target_drafts_from_the_same_models_prior(resident):
    assert resident.speculator.draft.rates == SAME_MODEL_RATES


def test_with_a_prior_the_best_size_is_kept_rather_than_its_neighbours_tried_at_once():
    budget = TreeBudget(64, start=8)
    budget.seed(SizePredictions({s: 1 + s for s in budget.sizes}, {s: 1.0 for s in budget.sizes}))
    sizes = []
    for _ in range(3):  # the draft is always right and a pass costs the same at any size
        size = budget.next()
        budget.update(size, size, 1.0)
        sizes.append(size)
    assert sizes == [64, 64, 64]


def test_a_tree_cut_short_by_the_generations_end_is_not_counted_for_its_size(streamed):
    assert first_size(streamed) > 1  # a pass with room for one guess is cut short
    before = dict(streamed.speculator.budget.gained)
    streamed.generate(PROMPT, max_tokens=3, temperature=0)  # one pass, with room for one guess
    assert streamed.speculator.budget.gained == before


def test_a_chain_and_a_tree_of_the_same_draft_learn_apart(model_path):
    tree = LearnedStore(model_path, model_path, "tree", "")
    assert LearnedStore(model_path, model_path, "chain", "").path != tree.path


def test_seconds_learned_under_one_placement_survive_a_load_under_another(model_path):
    def store(placement: str) -> LearnedStore:
        return LearnedStore(model_path, model_path, "chain", placement)

    store("streamed").save(Learned(gained={8: 9.0}, seconds={8: 0.5}))
    in_ram = store("in RAM").load()
    assert in_ram.gained == {8: 9.0} and in_ram.seconds == {}
    store("in RAM").save(Learned(in_ram.gained, {8: 0.01}, in_ram.other_seconds))
    assert store("streamed").load().seconds == {8: 0.5}
    store("streamed").path.unlink()


@pytest.mark.slow
def test_a_load_that_measured_nothing_leaves_what_was_learned(model_path):
    with Engine.load(model_path, threads=2, draft="ngram", context_length=CONTEXT) as first:
        first.generate(PROMPT, max_tokens=32, temperature=0)
    learned = first.speculator.prior.store.path.read_text()
    with Engine.load(model_path, threads=2, draft="ngram", context_length=CONTEXT, kv_cache_type="f32"):
        pass
    assert first.speculator.prior.store.path.read_text() == learned


def test_learned_seconds_scale_the_cost_models_curve_rather_than_replace_a_size(pass_costs, model_path):
    _, in_ram = pass_costs
    sizes, taken = (0, 1, 2, 4, 8, 16), np.array([0.9, 0.2])
    store = LearnedStore(model_path, None, "chain", "")
    plain = SpeculationPrior(in_ram, None, store, None).sizes(sizes, taken)
    slow = Learned(seconds={plain.best: 3 * plain.seconds[plain.best]})  # timed while the machine was busy
    scaled = SpeculationPrior(in_ram, None, store, slow).sizes(sizes, taken)
    assert scaled.seconds == pytest.approx({s: 3 * t for s, t in plain.seconds.items()})
    assert scaled.best == plain.best
