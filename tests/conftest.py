"""Shared fixtures: the bundled real model, a loaded engine, and llama.cpp as the oracle."""

from pathlib import Path

import pytest

from tests.support.oracle import llama_cpp_model
from tests.support.test_cache import use_test_cache
from tierflow.offload.gguf.model_path import bundled_model_path

# Set at import, before any test or subprocess, so the CLI and server processes inherit it.
use_test_cache()


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
