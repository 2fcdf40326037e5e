"""The decoder's fixed cost per layer, measured at the planned model's shape without loading it."""

from dataclasses import replace

import pytest

from tests.support.make_model import ModelSpec, write_model
from tests.support.test_cache import TEST_PROFILE
from tierflow import Engine
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.plan.probe import load_profile, save_profile
from tierflow.offload.plan.profile import HardwareProfile
from tierflow.runtime.loading import loader
from tierflow.runtime.loading.overhead import measure_layer_overhead, shape_key

STREAMED = ModelSpec(num_layers=8, hidden_size=256, ffn_size=512, num_heads=4, num_kv_heads=2, seed=3)


def test_the_overhead_is_measured_without_loading_any_weights(model_path, monkeypatch):
    monkeypatch.setattr(Engine, "load", lambda *args, **kwargs: pytest.fail("the probe loaded a model"))
    monkeypatch.setattr(loader, "open_pack", lambda *args, **kwargs: pytest.fail("the probe read a pack"))
    with open_model_file(model_path) as model:
        seconds = measure_layer_overhead(model.arch, model.config, threads=2)
    assert 0 < seconds < 0.01


def test_a_wider_model_costs_more_per_layer(model_path):
    with open_model_file(model_path) as model:
        narrow = replace(model.config, hidden_size=64, ffn_size=128, num_heads=2, num_kv_heads=1, head_dim=32,
                         rope_dim=32)
        wide = replace(model.config, hidden_size=8192, ffn_size=28672, num_heads=64, num_kv_heads=8,
                       head_dim=128, rope_dim=128)
        assert measure_layer_overhead(model.arch, wide, 2) > measure_layer_overhead(model.arch, narrow, 2)


def test_a_streamed_load_measures_its_shape_once_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERFLOW_CACHE", str(tmp_path / "cache"))  # no shape measured yet
    save_profile(HardwareProfile(threads=2, **TEST_PROFILE))
    path = write_model(tmp_path / "streamed.gguf", STREAMED)
    with open_model_file(path) as model:
        key = shape_key(model.config)
    assert key not in load_profile(2).overhead_by_shape
    with Engine.load(path, threads=2, cpu_memory="15MiB", context_length=64) as engine:
        assert engine.plan.streamed_layers
    assert key in load_profile(2).overhead_by_shape
    monkeypatch.setattr(loader, "measure_layer_overhead", lambda *args: pytest.fail("measured twice"))
    Engine.load(path, threads=2, cpu_memory="15MiB", context_length=64).close()
