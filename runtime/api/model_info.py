"""What `tierflow info` shows: a model's family, shape, tensor types and bytes per tier under the
default placement, from its header alone (through the loader, as a load would plan it)."""

import os
from dataclasses import dataclass
from pathlib import Path

from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.gguf.model_path import model_file_bytes, resolve_model_path
from tierflow.offload.pack.writer import pack_sizes
from tierflow.runtime.loading.loader import (
    CacheOptions,
    plan_load,
    profile_source,
    resolve_budgets,
    thread_count,
)
from tierflow.runtime.models import architecture
from tierflow.runtime.models.config import ModelConfig
from tierflow.runtime.sampling.sampler import recommended_sampling
from tierflow.units import format_size


@dataclass(frozen=True)
class ModelSummary:
    path: Path
    config: ModelConfig
    file_bytes: int
    num_parameters: int
    tensor_types: dict[str, tuple[int, int]]  # type name -> (tensor count, bytes in the file)
    bytes_by_tier: dict[str, int]  # weights resident per tier under the default placement
    sampling: dict[str, float | int]  # what the file recommends (general.sampling.*)

    def rows(self) -> list[tuple[str, object]]:
        c = self.config
        return [
            ("name", c.name), ("architecture", f"{c.arch} ({architecture(c.arch).summary})"),
            ("parameters", f"{self.num_parameters:,}"),
            ("file size", format_size(self.file_bytes)), ("layers", c.num_layers),
            ("hidden size", c.hidden_size), ("feed-forward size", c.ffn_size),
            ("attention heads", f"{c.num_heads} (key/value: {c.num_kv_heads}, size {c.head_dim})"),
            ("vocabulary", c.vocab_size), ("context length", c.context_length),
            ("rope", f"theta {c.rope_theta:g}, {c.rope_style}, scaling {c.rope_scaling.kind}"),
            ("tied embeddings", c.tied_embeddings),
            *([("experts", self._experts())] if c.is_moe else []),
            *((f"weights on {tier}", format_size(n)) for tier, n in self.bytes_by_tier.items()),
            ("recommended sampling", ", ".join(f"{name} {value:g}" for name, value in self.sampling.items())
             or "none (tierflow's defaults apply)"),
        ]

    def _experts(self) -> str:
        c = self.config
        shared = f", a shared expert of {c.shared_expert_ffn_size}" if c.shared_expert_ffn_size else ""
        dense = {0: "", 1: " (layer 0 dense)"}.get(c.leading_dense_layers,
                                                   f" (layers 0-{c.leading_dense_layers - 1} dense)")
        return (f"{c.num_experts} per layer{dense}, {c.experts_used} used per token, feed-forward size "
                f"{c.expert_ffn_size}{shared}")


def describe_model(model: str | os.PathLike | None) -> ModelSummary:
    """Reads and validates the header; no weights are loaded (and the machine is measured only when
    the model does not fit the default budget, as a load would measure it)."""
    path = resolve_model_path(model)
    with open_model_file(path) as opened:
        types: dict[str, tuple[int, int]] = {}
        for info in opened.gguf.tensors.values():
            count, nbytes = types.get(info.type_name, (0, 0))
            types[info.type_name] = (count + 1, nbytes + info.nbytes)
        num_parameters = sum(info.num_elements for info in opened.gguf.tensors.values())
        profile, sizes = profile_source(opened, thread_count(None)), pack_sizes(opened)
        budgets = resolve_budgets(opened, sizes, None, 0, CacheOptions(), profile)
        plan = plan_load(opened, sizes, budgets, profile)
    sampling = recommended_sampling(opened.gguf.metadata, budgets.context_length)
    return ModelSummary(path, opened.config, model_file_bytes(path), num_parameters, types,
                        plan.weight_bytes(), sampling)

