"""The planner on mixture-of-experts models: every expert gets a home, the cache its budget, the
engine places experts as the plan says, and `tierflow plan` shows it."""

import re
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.support.budgets import ram_beside_weights
from tests.support.make_model import ModelSpec, write_model
from tests.test_planner import FAKE_GPU, PROFILE
from tierflow import Engine
from tierflow.cli.app import app
from tierflow.errors import PlanBudgetError
from tierflow.offload.experts.routing_trace import NOT_PREDICTED, Routing
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan.expert_plan import READ_AHEAD_SHARE, ExpertRequest
from tierflow.offload.plan.pass_costs import PassCosts
from tierflow.offload.plan.planner import make_plan
from tierflow.units import parse_size

CTX = 128
SPEC = ModelSpec(num_layers=4, hidden_size=128, ffn_size=256, num_experts=8, experts_used=2,
                 weight_type="Q4_0", embedding_type="Q4_0", context_length=CTX, seed=3)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("expert-plan") / "moe.gguf", SPEC)


@pytest.fixture(scope="module")
def moe(moe_path):
    """(model file, its pack sizes and what cpu_memory holds beside its weights; config, bytes of
    everything but the experts, one expert's bytes, all experts' bytes)."""
    with open_model_file(moe_path) as model:
        sizes = pack_sizes(model)
        experts = [x.nbytes for layer in sizes.experts for x in layer]
        yield ((model, sizes, ram_beside_weights(moe_path, CTX)), model.config,
               sizes.globals.nbytes + sum(x.nbytes for x in sizes.layers), max(experts), sum(experts))


def cpu_memory(moe, weight_bytes: int) -> int:
    """The budget that leaves `weight_bytes` to the weights."""
    (_, _, beside), *_ = moe
    return weight_bytes + beside


def plan_for(moe, weight_bytes, profile=PROFILE, gpu_budget=0):
    """The plan whose cpu_memory leaves `weight_bytes` to the weights."""
    (model, sizes, _), *_ = moe
    return make_plan(model, sizes, profile, gpu_budget=gpu_budget, cpu_budget=cpu_memory(moe, weight_bytes),
                     context_length=CTX)


def test_a_moe_model_that_fits_keeps_every_expert_in_ram(moe):
    _, config, base, _, all_experts = moe
    plan = plan_for(moe, base + all_experts)
    assert plan.experts.home == "cpu" and plan.experts.ram_cache_bytes == plan.experts.gpu_cache_bytes == 0
    assert plan.experts.served == {"gpu": 0.0, "cpu": 1.0, "disk": 0.0}
    assert plan.used_bytes == {"gpu": 0, "cpu": base + all_experts + plan.kv_bytes, "disk": 0}
    assert plan.decode.io_s == 0


def test_every_expert_is_a_group_with_its_home(moe):
    _, config, base, one, _ = moe
    plan = plan_for(moe, base + 12 * one)
    experts = [g for g in plan.groups if g.name == "expert"]
    assert sorted((g.layer, g.expert) for g in experts) == [(i, e) for i in range(4) for e in range(8)]
    assert {(g.home, g.compute) for g in experts} == {("disk", "cpu")}
    assert ("layers 0-3 experts 0-7", 32 * one, "disk", "cpu") in plan.rows()


def test_experts_over_budget_live_on_disk_behind_a_cache_of_the_ram_left(moe):
    _, _, base, one, all_experts = moe
    plan = plan_for(moe, base + 12 * one)
    assert plan.experts.home == "disk" and plan.experts.gpu_cache_bytes == 0
    assert plan.experts.ram_cache_bytes == 12 * one and plan.experts.ram_cached_experts == 12
    assert plan.used_bytes == {"gpu": 0, "cpu": base + 12 * one + plan.kv_bytes, "disk": all_experts}
    assert plan.experts.served["cpu"] == pytest.approx(12 / 32)
    assert plan.experts.bytes_per_token["disk"] == pytest.approx(4 * 2 * (1 - 12 / 32) * one)


def test_a_bigger_expert_cache_predicts_faster_decode_and_fewer_reads(moe):
    _, _, base, one, _ = moe
    plans = [plan_for(moe, base + held * one) for held in (8, 16, 24, 31)]
    speeds = [p.predicted_decode_tps for p in plans]
    reads = [p.decode.io_s for p in plans]
    assert speeds == sorted(speeds) and speeds[0] < speeds[-1]
    assert reads == sorted(reads, reverse=True) and reads[0] > reads[-1] > 0


