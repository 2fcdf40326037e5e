"""Shared fixtures: the bundled real model, a loaded engine, and llama.cpp as the oracle."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.oracle import llama_cpp_model
from tierflow.offload.gguf.model_path import bundled_model_path
from tierflow.offload.plan.profile import HardwareProfile, profile_path

# Packs and profiles that tests write go to a folder of this run, never the user's cache (set at
# import, before any test or subprocess, so the CLI and server processes inherit it).
os.environ["TIERFLOW_CACHE"] = tempfile.mkdtemp(prefix="tierflow-test-cache-")
atexit.register(shutil.rmtree, os.environ["TIERFLOW_CACHE"], ignore_errors=True)

# A fixed hardware profile, so an engine that streams plans with it instead of measuring the
# machine first (the probe has tests of its own).
TEST_PROFILE = dict(cpu_name="Test CPU", disk_read_gbps=1.0, disk_direct_io=True, ram_read_gbps=20.0,
                    kernel_gbps={b: 10.0 for b in (1, 2, 3, 4, 8)},
                    kernel_batch_gbps={b: 30.0 for b in (1, 2, 3, 4, 8)}, layer_overhead_s=3e-5)
for _threads in (1, 2):
    profile_path(_threads).write_text(HardwareProfile(threads=_threads, **TEST_PROFILE).to_json())


@pytest.fixture(scope="session")
def model_path() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def engine(model_path):
    from tierflow import Engine

    with Engine.load(model_path, threads=2, context_length=1024) as engine:
        yield engine


@pytest.fixture(scope="session")
def oracle(model_path):
    llama = llama_cpp_model(model_path)
    yield llama
    llama.close()
