"""Shared fixtures: the bundled real model, a loaded engine, and llama.cpp as the oracle."""

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

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


def load_gpu_kernels_or_skip() -> bool:
    """Loads the GPU kernels, in Triton's interpreter without CUDA (before anything imports
    Triton: the interpreter is chosen when it is imported), or skips the calling test module.
    Returns whether CUDA is there."""
    from tierflow.gpu_kernels.launch import TritonUnavailableError, load_all_kernels

    if importlib.util.find_spec("triton") is None:
        pytest.skip("the GPU kernels need triton", allow_module_level=True)
    cuda = torch.cuda.is_available()
    try:
        load_all_kernels(interpret=not cuda)
    except (RuntimeError, TritonUnavailableError) as error:
        pytest.skip(f"the GPU kernels cannot be loaded here: {error}", allow_module_level=True)
    return cuda


def llama_cpp_model(path: Path, n_ctx: int = 512, f32_kv: bool = False):
    """llama.cpp on the same file, with logits kept for every position.

    One thread: ggml's spinning thread barrier slows a hundredfold when another process holds a
    core. Its KV cache is float16 unless f32_kv, which makes float32 weights an exact oracle.
    """
    from llama_cpp import GGML_TYPE_F32, Llama

    kv_type = GGML_TYPE_F32 if f32_kv else None
    return Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=1,
                 verbose=False, seed=0, type_k=kv_type, type_v=kv_type)


@pytest.fixture(scope="session")
def oracle(model_path):
    llama = llama_cpp_model(model_path)
    yield llama
    llama.close()
