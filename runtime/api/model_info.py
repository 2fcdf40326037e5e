"""What `tierflow info` shows: a model's family, shape, tensor types and bytes per tier under the
default placement, from its header alone (through the loader, as a load would plan it)."""

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import LlamaFileType

from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.gguf.reader import TensorInfo
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.store.model_path import model_file_bytes, resolve_model_path
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
from tierflow.runtime.text.reasoning import thinks
from tierflow.runtime.text.tool_calls import ToolFormat, tool_format
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
        return (f"{c.num_experts} per layer{_dense_layers(c)}, {c.experts_used} used per token, "
                f"feed-forward size {c.expert_ffn_size}{shared}")


def _dense_layers(config: ModelConfig) -> str:
    """A MoE model's layers with a dense FFN instead of experts, as runs: " (layers 0-1, 4 dense)"."""
    dense = [layer for layer in range(config.num_layers) if not config.has_experts(layer)]
    runs: list[list[int]] = []
    for layer in dense:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    shown = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f" (layer{'s' if len(dense) > 1 else ''} {shown} dense)" if dense else ""


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



@dataclass(frozen=True)
class ModelCard:
    """What a server tells of a model from its header, loaded or not (ollama's /api/tags and
    /api/show, `tierflow show`)."""

    path: Path
    arch: str
    num_parameters: int
    quant_label: str  # the file's type as ollama and llama.cpp name it: Q4_K_M, Q8_0, F16
    context_length: int
    file_bytes: int
    modified: float  # the file's mtime
    chat_template: str | None
    capabilities: tuple[str, ...]  # of "completion", "tools", "thinking", "embedding"
    license: str | None
    sampling: dict[str, float | int]  # what the file recommends (general.sampling.*)

    @property
    def parameter_size(self) -> str:
        """ollama's short count: 135M, 1.5B."""
        for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if self.num_parameters >= scale:
                return f"{self.num_parameters / scale:.3g}{unit}"
        return str(self.num_parameters)


def model_card(model: str | os.PathLike | None) -> ModelCard:
    """The header's card; nothing is planned or loaded."""
    path = resolve_model_path(model)
    with open_model_file(path) as opened:
        metadata, tensors = opened.gguf.metadata, opened.gguf.tensors.values()
        template = metadata.get("tokenizer.chat_template")
        capabilities = ["completion"]
        if template and tool_format(template) is not ToolFormat.GENERIC:
            capabilities.append("tools")
        if thinks(template):
            capabilities.append("thinking")
        if f"{opened.config.arch}.pooling_type" in metadata:
            capabilities.append("embedding")
        return ModelCard(path, opened.config.arch, sum(info.num_elements for info in tensors),
                         quant_label(metadata, tensors), opened.config.context_length, model_file_bytes(path),
                         path.stat().st_mtime, template, tuple(capabilities), metadata.get("general.license"),
                         recommended_sampling(metadata, opened.config.context_length))


def quant_label(metadata: Mapping[str, Any], tensors: Iterable[TensorInfo]) -> str:
    """general.file_type's name (MOSTLY_Q4_K_M is Q4_K_M); without it, the type holding most bytes."""
    file_type = metadata.get("general.file_type")
    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        name = None
    if name is not None and name != "GUESSED":
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    held: dict[str, int] = {}
    for info in tensors:
        held[info.type_name] = held.get(info.type_name, 0) + info.nbytes
    return max(held, key=held.get) if held else "unknown"
