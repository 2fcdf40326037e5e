"""tierflow installs as one package whose subpackages are the repository's top-level folders."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import tierflow

ROOT = Path(__file__).resolve().parent.parent


def test_engine_is_importable_from_the_package_root():
    from tierflow import Engine  # noqa: F401


def test_each_folder_is_a_tierflow_subpackage():
    for name in ("runtime", "offload", "speculative", "cpu_kernels", "gpu_kernels", "cli"):
        module = importlib.import_module(f"tierflow.{name}")
        assert Path(module.__file__).resolve().parent == ROOT / name


def test_importing_tierflow_does_not_load_torch():
    code = "import sys, tierflow; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_console_script_is_installed():
    done = subprocess.run(["tierflow", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "chat" in done.stdout


def test_root_package_comes_from_core():
    assert Path(tierflow.__file__).resolve().parent == ROOT / "core"


@pytest.mark.slow
def test_wheel_holds_every_module_of_every_folder(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, timeout=300)
    import zipfile

    (wheel,) = tmp_path.glob("tierflow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = {"core": "tierflow", "runtime": "tierflow/runtime", "offload": "tierflow/offload",
               "cli": "tierflow/cli", "cpu_kernels": "tierflow/cpu_kernels",
               "gpu_kernels": "tierflow/gpu_kernels", "speculative": "tierflow/speculative"}
    for folder, package in folders.items():
        for source in (ROOT / folder).rglob("*.py"):
            assert f"{package}/{source.relative_to(ROOT / folder).as_posix()}" in names
