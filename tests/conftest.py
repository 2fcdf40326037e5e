"""Shared fixtures: the bundled real model, a loaded engine, llama.cpp as the oracle, a server on
the engine, and the pack builds a test causes."""

from pathlib import Path

import pytest

from tests.support.live_server import running_server
from tests.support.oracle import llama_cpp_model
from tests.support.test_cache import use_test_cache
from tierflow.offload.gguf.model_path import bundled_model_path
from tierflow.offload.pack import writer

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


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """The paths build_pack writes, in order, as loads call it."""
    paths, build = [], writer.build_pack

    def counted(model, path, *args, **kwargs):
        paths.append(path)
        return build(model, path, *args, **kwargs)

    monkeypatch.setattr(writer, "build_pack", counted)
    return paths


@pytest.fixture(scope="module")
def url(engine):
    """The base URL of a server on the engine, with the default settings, for a test module."""
    with running_server(engine) as base:
        yield base
