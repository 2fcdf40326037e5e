"""The layers of docs/ARCHITECTURE.md hold: no module imports one of a layer above its own.

import-linter reads a package from one folder, and tierflow's subpackages live in top-level
folders (setup.py maps them), so it reads a copy of their sources laid out as one package.
"""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def package_folders() -> dict[str, str]:
    """setup.py's FOLDERS: import package -> the folder it is installed from."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    assigned = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                    and any(getattr(target, "id", "") == "FOLDERS" for target in node.targets))
    return ast.literal_eval(assigned)


def copy_sources(top: Path) -> Path:
    """tierflow's Python sources as one package folder, top/tierflow/; returns top."""
    for package, folder in sorted(package_folders().items()):
        shutil.copytree(ROOT / folder, top / package.replace(".", "/"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h", "*.html"))
    return top


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    return copy_sources(tmp_path_factory.mktemp("layers"))


def lint_imports(sources: Path, config: Path) -> subprocess.CompletedProcess:
    script = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    command = [sys.executable, "-c", script, "--config", str(config), "--no-cache"]
    environment = os.environ | {"PYTHONPATH": str(sources)}
    return subprocess.run(command, cwd=sources, env=environment, capture_output=True, text=True, timeout=300)


def test_every_import_points_down_the_layers(sources):
    result = lint_imports(sources, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_import_up_the_layers_is_caught(tmp_path):
    sources = copy_sources(tmp_path)
    with open(sources / "tierflow/offload/plan/budgets.py", "a") as module:
        module.write("\nfrom tierflow.runtime.api.engine import Engine  # noqa: E402\n")
    result = lint_imports(sources, ROOT / "pyproject.toml")
    assert result.returncode != 0
    assert "tierflow.offload.plan.budgets -> tierflow.runtime.api.engine" in result.stdout
