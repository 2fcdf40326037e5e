"""The planner: placements within budgets that hold the KV cache too, the minimum budget, the
cache's bytes per type and window, the cost model's trends, the CLI."""

import json
from dataclasses import replace

import psutil
import pytest
from typer.testing import CliRunner

from tests.support.budgets import ram_beside_weights
from tests.support.cli import run_tierflow
from tests.support.make_model import ModelSpec, write_model
from tierflow.cli.app import app
from tierflow.errors import BudgetError, PlanBudgetError
from tierflow.kv_types import KV_TYPES, cache_positions, kv_type, ring_positions
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.reader import PackedFile
from tierflow.offload.pack.writer import build_pack, pack_sizes
from tierflow.offload.plan import cost_model
from tierflow.offload.plan.budgets import kv_cache_bytes, layer_kv_bytes
from tierflow.offload.plan.planner import MAX_PREFETCH_DEPTH, make_plan
from tierflow.offload.plan.profile import BATCH_WIDTH, GpuProfile, HardwareProfile, profile_path
from tierflow.runtime.loading.loader import CacheOptions, resolve_budgets
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.units import format_size, parse_size

BITS = (1, 2, 3, 4, 8)
PROFILE = HardwareProfile(threads=2, cpu_name="Test CPU", disk_read_gbps=1.3, disk_direct_io=True,
                          ram_read_gbps=25.0, kernel_gbps={b: 20.0 for b in BITS},
                          kernel_batch_gbps={b: 60.0 for b in BITS}, layer_overhead_s=3e-5)
FAKE_GPU = GpuProfile(name="Fake GPU", memory_bytes=8 << 30, h2d_gbps=25.0, kernel_gbps={})
CTX = 256
DEEP = ModelSpec(num_layers=16, hidden_size=128, ffn_size=256, num_heads=4, num_kv_heads=2,
                 context_length=CTX)


@pytest.fixture(scope="module")
def deep_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("planner") / "deep.gguf", DEEP)


@pytest.fixture(scope="module")
def deep(deep_path):
    """(model file, pack sizes, globals extent bytes, layer extent bytes) of a 16-layer model."""
    with open_model_file(deep_path) as model:
        sizes = pack_sizes(model)
        yield model, sizes, sizes.globals.nbytes, [x.nbytes for x in sizes.layers]


@pytest.fixture(scope="module")
def beside(deep_path) -> int:
    """What cpu_memory holds beside the weights at CTX (an f16 cache, activations)."""
    return ram_beside_weights(deep_path, CTX)


def plan_for(model, cpu_budget, profile=PROFILE, gpu_budget=0, context_length=CTX, **kwargs):
    model_file, sizes, *_ = model
    return make_plan(model_file, sizes, profile, gpu_budget=gpu_budget, cpu_budget=cpu_budget,
                     context_length=context_length, **kwargs)


def smallest_budget(model, beside: int) -> int:
    _, _, globals_bytes, layers = model
    return globals_bytes + 2 * max(layers) + beside


@pytest.mark.parametrize("spec", [
    ModelSpec(),
    ModelSpec(arch="qwen2", weight_type="Q4_1", embedding_type="Q4_0", tied_embeddings=False),
    ModelSpec(weight_type="F16", embedding_type="Q6_K", llama3_rope_freqs=True, hidden_size=256, num_heads=4),
    ModelSpec(weight_type="Q5_K", hidden_size=256, ffn_size=512, num_heads=4),
    ModelSpec(num_experts=4, experts_used=2, weight_type="Q4_0"),
    ModelSpec(arch="qwen2moe", num_experts=4, experts_used=2, weight_type="Q8_0"),
    ModelSpec(arch="olmoe", num_experts=4, experts_used=2, num_kv_heads=4, weight_type="Q4_1"),
], ids=["q8_0", "qwen2-q4_1-untied", "f16-rope-freqs", "q5_k", "mixtral", "qwen2moe", "olmoe"])
def test_extents_match_the_pack_byte_for_byte(tmp_path, spec):
    with open_model_file(write_model(tmp_path / "m.gguf", spec)) as model:
        sizes = pack_sizes(model)
        globals_, layers, experts = sizes.globals, sizes.layers, sizes.experts
        build_pack(model, tmp_path / "m.tfpack")
    pack = PackedFile(tmp_path / "m.tfpack")
    assert globals_.nbytes == pack.globals.nbytes
    assert [x.nbytes for x in layers] == [x.nbytes for x in pack.layers]
    assert [[x.nbytes for x in xs] for xs in experts] == [[x.nbytes for x in xs] for xs in pack.experts]
    assert all(sum(n for _, n in x.groups) == x.nbytes for x in [globals_, *layers])


