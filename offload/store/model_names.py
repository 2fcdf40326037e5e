"""Models by name: what `-m NAME` means when NAME is not a file.

    llama3:8b, qwen3:30b-a3b, library/llama3:8b, host/namespace/model:tag   ollama (no tag: latest)
    Org/Model, Org/Model:Q4_K_M, Org/Model/file.gguf, hf.co/Org/Model        Hugging Face cache, LM Studio

Every store is asked (offload/store/model_stores.py); exactly one model must answer. Nothing is downloaded
here; a Hugging Face name no store holds is pulled by model_path.find_or_pull (pull.py).
"""

import difflib
import os
from pathlib import Path

from tierflow.errors import ModelFileError
from tierflow.offload.store.model_stores import StoredModel, default_stores

MAX_CLOSE_MATCHES = 5


class ModelNotFoundError(ModelFileError):
    """No store holds a model of this name."""


def is_model_name(text: str) -> bool:
    """Whether text may be a store's name rather than a path: absolute, ./ and ~ paths never are, nor
    `file.gguf` or `folder/file.gguf` (a repository's file is `Org/Model/file.gguf`)."""
    if not text or text.startswith(("/", ".", "~")):
        return False
    return not (text.lower().endswith(".gguf") and text.count("/") < 2)


def find_stored_models(name: str, stores: list) -> list[StoredModel]:
    """The models of every store that the name means, each file once."""
    found: dict[str, StoredModel] = {}
    for store in stores:
        for model in store.find(name):
            found.setdefault(os.path.realpath(model.path), model)
    return list(found.values())


def resolve_model_name(name: str) -> Path:
    """The one GGUF file a store holds under this name; none, or several, is a ModelFileError."""
    return find_stored_model(name).path


def find_stored_model(name: str) -> StoredModel:
    """The one model the stores hold under this name; none, or several, is a ModelFileError."""
    stores = default_stores()
    matches = find_stored_models(name, stores)
    if not matches:
        raise ModelNotFoundError(_not_found(name, stores))
    if len(matches) > 1:
        listed = "; ".join(f"{model.name} ({model.source}: {model.path})" for model in matches)
        raise ModelFileError(f"{name} matches {len(matches)} models, give one of them: {listed}")
    return matches[0]


def _not_found(name: str, stores: list) -> str:
    names = sorted({known for store in stores for known in store.names()})
    close = difflib.get_close_matches(name, names, n=MAX_CLOSE_MATCHES, cutoff=0.6)
    places = "; ".join(f"{store.source} in {', '.join(map(str, store.places))}" for store in stores)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    return f"model not found: {name} is not a file, nor a model name found in {places}{hint}"
