"""Mixture-of-experts models through the engine: experts resident, streamed from the pack through
the expert cache when cpu_memory cannot hold them, cached on the (stand-in) GPU beside the layers,
on three tiers at once, or placed by hand (llama.cpp as the oracle: test_oracle)."""

import numpy as np
import pytest

from tests.support.budgets import MoeBytes, moe_bytes, ram_beside_weights
from tests.support.damage import flip_byte
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.errors import BudgetError, InvalidArgumentError, ModelFileError, PlanBudgetError
from tierflow.offload.experts.hybrid import ExpertCosts, schedule_experts
from tierflow.offload.experts.routing_trace import (
    NOT_PREDICTED,
    Routing,
    check_trace,
    keep_routing,
    kept_routing,
)
from tierflow.offload.pack.pack_cache import pack_path, remove_pack, routing_path

PROMPT = "The history of the printing press begins in"
CONTEXT = 128
TOKENS = 24


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    """8 experts, top-2, 4 layers: experts are most of the layers' bytes, as in Mixtral."""
    spec = ModelSpec(num_layers=4, hidden_size=128, ffn_size=256, num_experts=8, experts_used=2,
                     weight_type="Q4_0", embedding_type="Q4_0", seed=7)
    return write_model(tmp_path_factory.mktemp("moe") / "moe.gguf", spec)


@pytest.fixture(scope="module")
def resident(moe_path):
    with Engine.load(moe_path, threads=2, context_length=CONTEXT) as engine:
        tokens = engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens
        return tokens, engine.logits(engine.tokenize(PROMPT) + tokens)


def sizes(engine) -> tuple[int, int, int]:
    """(globals and layers without experts, one expert, all experts) in the engine's pack."""
    packed = engine.weights.packed
    base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
    return base, packed.experts[0][0].nbytes, sum(x.nbytes for layer in packed.experts for x in layer)


@pytest.fixture(scope="module")
def budgets(moe_path):
    """sizes(), the first with what cpu_memory keeps beside the weights at CONTEXT: base + n * one
    is the budget that leaves n experts' bytes to the experts."""
    with Engine.load(moe_path, threads=2, context_length=CONTEXT) as engine:
        base, one, all_experts = sizes(engine)
    return base + ram_beside_weights(moe_path, CONTEXT), one, all_experts


def streamed(moe_path, budgets, experts_held: int, **kwargs) -> Engine:
    base, one, _ = budgets
    return Engine.load(moe_path, threads=2, context_length=CONTEXT, cpu_memory=base + experts_held * one,
                       **kwargs)


def test_resident_experts_report_no_expert_cache(moe_path):
    with Engine.load(moe_path, threads=2, context_length=CONTEXT) as engine:
        assert engine.expert_stats is None and engine.weights.bytes_by_tier()["disk"] == 0


def test_streamed_experts_give_the_resident_tokens_and_logits_bit_for_bit(moe_path, budgets, resident):
    with streamed(moe_path, budgets, experts_held=10) as engine:
        result = engine.generate(PROMPT, max_tokens=TOKENS, temperature=0)
        assert result.tokens == resident[0]
        assert np.array_equal(engine.logits(engine.tokenize(PROMPT) + resident[0]), resident[1])
        assert engine.expert_stats.misses > 0


def test_a_streamed_expert_changed_in_place_after_its_first_read_is_an_error(moe_path, budgets, resident,
                                                                             tmp_path):
    own = tmp_path / "moe.gguf"  # a pack of its own, to damage
    own.write_bytes(moe_path.read_bytes())
    with streamed(own, budgets, experts_held=8) as engine:  # one layer's worth: experts are read again
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]
        packed = engine.weights.packed
        for extent in packed.experts[0]:  # every expert of layer 0, past its first read
            flip_byte(packed.path, extent.offset + 64)
        with pytest.raises(ModelFileError, match="checksum"):
            engine.generate("Something else entirely", max_tokens=TOKENS, temperature=0)
    with streamed(own, budgets, experts_held=8) as engine:  # rebuilt
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]