def test_when_everything_fits_nothing_streams(deep, beside):
    _, _, globals_bytes, layers = deep
    plan = plan_for(deep, globals_bytes + sum(layers) + beside)
    assert plan.streamed_layers == () and plan.prefetch_depth == 0 and plan.ring_bytes == 0
    assert plan.resident_layers == tuple(range(16)) and plan.decode.io_s == 0
    assert plan.used_bytes["cpu"] == globals_bytes + sum(layers) + plan.kv_bytes
    assert {g.home for g in plan.groups} == {"cpu"}


def test_the_budget_holds_the_kv_cache_beside_the_weights(deep, beside):
    _, _, globals_bytes, layers = deep
    weights = globals_bytes + sum(layers)
    assert plan_for(deep, weights + beside).streamed_layers == ()
    assert plan_for(deep, weights + beside - 1).streamed_layers != ()  # the weights alone no longer fit
    smaller = plan_for(deep, weights + beside - 1, kv=kv_type("q4_0"))  # a smaller cache leaves them room
    assert smaller.streamed_layers == () and smaller.kv_bytes < plan_for(deep, weights + beside).kv_bytes


def test_half_the_layer_bytes_streams_about_half_the_layers(deep, beside):
    _, _, globals_bytes, layers = deep
    budget = globals_bytes + sum(layers) // 2 + beside
    plan = plan_for(deep, budget)
    assert 8 <= len(plan.streamed_layers) <= 8 + MAX_PREFETCH_DEPTH + 1
    assert plan.ring_slot_bytes == max(layers)
    assert plan.ring_bytes == (plan.prefetch_depth + 1) * plan.ring_slot_bytes
    held = globals_bytes + sum(layers[i] for i in plan.resident_layers) + plan.ring_bytes + plan.kv_bytes
    assert plan.used_bytes["cpu"] == held <= budget - plan.activation_bytes
    assert plan.used_bytes["disk"] == sum(layers[i] for i in plan.streamed_layers)
    streamed = {g.layer for g in plan.groups if g.home == "disk"}
    assert streamed == set(plan.streamed_layers)