def test_decode_reads_are_the_predicted_misses_over_the_disk_speed(moe):
    _, config, base, one, _ = moe
    plan = plan_for(moe, base + 12 * one)
    predicted = READ_AHEAD_SHARE * plan.experts.bytes_per_token["disk"] / (PROFILE.disk_read_gbps * 1e9)
    assert plan.decode.io_s == pytest.approx(predicted, rel=0.02)  # experts' extents vs the largest


def skewed_routing(predicted_right: float) -> Routing:
    """64 tokens of routing: expert 0 and one of 1-7 at every layer, each layer's choice predicted
    right (bar the first layer's, predicted never) for the first `predicted_right` of the tokens,
    and wrong (experts 0 and 1 of 2-7 guessed for expert 1) for the others."""
    trace = np.zeros((64, 4, 2), dtype=np.int32)
    trace[..., 1] = 1 + np.arange(64)[:, None] % 7
    predicted = trace.copy()
    wrong = np.arange(64) >= predicted_right * 64
    predicted[wrong, :, 1] = np.where(trace[wrong, :, 1] == 1, 2, 1)
    predicted[:, 0] = NOT_PREDICTED
    return Routing(trace, predicted)


def plan_with_routing(moe, weight_bytes: int, routing: Routing):
    (model, sizes, _), *_ = moe
    return make_plan(model, sizes, PROFILE, gpu_budget=0, cpu_budget=cpu_memory(moe, weight_bytes),
                     context_length=CTX, routing=routing)


def test_the_read_ahead_is_the_recorded_predictions_share_of_the_uses_served_by_disk(moe):
    _, _, base, one, _ = moe
    plan = plan_with_routing(moe, base + 8 * one, skewed_routing(predicted_right=0.5))
    # the cache holds each layer's experts 0 and 1 (the most used, 1 by a token); the disk serves
    # 2-7, whose uses are predicted for the first half of the tokens (27 of their 54 uses) at
    # layers 1-3 and never at layer 0
    assert plan.experts.read_ahead == pytest.approx(0.5 * 3 / 4)
    assert plan.experts.read_ahead_measured
    assert "38% a layer early, as the recorded predictions say" in plan.table()


def test_a_better_recorded_prediction_predicts_fewer_reads_waited_for(moe):
    _, _, base, one, _ = moe
    plans = [plan_with_routing(moe, base + 8 * one, skewed_routing(right)) for right in (0.0, 0.5, 1.0)]
    assert [p.experts.read_ahead for p in plans] == pytest.approx([0.0, 0.375, 0.75])
    decode = [p.decode for p in plans]
    assert decode[0].io_s < decode[1].io_s < decode[2].io_s  # more reads overlap the layer before
    assert plans[0].predicted_decode_tps <= plans[1].predicted_decode_tps <= plans[2].predicted_decode_tps


def test_a_trace_without_recorded_predictions_assumes_the_read_ahead(moe):
    _, _, base, one, _ = moe
    plan = plan_with_routing(moe, base + 8 * one, Routing(skewed_routing(1.0).trace))
    assert plan.experts.read_ahead == READ_AHEAD_SHARE and not plan.experts.read_ahead_measured
    assert "a layer early, assumed" in plan.table()


def test_a_budget_without_room_for_one_layers_experts_names_the_least_that_works(moe):
    _, _, base, one, _ = moe
    with pytest.raises(PlanBudgetError, match="the least that works is") as refused:
        plan_for(moe, base + 7 * one)
    least = refused.value.minimum_bytes - cpu_memory(moe, 0)
    assert plan_for(moe, least).experts.ram_cache_bytes >= 8 * one
    assert "gpu_memory" not in str(refused.value)  # the profile has no GPU


def test_a_ram_too_small_for_the_experts_names_the_gpu_memory_that_takes_layers_off_it(moe):
    (model, sizes, _), _, base, one, _ = moe
    profile, budget = replace(PROFILE, gpu=FAKE_GPU), cpu_memory(moe, base + 7 * one)
    with pytest.raises(PlanBudgetError, match="or with gpu_memory") as refused:
        make_plan(model, sizes, profile, gpu_budget=0, cpu_budget=budget, context_length=CTX)
    least_gpu = parse_size(re.search(r"or with gpu_memory ([\d.]+ \w+)", str(refused.value)).group(1))
    plan = make_plan(model, sizes, profile, gpu_budget=least_gpu, cpu_budget=budget, context_length=CTX)
    assert plan.gpu_layers and plan.experts.ram_cache_bytes >= 8 * one


