"""The one loader: `tierflow plan` prints the placement that Engine.load then holds, under any
budget, the default included (both resolve budgets through runtime/loader.py)."""

import json

import psutil
import pytest
from typer.testing import CliRunner

from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.cli.app import app

SPEC = ModelSpec(num_layers=8, hidden_size=256, ffn_size=512, num_heads=4, num_kv_heads=2, context_length=256)


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


def budget_for(name: str, sizes) -> str | None:
    globals_bytes, layers = sizes
    return {"default": None, "everything": globals_bytes + sum(layers),
            "half": globals_bytes + sum(layers) // 2,
            "smallest": globals_bytes + 2 * max(layers)}[name]


@pytest.mark.parametrize("budget", ["default", "everything", "half", "smallest"])
def test_the_plan_tierflow_plan_prints_is_the_one_the_engine_holds(model, sizes, budget, monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    cpu_memory = budget_for(budget, sizes)
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
