"""What `tierflow list` shows: every model the stores hold, with its size and what its header says, and
the presets (presets.py), each with the model it runs.

Only headers are read (no tensor data), so listing a store of large models stays fast; a model that
cannot be read is listed with its error.
"""

from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from tierflow import ggml_types
from tierflow.errors import TierflowError
from tierflow.offload.gguf.split_files import read_model_gguf
from tierflow.offload.store.model_path import model_file_bytes
from tierflow.offload.store.model_stores import StoredModel, default_stores
from tierflow.offload.store.presets import read_presets


@dataclass(frozen=True)
class ListedModel:
    name: str  # as the user would type it after -m
    source: str  # ollama, huggingface, lmstudio or preset
    path: str | None  # a preset's: the model it runs
    size_bytes: int | None  # all parts of a split model
    architecture: str | None
    weight_type: str | None  # the tensor type holding most of the bytes, e.g. Q4_K
    error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def list_models(stores: list | None = None) -> list[ListedModel]:
    """Every model of every store (this user's, by default), in store then name order, then the
    presets."""
    listed = []
    for store in default_stores() if stores is None else stores:
        for name in store.names():
            try:
                found = store.find(name)
            except TierflowError as error:
                listed.append(ListedModel(name, store.source, None, None, None, None, str(error)))
                continue
            listed += [_describe(name, model) for model in found]
    return listed + [ListedModel(preset.name, "preset", preset.model, None, None, None)
                     for preset in read_presets().values()]


def _describe(name: str, model: StoredModel) -> ListedModel:
    try:
        size = model_file_bytes(model.path)
        architecture, weight_type = _header_summary(model.path)
    except TierflowError as error:
        return ListedModel(name, model.source, str(model.path), None, None, None, str(error))
    return ListedModel(name, model.source, str(model.path), size, architecture, weight_type)


def _header_summary(path: Path) -> tuple[str | None, str | None]:
    """The architecture and the dominant tensor type, from the header alone."""
    gguf = read_model_gguf(path)
    try:
        bytes_by_type = Counter()
        for info in gguf.tensors.values():
            bytes_by_type[info.ggml_type] += info.nbytes
        dominant = bytes_by_type.most_common(1)
        return (gguf.metadata.get("general.architecture"),
                ggml_types.type_name(dominant[0][0]) if dominant else None)
    finally:
        gguf.close()