def test_a_gpu_budget_takes_the_layers_first_then_caches_experts_in_the_rest(moe):
    (_, sizes, _), config, base, one, all_experts = moe
    profile = replace(PROFILE, gpu=replace(FAKE_GPU, kernel_gbps={4: 200.0}))
    layers = sum(x.nbytes for x in sizes.layers)
    kv = plan_for(moe, base + all_experts).kv_bytes
    globals_ = base - layers
    plan = plan_for(moe, globals_ + all_experts, profile, gpu_budget=layers + kv + 10 * one)
    assert plan.gpu_layers == (0, 1, 2, 3) and plan.kv_gpu_bytes == kv
    assert plan.experts.home == "cpu" and plan.experts.gpu_cached_experts == 10
    assert plan.used_bytes["gpu"] == layers + kv + 10 * one
    assert {g.compute for g in plan.groups if g.name == "expert"} == {"cpu or gpu"}
    assert plan.experts.scheduler.gpu_gbps == 200.0 and plan.experts.scheduler.copy_gbps == FAKE_GPU.h2d_gbps
    assert plan.experts.served["gpu"] == pytest.approx(10 / 32)


def test_three_tiers_serve_the_uses_in_order_gpu_ram_disk(moe):
    (_, sizes, _), _, base, one, all_experts = moe
    layers = sum(x.nbytes for x in sizes.layers)
    kv = plan_for(moe, base + all_experts).kv_bytes
    # cpu_memory's KV cache moves to the GPU with the layers: 12 experts' room is left in RAM
    plan = plan_for(moe, base - layers - kv + 12 * one, replace(PROFILE, gpu=FAKE_GPU),
                    gpu_budget=layers + kv + 6 * one)
    experts = plan.experts
    assert experts.home == "disk" and (experts.gpu_cached_experts, experts.ram_cached_experts) == (6, 12)
    assert experts.served == pytest.approx({"gpu": 6 / 32, "cpu": 12 / 32, "disk": 14 / 32})
    assert plan.used_bytes["disk"] == all_experts
    summary = dict(plan.summary())
    assert "a cache of 6" in summary["experts on GPU"] and "a cache of 12" in summary["experts in RAM"]
    assert "44% of uses" in summary["experts on disk"]


def test_more_gpu_memory_for_experts_predicts_faster_decode(moe):
    (_, sizes, _), _, base, one, all_experts = moe
    layers = sum(x.nbytes for x in sizes.layers)
    kv = plan_for(moe, base + all_experts).kv_bytes
    speeds = [plan_for(moe, base - layers + 12 * one, replace(PROFILE, gpu=FAKE_GPU),
                       gpu_budget=layers + kv + held * one).predicted_decode_tps for held in (2, 8, 16)]
    assert speeds == sorted(speeds) and speeds[0] < speeds[-1]