def test_the_expert_cache_holds_what_the_budget_leaves_and_no_more(moe_path, budgets):
    base, one, all_experts = budgets
    budget = base + 12 * one
    with Engine.load(moe_path, threads=2, context_length=CONTEXT, cpu_memory=budget) as engine:
        cache = engine.weights.experts.cache
        assert cache.budget_bytes == 12 * one
        highest = mapped = 0
        for _ in engine.stream(PROMPT, max_tokens=TOKENS, temperature=0):
            highest = max(highest, cache.used_bytes)
            mapped = max(mapped, engine.weights.experts.buffers.mapped_bytes)  # what RAM the reads fill
        assert 0 < highest <= cache.budget_bytes and 0 < mapped <= cache.budget_bytes
        tiers = engine.weights.bytes_by_tier()
        assert tiers["cpu"] <= budget and tiers["disk"] == all_experts


def test_expert_stats_count_hits_bytes_and_predictions_per_layer(moe_path, budgets):
    with streamed(moe_path, budgets, experts_held=12) as engine:
        engine.generate(PROMPT, max_tokens=TOKENS, temperature=0)
        stats = engine.expert_stats
    assert sorted(stats.layers) == [0, 1, 2, 3]
    assert all(0 <= layer.hit_rate <= 1 and layer.hits + layer.misses > 0 for layer in stats.layers.values())
    assert stats.tokens >= TOKENS and stats.bytes_per_token > 0
    assert stats.fetched_bytes == sum(layer.fetched_bytes for layer in stats.layers.values())
    # The early router predicts every layer but the first; better than chance (2 of 8 experts).
    assert stats.predictions_right + stats.predictions_wrong > 0
    assert stats.prediction_precision > 0.25


def test_more_room_for_experts_gives_a_higher_hit_rate(moe_path, budgets):
    rates = []
    for held in (8, 24):
        with streamed(moe_path, budgets, experts_held=held) as engine:
            engine.generate(PROMPT, max_tokens=TOKENS, temperature=0)
            rates.append(engine.expert_stats.hit_rate)
    assert rates[0] < rates[1]


def test_streamed_experts_verify_speculative_trees_with_the_same_tokens(moe_path, budgets, resident):
    with streamed(moe_path, budgets, experts_held=10, draft="ngram") as engine:
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]


def test_a_budget_without_room_for_one_layers_experts_names_the_least_that_works(moe_path, budgets):
    with pytest.raises(BudgetError, match="the least that works is"):
        streamed(moe_path, budgets, experts_held=4)


@pytest.fixture(scope="module")
def size(moe_path) -> MoeBytes:
    return moe_bytes(moe_path, CONTEXT)


def on_stand_in_gpu(moe_path, gpu_memory: int, **kwargs) -> Engine:
    return Engine.load(moe_path, threads=2, context_length=CONTEXT, gpu_memory=gpu_memory, gpu_device="cpu",
                       **kwargs)


def test_experts_cached_on_the_stand_in_gpu_give_the_cpu_tokens_and_logits_bit_for_bit(moe_path, size,
                                                                                         resident):
    with on_stand_in_gpu(moe_path, size.on_gpu(10)) as engine:
        result = engine.generate(PROMPT, max_tokens=TOKENS, temperature=0)
        assert result.tokens == resident[0]
        assert np.array_equal(engine.logits(engine.tokenize(PROMPT) + resident[0]), resident[1])
        runs = engine.weights.experts.schedules
        assert runs.on_gpu > 0 and runs.on_cpu > 0 and runs.fetched > 0
        assert engine.expert_stats.hits > 0
        assert engine.expert_stats.prefetched > 0  # the next layer's predicted experts, copied ahead


def test_the_layers_go_to_the_gpu_before_any_expert(moe_path, size):
    with on_stand_in_gpu(moe_path, size.on_gpu(10)) as engine:
        assert engine.plan.gpu_layers == (0, 1, 2, 3)
        assert engine.weights.bytes_by_tier()["gpu"] == size.layers + size.gpu_beside  # no expert yet
        assert engine.plan.experts.gpu_cache_bytes == 10 * size.expert


def test_the_gpu_tier_counts_exactly_the_experts_cached_there_as_they_come_and_go(moe_path, size):
    with on_stand_in_gpu(moe_path, size.on_gpu(6)) as engine:
        tier, cache = engine.weights.device, engine.weights.experts.cache
        layers = tier.used
        for _ in engine.stream(PROMPT, max_tokens=TOKENS, temperature=0):
            assert tier.used - layers == cache.used_bytes <= 6 * size.expert
        assert engine.expert_stats.evictions > 0


