"""The one loader: `tierflow plan` prints the placement that Engine.load then holds, under any
budget, the default included (both resolve budgets through runtime/loading/loader.py); the context and
the KV cache a load gets, and the ones it refuses."""

import json

import numpy as np
import psutil
import pytest
from typer.testing import CliRunner

from tests.support.budgets import ram_beside_weights
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.cli.app import app
from tierflow.errors import BudgetError, ContextLengthError, InvalidArgumentError
from tierflow.offload.plan.context import CONTEXT_STEP

SPEC = ModelSpec(num_layers=8, hidden_size=256, ffn_size=512, num_heads=4, num_kv_heads=2, context_length=256)
# A long trained context beside small weights: its cache and activations are what a budget binds.
LONG_SPEC = ModelSpec(num_layers=4, hidden_size=256, ffn_size=256, num_heads=4, num_kv_heads=4,
                      context_length=4096)


class Memory:  # the machine's RAM as psutil reports it, fixed so the default budget is too
    total, available = 16 << 30, 6 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("loader") / "model.gguf", SPEC)


@pytest.fixture(scope="module")
def sizes(model):
    with Engine.load(model, threads=2, context_length=128) as engine:
        packed = engine.weights.packed
        return packed.globals.nbytes, [x.nbytes for x in packed.layers]


def budget_for(name: str, sizes, beside: int) -> int | None:
    globals_bytes, layers = sizes
    weights = {"default": None, "everything": globals_bytes + sum(layers),
               "half": globals_bytes + sum(layers) // 2,
               "smallest": globals_bytes + 2 * max(layers)}[name]
    return None if weights is None else weights + beside


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("loader") / "long.gguf", LONG_SPEC)


@pytest.fixture(scope="module")
def long_weights(long_model) -> int:
    with Engine.load(long_model, threads=2, context_length=128) as engine:
        return engine.plan.weight_bytes()["cpu"]


@pytest.mark.parametrize("budget", ["default", "everything", "half", "smallest"])
def test_the_plan_tierflow_plan_prints_is_the_one_the_engine_holds(model, sizes, budget, monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    cpu_memory = budget_for(budget, sizes, ram_beside_weights(model, 128))
    options = ["--threads", "2", "--ctx", "128"]
    options += [] if cpu_memory is None else ["--cpu-memory", str(cpu_memory)]
    done = CliRunner().invoke(app, ["plan", str(model), "--json", *options])
    assert done.exit_code == 0, done.output
    printed = json.loads(done.stdout)
    load = {} if cpu_memory is None else {"cpu_memory": cpu_memory}
    with Engine.load(model, threads=2, context_length=128, **load) as engine:
        held = json.loads(json.dumps(engine.plan.placement()))
        assert engine.weights.streamed_layers == printed["streamed_layers"]
        assert engine.weights.gpu_layers == printed["gpu_layers"]
    assert held == {key: printed[key] for key in held}
    assert bool(printed["streamed_layers"]) == (budget in ("half", "smallest"))


def test_a_default_context_the_budget_cannot_hold_is_the_largest_that_fits(long_model, long_weights):
    budget = long_weights + ram_beside_weights(long_model, 1024)  # every weight and a 1024-position cache
    with Engine.load(long_model, threads=2, cpu_memory=budget) as engine:
        context = engine.context_length
        assert 1024 <= context < LONG_SPEC.context_length and context % CONTEXT_STEP == 0
        (notice,) = engine.notices
        assert f"{context} positions, not the model's {LONG_SPEC.context_length}" in notice
        assert notice in engine.plan.notes
        assert engine.plan.used_bytes["cpu"] + engine.plan.activation_bytes <= budget
    with pytest.raises(BudgetError, match=f"at most {context} positions fits"):  # the largest that does
        Engine.load(long_model, threads=2, cpu_memory=budget, context_length=context + CONTEXT_STEP)


def test_a_budget_no_context_fits_names_what_the_smallest_context_needs(long_model):
    with pytest.raises(BudgetError) as smallest:
        Engine.load(long_model, threads=2, cpu_memory="1MiB", context_length=CONTEXT_STEP)
    with pytest.raises(BudgetError) as default:  # not the trained context's need, many times more
        Engine.load(long_model, threads=2, cpu_memory="1MiB")
    assert default.value.minimum_bytes == smallest.value.minimum_bytes


def test_the_trained_context_is_the_default_when_the_budget_holds_it(long_model, long_weights):
    budget = long_weights + ram_beside_weights(long_model, LONG_SPEC.context_length)
    with Engine.load(long_model, threads=2, cpu_memory=budget) as engine:
        assert engine.context_length == LONG_SPEC.context_length and engine.notices == ()
        assert engine.plan.streamed_layers == ()


def test_a_context_past_the_trained_one_is_refused_naming_both_unless_asked_for(model):
    with pytest.raises(ContextLengthError, match="context_length 512 exceeds the 256 positions"):
        Engine.load(model, threads=2, context_length=512)
    with Engine.load(model, threads=2, context_length=512, allow_context_extension=True) as engine:
        assert engine.context_length == 512
        prompt = list(range(1, 301))  # past the trained 256 positions
        assert len(engine.generate(prompt, max_tokens=2, temperature=0).tokens) == 2


def test_an_unknown_kv_cache_type_names_the_valid_ones(model):
    with pytest.raises(InvalidArgumentError, match="unknown KV cache type 'q5_0': choose one of f32, f16, "
                                                    "q8_0, q4_0"):
        Engine.load(model, threads=2, kv_cache_type="q5_0")


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_a_quantized_cache_on_a_head_size_not_a_multiple_of_32_is_refused_naming_it(tmp_path, name):
    path = write_model(tmp_path / "m.gguf", ModelSpec(hidden_size=64, num_heads=4))  # heads of 16
    with pytest.raises(InvalidArgumentError, match=f"{name} .* head size is 16"):
        Engine.load(path, threads=2, kv_cache_type=name)


def test_the_engine_reports_the_bytes_its_cache_holds(model):
    with Engine.load(model, threads=2, context_length=100, kv_cache_type="f32") as engine:
        held = sum(a.nbytes for a in [*engine._generator.cache.keys, *engine._generator.cache.values])
        assert engine.kv_cache_bytes == held == engine.plan.kv_bytes
        assert engine.plan.kv_type == "f32" and engine._generator.cache.kv_type.name == "f32"


def test_kv_on_cpu_keeps_the_gpu_layers_caches_in_ram(model):
    stand_in = dict(threads=2, context_length=128, gpu_memory="64MiB", gpu_device="cpu")
    with Engine.load(model, **stand_in) as on_gpu:
        expected = on_gpu.generate("The capital of France is", max_tokens=4, temperature=0).tokens
        device_bytes, cache_bytes = on_gpu.weights.bytes_by_tier()["gpu"], on_gpu.kv_cache_bytes
    with Engine.load(model, kv_on_cpu=True, **stand_in) as engine:
        assert engine.weights.gpu_layers == list(range(SPEC.num_layers))
        assert engine.plan.kv_gpu_bytes == 0 and engine.plan.kv_on_cpu
        assert engine.weights.bytes_by_tier()["gpu"] == device_bytes - cache_bytes
        assert all(isinstance(a, np.ndarray) for a in engine._generator.cache.keys)
        assert engine.generate("The capital of France is", max_tokens=4, temperature=0).tokens == expected
