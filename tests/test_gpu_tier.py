"""The GPU tier's placement and budget, tested with torch's CPU device standing in for the GPU;
the CUDA copy path runs where a GPU is."""

import numpy as np
import pytest
import torch

from tierflow import Engine
from tierflow.errors import BudgetError, InvalidArgumentError
from tierflow.offload.tiers.device import DeviceTier
from tierflow.units import parse_size

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def expected(model_path):
    with Engine.load(model_path, threads=2, context_length=256) as engine:
        result = engine.generate(PROMPT, max_tokens=16, temperature=0)
        return result.tokens, engine.logits(result.tokens)


@pytest.mark.slow
def test_layers_on_the_stand_in_gpu_give_the_same_tokens_and_logits(model_path, expected):
    stand_in = dict(threads=2, context_length=256, gpu_memory="20MiB", gpu_device="cpu")
    with Engine.load(model_path, **stand_in) as engine:
        tokens = engine.generate(PROMPT, max_tokens=16, temperature=0).tokens
        assert tokens == expected[0]
        assert np.array_equal(engine.logits(tokens), expected[1])


def test_the_gpu_tier_holds_the_earliest_layers_within_its_budget(model_path):
    stand_in = dict(threads=2, context_length=256, gpu_memory="20MiB", gpu_device="cpu")
    with Engine.load(model_path, **stand_in) as engine:
        used = engine.weights.bytes_by_tier()["gpu"]
        layers = engine.weights.gpu_layers
    assert 0 < used <= parse_size("20MiB")
    assert layers == list(range(len(layers))) and layers


def test_gpu_ram_and_disk_tiers_together_give_the_same_tokens(model_path, expected):
    with Engine.load(model_path, threads=2, context_length=256, gpu_memory="30MiB", gpu_device="cpu",
                     cpu_memory="52MiB") as engine:
        tiers = engine.weights.bytes_by_tier()
        assert tiers["gpu"] > 0 and tiers["disk"] > 0 and tiers["cpu"] <= parse_size("52MiB")
        assert engine.generate(PROMPT, max_tokens=16, temperature=0).tokens == expected[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is there: gpu_memory is taken")
def test_gpu_memory_without_a_cuda_gpu_is_refused(model_path):
    with pytest.raises(BudgetError, match="gpu_memory was given but no CUDA GPU"):
        Engine.load(model_path, gpu_memory="1GiB")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_on_a_cuda_gpu_places_the_first_layers_there(model_path):
    with Engine.load(model_path, threads=2, context_length=256, gpu_memory="64MiB") as engine:
        assert engine.weights.gpu_layers == list(range(len(engine.weights.gpu_layers))) != []
        assert engine.weights.device.device.type == "cuda"
        assert engine.generate("The capital of France is", max_tokens=4, temperature=0).tokens


def test_an_unknown_gpu_device_is_refused(model_path):
    with pytest.raises(InvalidArgumentError, match="gpu_device"):
        Engine.load(model_path, gpu_memory="1GiB", gpu_device="tpu")


def test_the_device_tier_refuses_what_exceeds_its_budget():
    tier = DeviceTier(torch.device("cpu"), budget=100)
    assert bytes(tier.upload(memoryview(bytes(range(60)))).numpy()) == bytes(range(60))
    with pytest.raises(BudgetError, match="gpu_memory"):
        tier.upload(memoryview(bytes(60)))
    assert tier.used == 60


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copies_run_on_a_side_stream_from_pinned_memory_and_are_awaited():
    tier = DeviceTier(torch.device("cuda"), budget=64 << 20)
    data = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
    copy = tier.upload(memoryview(data))
    assert copy.device.type == "cuda" and tier._stream is not None
    tier.ready(copy)  # the default stream waits on the copy's event
    assert np.array_equal(copy.cpu().numpy(), data)