def test_peak_weight_bytes_is_the_gpu_tiers_high_water_mark_not_its_start(moe_path, size):
    with on_stand_in_gpu(moe_path, size.on_gpu(6)) as engine:
        start = engine.weights.bytes_by_tier()["gpu"]
        stats = engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).stats
        assert stats.peak_weight_bytes["gpu"] == engine.weights.device.peak > start


def test_three_tiers_hold_their_budgets_at_every_step(moe_path, size, resident):
    with on_stand_in_gpu(moe_path, size.on_gpu(4), cpu_memory=size.in_ram(10)) as engine:
        gpu, ram = engine.weights.device, engine.weights._streamed
        for _ in engine.stream(PROMPT, max_tokens=TOKENS, temperature=0):
            assert gpu.used <= size.on_gpu(4)
            assert ram.cache.used_bytes <= ram.nbytes == 10 * size.expert
            assert ram.buffers.mapped_bytes <= ram.nbytes
        assert engine.weights.bytes_by_tier()["disk"] == size.experts


def test_with_experts_on_disk_the_gpu_budget_reads_ahead_into_ram(moe_path, size):
    with on_stand_in_gpu(moe_path, size.on_gpu(4), cpu_memory=size.in_ram(10)) as engine:
        engine.generate(PROMPT, max_tokens=TOKENS, temperature=0)
        assert engine.weights.experts.ram_stats.prefetched > 0
        assert engine.expert_stats.prefetched == 0  # copies to the GPU are the schedule's alone


def test_a_read_error_on_three_tiers_leaves_the_engine_usable(moe_path, size, resident, monkeypatch):
    with on_stand_in_gpu(moe_path, size.on_gpu(4), cpu_memory=size.in_ram(10)) as engine:
        disk = engine.weights.disk
        read = disk.read_into
        monkeypatch.setattr(disk, "read_into", lambda *args: (_ for _ in ()).throw(OSError(5, "I/O error")))
        with pytest.raises(OSError):
            engine.generate(PROMPT, max_tokens=TOKENS, temperature=0)
        monkeypatch.setattr(disk, "read_into", read)
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]


def test_a_full_gpu_on_three_tiers_leaves_the_engine_usable(moe_path, size, resident, monkeypatch):
    with on_stand_in_gpu(moe_path, size.on_gpu(4), cpu_memory=size.in_ram(10)) as engine:
        tier = engine.weights.device
        upload = tier.upload
        full = BudgetError("the GPU is full")
        monkeypatch.setattr(tier, "upload", lambda *args: (_ for _ in ()).throw(full))
        with pytest.raises(BudgetError, match="the GPU is full"):
            engine.generate(PROMPT, max_tokens=TOKENS, temperature=0)
        monkeypatch.setattr(tier, "upload", upload)
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]


def test_experts_placed_by_hand_stay_where_they_were_put(moe_path, size, resident):
    # llama.cpp's -ngl 99 --n-cpu-moe 3: layer 3's experts on the GPU, the others' in RAM
    with on_stand_in_gpu(moe_path, size.on_gpu(8), expert_placement=3) as engine:
        assert engine.plan.experts.gpu_layers == (3,) and engine.weights.experts is None
        held = engine.weights.bytes_by_tier()["gpu"]
        assert held == size.layers + size.gpu_beside + 8 * size.expert
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]
        assert engine.weights.bytes_by_tier()["gpu"] == held


def test_cpu_moe_keeps_every_expert_off_the_gpu(moe_path, size, resident):
    with on_stand_in_gpu(moe_path, size.on_gpu(8), expert_placement="cpu") as engine:
        assert engine.plan.gpu_layers == (0, 1, 2, 3) and engine.plan.experts.gpu_cache_bytes == 0
        assert engine.weights.bytes_by_tier()["gpu"] == size.layers + size.gpu_beside
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]