@pytest.fixture(scope="module")
def sweep(deep, beside):
    """Plans for budgets from the smallest workable to everything resident, largest first."""
    _, _, globals_bytes, layers = deep
    low, high = smallest_budget(deep, beside), globals_bytes + sum(layers) + beside + 4096
    budgets = sorted({low + (high - low) * k // 40 for k in range(41)}, reverse=True)
    return [(budget, plan_for(deep, budget)) for budget in budgets]


def test_plans_never_exceed_the_budget(sweep, deep):
    model, _, globals_bytes, layers = deep
    for budget, plan in sweep:
        assert plan.used_bytes["cpu"] + plan.activation_bytes <= budget
        assert plan.peak_bytes["prefill"]["cpu"] <= budget and plan.peak_bytes["decode"]["cpu"] <= budget
        placed = sorted(plan.gpu_layers + plan.resident_layers + plan.streamed_layers)
        assert placed == list(range(model.config.num_layers))
        assert (plan.prefetch_depth == 0) == (plan.streamed_layers == ())


def test_predictions_never_rise_as_the_budget_shrinks(sweep):
    decode = [plan.predicted_decode_tps for _, plan in sweep]
    prefill = [plan.predicted_prefill_tps for _, plan in sweep]
    assert all(a >= b * (1 - 1e-9) for a, b in zip(decode, decode[1:])), decode
    assert all(a >= b * (1 - 1e-9) for a, b in zip(prefill, prefill[1:])), prefill
    assert decode[0] > 2 * decode[-1]  # streaming most layers costs, on this disk


def test_decode_time_lies_between_full_overlap_and_none(sweep):
    for _, plan in sweep:
        d = plan.decode
        assert max(d.compute_s, d.io_s) * (1 - 1e-9) <= d.seconds <= (d.compute_s + d.io_s) * (1 + 1e-9)


def test_too_small_a_budget_names_the_smallest_that_works(deep, beside):
    exact = smallest_budget(deep, beside)
    plan_for(deep, exact)  # the smallest itself is accepted
    with pytest.raises(PlanBudgetError) as refused:
        plan_for(deep, exact - 1)
    error = refused.value
    assert isinstance(error, BudgetError) and error.minimum_bytes >= exact
    printed = format_size(error.minimum_bytes)
    assert f"at least {printed} is needed" in str(error) and "cpu_memory" in str(error)
    assert f"beside the KV cache and activations it keeps ({format_size(beside)})" in str(error)
    assert parse_size(printed.replace(" ", "")) >= exact
    plan_for(deep, error.minimum_bytes)


def test_a_slower_disk_predicts_slower_decode(deep, beside):
    _, _, globals_bytes, layers = deep
    budget = globals_bytes + sum(layers) // 2 + beside
    fast = plan_for(deep, budget, replace(PROFILE, disk_read_gbps=3.0))
    slow = plan_for(deep, budget, replace(PROFILE, disk_read_gbps=0.3))
    assert slow.predicted_decode_tps < fast.predicted_decode_tps
    # each may choose its own ring depth, so compare the seconds per streamed byte
    assert slow.decode.io_s / slow.used_bytes["disk"] == pytest.approx(
        10 * fast.decode.io_s / fast.used_bytes["disk"])


def test_the_gpu_takes_the_first_layers_that_fit_with_their_kv_caches(deep, beside):
    model, _, globals_bytes, layers = deep
    config = model.config
    profile = replace(PROFILE, gpu=FAKE_GPU)
    budget = globals_bytes + sum(layers) // 2 + beside
    kv_per_layer = layer_kv_bytes(config, 0, CTX, KV_TYPES["f16"])
    plan = plan_for(deep, budget, profile, gpu_budget=sum(layers[:3]) + 3 * kv_per_layer + 100)
    assert plan.gpu_layers == (0, 1, 2) and plan.used_bytes["gpu"] == sum(layers[:3]) + 3 * kv_per_layer
    assert plan.kv_gpu_bytes == 3 * kv_per_layer
    assert plan.used_bytes["cpu"] >= plan.kv_bytes - plan.kv_gpu_bytes  # the other layers' caches
    assert {(g.home, g.compute) for g in plan.groups if g.layer in (0, 1, 2)} == {("gpu", "gpu")}
    assert all(g.compute == "cpu" for g in plan.groups if g.layer not in (0, 1, 2))
    assert any("placeholder" in note for note in plan.notes)
    assert plan.peak_bytes["decode"]["gpu"] >= plan.used_bytes["gpu"]
    assert plan.predicted_decode_tps > plan_for(deep, budget, profile).predicted_decode_tps
    measured = replace(profile, gpu=replace(FAKE_GPU, kernel_gbps={4: 500.0, 8: 800.0}))
    assert plan_for(deep, budget, measured, gpu_budget=sum(layers)).notes == ()


def test_gpu_memory_without_a_gpu_is_refused(deep):
    with pytest.raises(BudgetError, match="no GPU"):
        plan_for(deep, 1 << 30, gpu_budget=1 << 30)


def test_a_deeper_ring_hides_reads_behind_a_long_unstreamed_stretch():
    # per pass: 5 s of compute without reads, then three streamed layers of a 2 s read each
    stages = [cost_model.Stage(5.0)] + [cost_model.Stage(0.0, 2.0)] * 3

    def period(depth: int) -> float:
        ends = cost_model.run_pipeline([stages] * 8, depth)
        return (ends[-1] - ends[-5]) / 4

    assert period(1) == pytest.approx(7.0)  # two slots: two reads run during the 5 s, one after
    assert period(2) == pytest.approx(6.0)  # all three do: disk-bound
    assert cost_model.run_pipeline([[cost_model.Stage(1.0), cost_model.Stage(2.0)]] * 2, 1) == [3.0, 6.0]


def test_the_chosen_layout_is_no_slower_than_the_earliest_layers(deep, sweep):
    model, sizes, *_ = deep
    globals_, layers = sizes.globals, sizes.layers
    costs = cost_model.Costs(PROFILE, model.config, KV_TYPES["f16"])
    for _, plan in sweep:
        if plan.streamed_layers:
            count = len(plan.resident_layers)
            earliest = cost_model.Layout((), tuple(range(count, 16)), plan.prefetch_depth)
            _, decode = cost_model.timings(earliest, globals_, layers, costs, plan.prompt_tokens, CTX)
            assert plan.decode.seconds <= decode.seconds * (1 + 1e-9)


def _product_seconds(deep, tokens: int) -> float:
    model, sizes, *_ = deep
    costs = cost_model.Costs(PROFILE, model.config, KV_TYPES["f16"])
    return costs.matmul_s(sizes.layers[0].linears, tokens, "cpu", tokens > 1)


def test_a_product_of_a_few_tokens_costs_more_than_one_tokens_and_less_than_that_many(deep):
    one = _product_seconds(deep, 1)
    widths = [_product_seconds(deep, t) for t in (2, 3, 4, 8, 16)]
    assert one < widths[0] < 2 * one  # each added token is work, batched below one token's cost
    assert widths == sorted(widths)
    assert widths[-1] < 16 * one


def test_a_product_as_wide_as_the_probes_costs_what_the_batched_rate_says(deep):
    model, sizes, *_ = deep
    linears = sizes.layers[0].linears
    batched = sum(BATCH_WIDTH * x.nbytes / (PROFILE.kernel_batch_gbps[x.bits or 8] * 1e9) for x in linears
                  if x.bits is not None)
    assert all(x.bits is not None for x in linears)
    assert _product_seconds(deep, BATCH_WIDTH) == pytest.approx(batched)
    assert _product_seconds(deep, 2 * BATCH_WIDTH) == pytest.approx(2 * batched)


def test_kv_bytes_are_the_caches(deep):
    config, f32 = deep[0].config, KV_TYPES["f32"]  # the type the cache stores so far
    assert kv_cache_bytes(config, CTX, f32) == KVCache(config, CTX).num_bytes
    assert kv_cache_bytes(config, 100, f32) == KVCache(config, 100).num_bytes


@pytest.mark.parametrize("name, bytes_per_32_values", [("f32", 128), ("f16", 64), ("q8_0", 34), ("q4_0", 18)])
def test_the_cache_is_counted_in_its_types_bytes(deep, name, bytes_per_32_values):
    c = deep[0].config  # head size 32: one quantized block per head and position
    positions = 112  # 100 rounded up to 16
    expected = 2 * c.num_layers * c.num_kv_heads * (c.head_dim // 32) * bytes_per_32_values * positions
    assert kv_cache_bytes(c, 100, kv_type(name)) == expected


def test_a_sliding_window_layer_is_counted_as_the_ring_it_stores(deep):
    config = replace(deep[0].config, layer_windows=(1000, 0) * 8)
    f16 = KV_TYPES["f16"]
    assert cache_positions(8192, 1000) == ring_positions(1000) == 1536 and cache_positions(8192, 0) == 8192
    assert layer_kv_bytes(config, 0, 8192, f16) * 8192 == layer_kv_bytes(config, 1, 8192, f16) * 1536
    assert kv_cache_bytes(config, 8192, f16) == 8 * (layer_kv_bytes(config, 0, 8192, f16)
                                                      + layer_kv_bytes(config, 1, 8192, f16))
    assert layer_kv_bytes(config, 0, 1024, f16) == layer_kv_bytes(config, 1, 1024, f16)  # shorter than a ring


def test_the_default_cpu_budget_is_available_ram_less_a_margin(deep, monkeypatch):
    class Memory:
        total, available = 16 << 30, 8 << 30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    budgets = resolve_budgets(deep[0], deep[1], None, 0, CacheOptions(context_length=CTX), PROFILE)
    margin = max(int(0.1 * Memory.total), 1 << 30)
    assert budgets.cpu_bytes == Memory.available - margin  # the KV cache is planned within it


def test_kv_on_cpu_keeps_every_cache_in_ram_and_leaves_the_gpu_to_layers(deep, beside):
    _, _, globals_bytes, layers = deep
    profile = replace(PROFILE, gpu=FAKE_GPU)
    gpu_budget = sum(layers[:3]) + 100
    budget = globals_bytes + sum(layers) + beside
    with_caches = plan_for(deep, budget, profile, gpu_budget=gpu_budget)
    on_cpu = plan_for(deep, budget, profile, gpu_budget=gpu_budget, kv_on_cpu=True)
    assert len(with_caches.gpu_layers) < 3 and on_cpu.gpu_layers == (0, 1, 2)
    assert on_cpu.kv_on_cpu and on_cpu.kv_gpu_bytes == 0 and on_cpu.used_bytes["gpu"] == sum(layers[:3])
    assert on_cpu.used_bytes["cpu"] == globals_bytes + sum(layers[3:]) + on_cpu.kv_bytes


def test_decode_is_predicted_reading_the_whole_cache_in_its_type(deep, beside):
    _, _, globals_bytes, layers = deep
    budget = globals_bytes + sum(layers) + 2 * beside  # room for the f32 cache too
    f32, f16 = (plan_for(deep, budget, kv=kv_type(name)) for name in ("f32", "f16"))
    read_s = (f32.kv_bytes - f16.kv_bytes) / (PROFILE.ram_read_gbps * 1e9)  # the cache is CTX positions
    assert f32.decode.compute_s - f16.decode.compute_s == pytest.approx(read_s)
    longer = plan_for(deep, budget, context_length=2 * CTX)
    assert longer.decode.compute_s - f16.decode.compute_s == pytest.approx(f16.kv_bytes / 1e9 /
                                                                           PROFILE.ram_read_gbps)


def test_rows_collapse_layers_placed_alike(deep, beside):
    _, _, globals_bytes, layers = deep
    rows = plan_for(deep, globals_bytes + sum(layers) + beside).rows()
    assert [label for label, *_ in rows] == ["embeddings", "layers 0-15 attention+ffn", "output head"]
    assert sum(n for _, n, *_ in rows) == globals_bytes + sum(layers)
    streaming = plan_for(deep, smallest_budget(deep, beside) + 3 * max(layers)).rows()
    assert {home for _, _, home, _ in streaming} == {"cpu", "disk"}
    assert sum(n for _, n, *_ in streaming) == globals_bytes + sum(layers)


# -- the command ----------------------------------------------------------------------------------

@pytest.fixture
def fake_profile(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERFLOW_CACHE", str(tmp_path))
    profile_path(2).write_text(PROFILE.to_json())
    monkeypatch.setattr("tierflow.runtime.loading.loader.load_profile", lambda threads, **kwargs: PROFILE)


def test_plan_command_prints_the_groups_and_the_summary(deep_path, deep, beside, fake_profile):
    budget = str(smallest_budget(deep, beside) + 3 * max(deep[3]))
    done = CliRunner().invoke(app, ["plan", str(deep_path), "--cpu-memory", budget, "--threads", "2"])
    assert done.exit_code == 0, done.output
    for text in ("embeddings", "attention+ffn", "disk", "prefetch ring", "decode", "tok/s"):
        assert text in done.output


def test_plan_command_shows_the_caches_type_tiers_and_context(deep_path, deep, fake_profile):
    done = CliRunner().invoke(app, ["plan", str(deep_path), "--threads", "2", "--kv-type", "q8_0",
                                    "--ctx", "128", "--cpu-memory", "1GiB"])
    assert done.exit_code == 0, done.output
    kv_bytes = kv_cache_bytes(deep[0].config, 128, KV_TYPES["q8_0"])
    assert "128 positions" in done.output
    assert f"q8_0, {format_size(kv_bytes)}: 0 B on GPU, {format_size(kv_bytes)} in RAM" in done.output


def test_plan_command_json_parses(deep_path, fake_profile):
    done = CliRunner().invoke(app, ["plan", "-m", str(deep_path), "--threads", "2", "--cpu-memory", "1GiB",
                                    "--ctx", "128", "--prompt-tokens", "64", "--json"])
    assert done.exit_code == 0, done.output
    plan = json.loads(done.stdout)
    assert plan["streamed_layers"] == [] and plan["resident_layers"] == list(range(16))
    assert plan["context_length"] == 128 and plan["prefill"]["tokens"] == 64 and plan["kv_type"] == "f16"
    assert plan["predicted_decode_tps"] > 0 and len(plan["groups"]) == 2 + 2 * 16


def test_plan_command_refuses_a_budget_that_cannot_work(deep_path, tmp_path):
    (tmp_path / "profile-2-threads.json").write_text(PROFILE.to_json())
    done = run_tierflow("plan", str(deep_path), "--threads", "2", "--cpu-memory", "1MiB",
                        env={"TIERFLOW_CACHE": str(tmp_path)})
    assert done.returncode == 2
    assert "at least" in done.stderr and len(done.stderr.strip().splitlines()) == 1
