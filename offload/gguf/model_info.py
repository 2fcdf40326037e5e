"""What `tierflow info` shows: a model's shape and bytes, from its header alone."""

import os
from dataclasses import dataclass
from pathlib import Path

from tierflow.errors import ModelFileError
from tierflow.offload.gguf.model_path import resolve_model_path
from tierflow.offload.gguf.reader import GGUFFile, read_gguf
from tierflow.offload.gguf.tensors import check_tensors
from tierflow.offload.pack.extents import expert_extents, model_extents
from tierflow.runtime.config import ModelConfig
from tierflow.units import format_size


@dataclass(frozen=True)
class ModelSummary:
    path: Path
    config: ModelConfig
    file_bytes: int
    num_parameters: int
    tensor_types: dict[str, tuple[int, int]]  # type name -> (tensor count, bytes in the file)
    bytes_by_tier: dict[str, int]  # weights resident per tier under the default placement

    def rows(self) -> list[tuple[str, object]]:
        c = self.config
        return [
            ("name", c.name), ("architecture", c.arch), ("parameters", f"{self.num_parameters:,}"),
            ("file size", format_size(self.file_bytes)), ("layers", c.num_layers),
            ("hidden size", c.hidden_size), ("feed-forward size", c.ffn_size),
            ("attention heads", f"{c.num_heads} (key/value: {c.num_kv_heads}, size {c.head_dim})"),
            ("vocabulary", c.vocab_size), ("context length", c.context_length),
            ("rope", f"theta {c.rope_theta:g}, {c.rope_style}, scaling {c.rope_scaling.kind}"),
            ("tied embeddings", c.tied_embeddings),
            *([("experts", self._experts())] if c.is_moe else []),
            *((f"weights on {tier}", format_size(n)) for tier, n in self.bytes_by_tier.items()),
        ]

    def _experts(self) -> str:
        c = self.config
        shared = f", a shared expert of {c.shared_expert_ffn_size}" if c.shared_expert_ffn_size else ""
        return (f"{c.num_experts} per layer, {c.experts_used} used per token, feed-forward size "
                f"{c.expert_ffn_size}{shared}")


def read_config(gguf: GGUFFile) -> ModelConfig:
    """The model's config from the header; the vocabulary size is the embedding's row count."""
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise ModelFileError(f"{gguf.path.name}: missing 2-D tensor 'token_embd.weight'")
    tied = "output.weight" not in gguf.tensors
    return ModelConfig.from_metadata(gguf.metadata, embedding.shape[1], tied)


def describe_model(model: str | os.PathLike | None) -> ModelSummary:
    """Reads and validates the header; no weights are loaded."""
    path = resolve_model_path(model)
    with read_gguf(path) as gguf:
        config = read_config(gguf)
        check_tensors(gguf, config)
        types: dict[str, tuple[int, int]] = {}
        for info in gguf.tensors.values():
            count, nbytes = types.get(info.type_name, (0, 0))
            types[info.type_name] = (count + 1, nbytes + info.nbytes)
        num_parameters = sum(info.num_elements for info in gguf.tensors.values())
        globals_, layers = model_extents(gguf, config)
        experts = expert_extents(gguf, config)
        expert_bytes = sum(x.nbytes for layer in experts for x in layer)
        cpu_bytes = globals_.nbytes + sum(x.nbytes for x in layers) + expert_bytes
    return ModelSummary(path, config, path.stat().st_size, num_parameters, types,
                        {"gpu": 0, "cpu": cpu_bytes, "disk": 0})