def test_experts_placed_by_hand_beyond_the_gpu_budget_are_refused_naming_it_and_the_overflow(moe_path, size):
    with pytest.raises(PlanBudgetError, match=r"gpu_memory .* cannot hold .*--n-cpu-moe 2.* over") as refused:
        on_stand_in_gpu(moe_path, size.on_gpu(8), expert_placement=2)
    assert refused.value.minimum_bytes >= size.on_gpu(16)


def test_experts_placed_on_the_gpu_by_hand_without_gpu_memory_are_refused(moe_path):
    with pytest.raises(PlanBudgetError, match="there is no gpu_memory"):
        Engine.load(moe_path, threads=2, context_length=CONTEXT, expert_placement=0)


@pytest.mark.parametrize("placement", ["gpu", -1, 1.5, True])
def test_a_wrong_expert_placement_is_refused(moe_path, placement):
    with pytest.raises(InvalidArgumentError, match="expert_placement must be"):
        Engine.load(moe_path, threads=2, context_length=CONTEXT, expert_placement=placement)


def test_expert_placement_on_a_dense_model_is_refused(model_path):
    with pytest.raises(InvalidArgumentError, match="not a mixture-of-experts model"):
        Engine.load(model_path, threads=2, context_length=CONTEXT, expert_placement="cpu")


def test_recorded_routing_is_every_computed_tokens_top_k_at_every_layer(moe_path, resident):
    with Engine.load(moe_path, threads=2, context_length=CONTEXT) as engine:
        prompt = engine.tokenize(PROMPT)
        with engine.record_routing() as recorder:
            generated = engine.generate(prompt, max_tokens=TOKENS, temperature=0).tokens
        trace = check_trace(recorder.trace(), num_experts=8)
        assert trace.shape == (len(prompt) + len(generated) - 1, 4, 2)  # the last token is never fed
        with engine.record_routing() as whole:  # the same tokens in one pass route the same
            engine.logits(prompt + generated[:-1])
        assert np.array_equal(whole.trace(), trace)


def test_routing_does_not_depend_on_where_the_experts_live(moe_path, budgets):
    traces = []
    for held in (None, 10):
        with (Engine.load(moe_path, threads=2, context_length=CONTEXT) if held is None
              else streamed(moe_path, budgets, experts_held=held)) as engine:
            with engine.record_routing() as recorder:
                engine.generate(PROMPT, max_tokens=8, temperature=0)
            traces.append(recorder.trace())
    assert np.array_equal(*traces)


def test_recording_routing_outside_a_moe_model_is_refused(model_path):
    with Engine.load(model_path, threads=2, context_length=CONTEXT) as engine:
        with pytest.raises(InvalidArgumentError, match="not a mixture-of-experts model"):
            with engine.record_routing():
                pass


COSTS = ExpertCosts(cpu_gbps=10.0, gpu_gbps=100.0, copy_gbps=10.0)
MB = 10**6


def test_experts_cached_on_the_gpu_run_there():
    plan = schedule_experts({0: 1, 3: 1}, cached={0, 3}, nbytes=10 * MB, costs=COSTS)
    assert plan.on_gpu == [0, 3] and plan.fetched == [] and plan.on_cpu == []


def test_uncached_experts_are_shared_so_both_devices_finish_together():
    """One token each: 1 ms on the CPU, 1 ms to copy (+0.1 ms to run) for the GPU."""
    plan = schedule_experts({e: 1 for e in range(8)}, cached=set(), nbytes=10 * MB, costs=COSTS)
    assert len(plan.on_cpu) == 4 and len(plan.fetched) == 4
    assert abs(plan.cpu_seconds - plan.gpu_seconds) <= 0.0011


def test_a_slow_copy_keeps_uncached_experts_on_the_cpu():
    slow_copy = ExpertCosts(cpu_gbps=10.0, gpu_gbps=100.0, copy_gbps=0.5)
    plan = schedule_experts({0: 1, 1: 1}, cached=set(), nbytes=10 * MB, costs=slow_copy)
    assert plan.on_cpu == [0, 1] and plan.fetched == []


def test_an_expert_with_many_tokens_is_copied_to_the_gpu_first():
    """In prefill the CPU's cost grows with the tokens and the GPU's barely: the busiest expert
    is worth its copy."""
    plan = schedule_experts({0: 2, 1: 512}, cached=set(), nbytes=10 * MB, costs=COSTS)
    assert plan.fetched == [1] and plan.on_cpu == [0]


