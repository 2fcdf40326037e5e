"""A GGUF file as a model: its header read, its family found, its config built, its tensors checked.

    with open_model_file(path) as model:
        model.arch, model.config          # the family (runtime/models/) and its hyper-parameters

Everything after this (the pack, the plan, the weights) reads a ModelFile, never the raw header.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from tierflow.errors import ModelFileError
from tierflow.offload.gguf.reader import GGUFFile
from tierflow.offload.gguf.split_files import read_model_gguf
from tierflow.offload.gguf.tensors import check_tensors
from tierflow.runtime.models import architecture
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.config import ModelConfig


@dataclass(frozen=True)
class ModelFile:
    gguf: GGUFFile
    arch: Architecture
    config: ModelConfig

    @property
    def path(self) -> Path:
        return self.gguf.path

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> "ModelFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_config(gguf: GGUFFile) -> tuple[Architecture, ModelConfig]:
    """The file's family and config from its header; the vocabulary size is the embedding's row
    count, and the embeddings are tied when there is no output.weight."""
    arch = architecture(gguf.metadata.get("general.architecture"))
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise ModelFileError(f"{gguf.path.name}: missing 2-D tensor 'token_embd.weight'")
    config = arch.read_config(gguf.metadata, embedding.shape[1], "output.weight" not in gguf.tensors,
                              gguf.tensors.keys())
    if config.num_layers > len(gguf.tensors):  # before anything is built per layer
        raise ModelFileError(f"{gguf.path.name}: block_count is {config.num_layers} but the file holds only "
                             f"{len(gguf.tensors)} tensors")
    _check_no_layers_past_the_count(gguf)
    return arch, config


def _check_no_layers_past_the_count(gguf: GGUFFile) -> None:
    """A file whose tensors go past its block_count is refused, as llama.cpp refuses it (it finds
    tensors it was not told of): read, it would be run without its last layers, silently."""
    key = f"{gguf.metadata.get('general.architecture')}.block_count"
    count = gguf.metadata.get(key)
    if not isinstance(count, int):  # the family counts its layers otherwise: its config has checked it
        return
    past = [(int(index), name) for name in gguf.tensors
            if (index := name.split(".")[1] if name.startswith("blk.") else "").isdigit()
            and int(index) >= count]
    if past:
        layer, name = max(past)
        raise ModelFileError(f"{gguf.path.name}: {key} is {count} but the file holds tensors of layer "
                             f"{layer} ('{name}'): its layer count is wrong or the file is damaged "
                             f"(llama.cpp refuses it too)")


def open_model_file(path: str | os.PathLike) -> ModelFile:
    """The model in a GGUF file (validated: a malformed one is a ModelFileError, an unknown family or
    tensor type an UnsupportedModelError); a split model is read whole from its first part; close it,
    or use `with`."""
    gguf = read_model_gguf(path)
    try:
        model = ModelFile(gguf, *read_config(gguf))
        check_tensors(model.gguf, model.arch, model.config)
    except BaseException:
        gguf.close()
        raise
    return model
