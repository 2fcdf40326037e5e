"""The valid models every case starts from, written by make_model and parsed into editable parts.

A seed is parsed once (in the fork server, before it forks): its metadata entries kept as encoded
(`Raw`), so that a case re-encodes only what it changes, and its tensors with their data, so that
build_gguf lays out a file from them again. Decoded values and byte spans serve the mutators.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tests.support.gguf_bytes import Raw, TensorSpec, Typed, build_gguf
from tests.support.gguf_writing import encoded_kvs
from tests.support.make_model import ModelSpec, write_model
from tierflow.offload.gguf.reader import ValueType, read_gguf

# Small models of every family and of several weight types; each loads and generates as it is.
SEED_SPECS = {
    "llama-q8": ModelSpec(),
    "llama-q4-yarn": ModelSpec(weight_type="Q4_0", tied_embeddings=False, rope_scaling="yarn",
                               rope_scaling_factor=2.0, llama3_rope_freqs=True),
    "qwen2-f32": ModelSpec(arch="qwen2", weight_type="F32", embedding_type="F32"),
    "qwen3": ModelSpec(arch="qwen3", head_size=32),
    "llama-moe": ModelSpec(num_experts=4, experts_used=2),
    "qwen2moe": ModelSpec(arch="qwen2moe", num_experts=4, experts_used=2),
    "olmoe": ModelSpec(arch="olmoe", num_experts=4, num_kv_heads=4),
    "qwen35": ModelSpec(arch="qwen35", head_size=32, rope_dim=16),  # linear attention, a recurrent state
}

Value = Typed | Raw  # a metadata value as build_gguf writes it


@dataclass
class ModelParts:
    """A GGUF file as build_gguf writes it: metadata entries in order (a key may repeat), tensors
    in order (data included) and the header's fields. Mutators edit a copy."""

    kvs: list[tuple[str | bytes, Value]]
    tensors: list[TensorSpec]
    version: int = 3
    alignment: int = 32  # the data's; other than 32, build_gguf also writes general.alignment

    def copy(self) -> ModelParts:
        return replace(self, kvs=list(self.kvs), tensors=list(self.tensors))

    def to_bytes(self) -> bytes:
        return build_gguf(self.kvs, self.tensors, version=self.version, alignment=self.alignment)

    def set_value(self, key: str, value: Value) -> None:
        """Replace the key's value in place, or append the key when absent."""
        for index, (name, _) in enumerate(self.kvs):
            if name == key:
                self.kvs[index] = (key, value)
                return
        self.kvs.append((key, value))


@dataclass(frozen=True)
class Seed:
    """A seed model: its parts, its decoded metadata, and where its sections lie in its bytes."""

    name: str
    parts: ModelParts
    metadata: dict[str, Any]
    value_types: dict[str, ValueType]
    data: bytes  # the file itself
    tensor_table: tuple[int, int]  # byte range of the tensor table
    data_offset: int  # where tensor data starts

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]


def _raw(entry: bytes, key: str) -> Raw:
    """An encoded entry (key, type id, payload) as a Raw value."""
    start = 8 + len(key.encode("utf-8"))
    return Raw(int.from_bytes(entry[start:start + 4], "little"), entry[start + 4:])


def parse_seed(name: str, path: Path) -> Seed:
    with read_gguf(path) as model:
        kvs = [(key, _raw(entry, key)) for key, entry in encoded_kvs(path).items()]
        tensors = [TensorSpec(info.name, info.shape, info.ggml_type, model.tensor_data(info.name).tobytes())
                   for info in model.tensors.values()]
        table = (model.metadata_span[1], model.data_offset)
        seed = Seed(name, ModelParts(kvs, tensors), dict(model.metadata), dict(model.value_types),
                    path.read_bytes(), table, model.data_offset)
    return seed


@functools.cache
def load_seeds(folder: str) -> dict[str, Seed]:
    """Every seed, written into `folder` first where missing (make_model's files are the same
    bytes for the same spec), by name."""
    seeds = {}
    for name, spec in SEED_SPECS.items():
        path = Path(folder) / f"{name}.gguf"
        if not path.exists():
            write_model(path.with_suffix(".tmp"), spec).rename(path)
        seeds[name] = parse_seed(name, path)
    return seeds