def test_more_experts_used_than_exist_is_a_model_file_error(tmp_path):
    path = write_model(tmp_path / "m.gguf", ModelSpec(num_experts=4, experts_used=2))
    data = path.read_bytes()
    key = b"llama.expert_used_count"
    at = data.index(key) + len(key) + 4  # the value's type (uint32), then the value
    path.write_bytes(data[:at] + (9).to_bytes(4, "little") + data[at + 4:])
    with pytest.raises(ModelFileError, match="expert_used_count"):
        Engine.load(path)


def test_recorded_routing_is_kept_beside_the_pack_and_later_plans_take_their_hit_rates_from_it(tmp_path):
    spec = ModelSpec(num_layers=2, hidden_size=64, ffn_size=128, num_experts=4, experts_used=2,
                     weight_type="Q8_0", seed=5)
    path = write_model(tmp_path / "moe.gguf", spec)
    with Engine.load(path, threads=2, context_length=CONTEXT) as engine:
        assert engine.plan.experts.routing == "uniform routing"
        with engine.record_routing() as recorder:
            engine.generate(PROMPT, max_tokens=4, temperature=0)
    kept = kept_routing(path)
    assert np.array_equal(kept.trace, recorder.trace())
    assert np.array_equal(kept.predicted, recorder.routing().predicted)
    with Engine.load(path, threads=2, context_length=CONTEXT) as engine:
        assert engine.plan.experts.routing == f"a routing trace of {len(recorder.trace())} tokens"
    remove_pack(pack_path(path))
    assert kept_routing(path) is None and not routing_path(path).exists()


def test_recorded_routing_holds_the_early_routers_prediction_of_each_layer_after_the_first(tmp_path):
    spec = ModelSpec(num_layers=3, hidden_size=64, ffn_size=128, num_experts=8, experts_used=2,
                     weight_type="Q8_0", seed=7)
    path = write_model(tmp_path / "moe.gguf", spec)
    with Engine.load(path, threads=2, context_length=CONTEXT) as engine:
        with engine.record_routing() as recorder:
            engine.generate(PROMPT, max_tokens=4, temperature=0)
    routing = recorder.routing()
    assert (routing.predicted[:, 0] == NOT_PREDICTED).all()
    later = routing.predicted[:, 1:]
    assert ((0 <= later) & (later < 8)).all()
    assert (np.sort(later, axis=-1)[..., 0] != np.sort(later, axis=-1)[..., 1]).all()
    # in a random model the stream changes little across one layer: the guess is better than chance
    right = (routing.trace[:, 1:, :, None] == later[..., None, :]).any(-1).mean()
    assert right > 2 / 8


def test_kept_routing_keeps_the_newest_tokens_of_every_recording(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"a model")
    first = Routing(np.zeros((3, 2, 2), np.int32) + [0, 1], np.full((3, 2, 2), NOT_PREDICTED, np.int32))
    second = Routing(np.zeros((2, 2, 2), np.int32) + [2, 3], np.zeros((2, 2, 2), np.int32) + [3, 2])
    keep_routing(path, first)
    keep_routing(path, second)
    kept = kept_routing(path)
    assert np.array_equal(kept.trace, np.concatenate([first.trace, second.trace]))
    assert np.array_equal(kept.predicted, np.concatenate([first.predicted, second.predicted]))


@pytest.mark.parametrize("damage", [b"not a numpy file", None])
def test_a_damaged_or_foreign_routing_trace_is_ignored_for_uniform_routing(tmp_path, damage):
    spec = ModelSpec(num_layers=2, hidden_size=64, ffn_size=128, num_experts=4, experts_used=2,
                     weight_type="Q8_0", seed=6)
    path = write_model(tmp_path / "moe.gguf", spec)
    if damage is None:  # a valid recording of another model: 3 layers, ids up to 7
        keep_routing(path, Routing(np.arange(48, dtype=np.int32).reshape(8, 3, 2) % 8))
    else:
        routing_path(path).write_bytes(damage)
    with Engine.load(path, threads=2, context_length=CONTEXT) as engine:
        assert engine.plan.experts.routing == "uniform routing"
