"""Shared fixtures: the bundled real model and its F32 copy, the real files people download
(tests/support/real_models.py), a loaded engine, llama.cpp as the oracle, a server on the engine,
the pack builds a test causes, and the removal of each module's files."""

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.live_server import running_server
from tests.support.make_model import write_f32_copy
from tests.support.oracle import llama_cpp_model
from tests.support.real_models import GEMMA3_270M, QWEN_CODER_05B, QWEN_CODER_15B, fetch
from tests.support.test_cache import use_test_cache, write_test_profiles
from tierflow.offload.pack import pack_cache, writer
from tierflow.offload.store.model_path import bundled_model_path

# Set at import, before any test or subprocess, so the CLI and server processes inherit them.
use_test_cache()
os.environ["TIERFLOW_OFFLINE"] = "1"  # no test reaches a hub: the pull tests name a local one
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty HOME; the model stores' and presets' own variables unset, so every store is under it."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "TIERFLOW_PRESETS", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of the test's own, with the test profiles (no load measures the machine) and
    no cap on its size. In the run's shared folder a pack an earlier test's deleted model left can
    sit under the name a new model's reused inode gives: a test of when packs are built needs its
    own folder."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("TIERFLOW_CACHE", str(folder))
    monkeypatch.delenv(pack_cache.CAP_VARIABLE, raising=False)
    write_test_profiles()
    return folder


@pytest.fixture(scope="session")
def model_path() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def f32_model_path(model_path) -> Path:
    """The bundled model with every tensor in float32: llama.cpp is an exact oracle there, since
    neither side rounds its activations. One copy (500 MiB) for the whole run, removed at its end."""
    with tempfile.TemporaryDirectory(prefix="tierflow-f32-") as folder:
        yield write_f32_copy(model_path, Path(folder) / "smollm2-f32.gguf")


@pytest.fixture(scope="session")
def qwen_05b_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (Q5_0/Q8_0), the real file: fetched once, kept between runs."""
    return fetch(QWEN_CODER_05B)


@pytest.fixture(scope="session")
def qwen_15b_path() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), the real file: same vocabulary as the 0.5B."""
    return fetch(QWEN_CODER_15B)


@pytest.fixture(scope="session")
def gemma_270m_path() -> Path:
    """Gemma 3 270M (Q4_K_M), a real file that carries no chat template."""
    return fetch(GEMMA3_270M)


@pytest.fixture(scope="module", autouse=True)
def module_files_removed(request, tmp_path_factory):
    """Removes the folders a test module's fixtures made (generated models: hundreds of MiB in some
    modules) once the module is done, so the run's disk use is its largest module's, not the sum of
    all (about 10 GiB). A module with a failure keeps its folders to be looked at."""
    base, failed = tmp_path_factory.getbasetemp(), request.session.testsfailed
    before = set(base.iterdir())
    yield
    if request.session.testsfailed == failed:
        for folder in set(base.iterdir()) - before:
            shutil.rmtree(folder, ignore_errors=True)


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


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_errors() -> Iterator[list[logging.LogRecord]]:
    """What the servers log as errors during the test: uvicorn's log (which does not propagate to
    the root logger) and everything else's."""
    handler, loggers = _Records(), [logging.getLogger(), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def url(engine):
    """The base URL of a server on the engine, with the default settings, for a test module."""
    with running_server(engine) as base:
        yield base
