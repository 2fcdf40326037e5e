"""What `from tierflow import Engine` costs an app at start-up: none of the heavy modules, which come
with the first Engine.load (benchmarks/desktop.py times it and weighs its memory)."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "llama_cpp", "triton")


@pytest.fixture(scope="module")
def imported() -> set[str]:
    """The modules a fresh interpreter holds once it has run `from tierflow import Engine, LoadPhase`."""
    code = "import sys; from tierflow import Engine, LoadPhase; print(' '.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {name.split(".")[0] for name in done.stdout.split()}


@pytest.mark.parametrize("heavy", HEAVY)
def test_importing_the_engine_imports_no_heavy_module(imported, heavy):
    assert heavy not in imported