def test_a_gpu_budget_too_small_for_the_layers_leaves_some_in_ram_and_says_so(moe):
    (_, sizes, _), _, base, one, all_experts = moe
    plan = plan_for(moe, base + all_experts, replace(PROFILE, gpu=FAKE_GPU),
                    gpu_budget=sizes.layers[0].nbytes // 2)
    assert plan.gpu_layers == ()
    assert any("the other layers compute in RAM" in note for note in plan.notes)


def test_a_routing_trace_credits_the_gpu_cache_with_the_most_used_experts(moe):
    (model, sizes, _), config, base, one, all_experts = moe
    routing = skewed_routing(predicted_right=1.0)  # expert 0 in every token's top-2 at every layer
    layers = sum(x.nbytes for x in sizes.layers)
    kv = plan_for(moe, base + all_experts).kv_bytes
    plan = make_plan(model, sizes, replace(PROFILE, gpu=FAKE_GPU), gpu_budget=layers + kv + 4 * one,
                     cpu_budget=cpu_memory(moe, base + all_experts), context_length=CTX, routing=routing)
    assert plan.experts.served["gpu"] == pytest.approx(0.5)  # each layer's expert 0: half of all uses
    assert plan.experts.routing == "a routing trace of 64 tokens"
    uniform = plan_for(moe, base - layers + all_experts, replace(PROFILE, gpu=FAKE_GPU),
                       gpu_budget=layers + kv + 4 * one)
    assert uniform.experts.served["gpu"] == pytest.approx(4 / 32)
    assert uniform.experts.routing == "uniform routing"


def test_experts_placed_by_hand_are_on_the_gpu_or_off_it_by_layer(moe):
    (model, sizes, _), config, base, one, all_experts = moe
    layers = sum(x.nbytes for x in sizes.layers)
    kv = plan_for(moe, base + all_experts).kv_bytes
    plan = make_plan(model, sizes, replace(PROFILE, gpu=FAKE_GPU), gpu_budget=layers + kv + 16 * one,
                     cpu_budget=cpu_memory(moe, base - layers + 16 * one), context_length=CTX,
                     expert_request=ExpertRequest(cpu_layers=2))
    assert plan.experts.gpu_layers == (2, 3) and plan.experts.gpu_cache_bytes == 0
    homes = {(g.layer, g.home, g.compute) for g in plan.groups if g.name == "expert"}
    assert homes == {(0, "cpu", "cpu"), (1, "cpu", "cpu"), (2, "gpu", "gpu"), (3, "gpu", "gpu")}
    assert plan.experts.served == pytest.approx({"gpu": 0.5, "cpu": 0.5, "disk": 0.0})


def verify_seconds(moe, plan, tokens: int) -> float:
    (_, sizes, _), config, *_ = moe
    return PassCosts(plan, config, sizes, PROFILE).seconds(tokens)


def test_a_verify_pass_over_streamed_experts_is_predicted_to_read_the_experts_its_tokens_fire(moe):
    _, _, base, one, _ = moe
    plan = plan_for(moe, base + 8 * one)
    assert verify_seconds(moe, plan, 8) > 2 * verify_seconds(moe, plan, 1)  # ~6 of 8 experts, not 2


def test_a_union_cap_is_predicted_to_make_a_verify_pass_cheaper(moe):
    (model, sizes, _), _, base, one, _ = moe
    capped = make_plan(model, sizes, PROFILE, gpu_budget=0, cpu_budget=cpu_memory(moe, base + 8 * one),
                       context_length=CTX,
                       expert_request=ExpertRequest(union_cap=2))
    exact = plan_for(moe, base + 8 * one)
    assert verify_seconds(moe, capped, 8) < verify_seconds(moe, exact, 8)
    assert verify_seconds(moe, capped, 1) == pytest.approx(verify_seconds(moe, exact, 1))


def test_the_engine_places_experts_as_the_plan_says(moe, moe_path):
    _, _, base, one, all_experts = moe
    budget = base + 12 * one
    plan = plan_for(moe, budget)
    with Engine.load(moe_path, threads=2, context_length=CTX, cpu_memory=cpu_memory(moe, budget)) as engine:
        assert engine.weights.experts.cache.budget_bytes == plan.experts.ram_cache_bytes
        assert engine.weights.bytes_by_tier()["disk"] == plan.used_bytes["disk"] == all_experts


def test_plan_command_shows_the_experts_and_their_cache(moe_path, moe, monkeypatch):
    _, _, base, one, _ = moe
    monkeypatch.setattr("tierflow.offload.plan.probe.load_profile", lambda threads, **kwargs: PROFILE)
    budget = cpu_memory(moe, base + 12 * one)
    done = CliRunner().invoke(app, ["plan", str(moe_path), "--cpu-memory", str(budget), "--threads", "2",
                                    "--ctx", str(CTX)])
    assert done.exit_code == 0, done.output
    for text in ("experts 0-7", "attention+router", "experts in RAM", "a cache of 12", "uniform routing",
                 "experts on disk"):
        assert text in done.output


def test_the_plan_says_which_experts_were_placed_by_hand(moe):
    (model, sizes, _), _, base, one, all_experts = moe
    gpu = sum(x.nbytes for x in sizes.layers) + plan_for(moe, base + all_experts).kv_bytes + 16 * one
    plan = make_plan(model, sizes, replace(PROFILE, gpu=FAKE_GPU), gpu_budget=gpu,
                     cpu_budget=cpu_memory(moe, base + all_experts), context_length=CTX,
                     expert_request=ExpertRequest(cpu_layers=2))
    assert dict(plan.summary())["experts on GPU"].startswith("every expert of layers 2-3, placed by hand")


def test_cpu_moe_and_n_cpu_moe_together_are_refused(moe_path):
    done = CliRunner().invoke(app, ["plan", str(moe_path), "--cpu-moe", "--n-cpu-moe", "2"])
    assert done.exit_code != 0 and "give one of them" in " ".join(done.output.replace("│", " ").split())
