"""The tensors a model needs, from its family's tensor map, checked against the file's header."""

from collections.abc import Iterable, Iterator

from tierflow.cpu_kernels.dequant import SUPPORTED_TYPES
from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.ggml_types import type_name
from tierflow.offload.gguf.reader import GGUFFile
from tierflow.runtime.models.architecture import Architecture
from tierflow.runtime.models.config import ModelConfig
from tierflow.runtime.models.tensor_map import Tensor, field_tensors


def needed_tensors(gguf: GGUFFile, arch: Architecture, config: ModelConfig) -> Iterator[tuple[Tensor, bool]]:
    """Every tensor the model reads (a stacked expert tensor once), with whether it is required;
    optional ones only when the file has them. Layer by layer, so nothing grows with the layer
    count before the first missing tensor is found."""
    fields = iter(arch.global_fields(config))
    yield from (tensor for field in fields for tensor in field_tensors(field, gguf.tensors))
    for i in range(config.num_layers):
        experts = arch.expert_fields(config, i, 0) if config.has_experts(i) else []
        layer = arch.layer_fields(config, i) + experts
        yield from (tensor for field in layer for tensor in field_tensors(field, gguf.tensors))


def mtp_tensors(gguf: GGUFFile, arch: Architecture, config: ModelConfig) -> Iterator[tuple[Tensor, bool]]:
    """The tensors of the multi-token-prediction block after the last layer (arch.mtp_fields), as
    needed_tensors gives a layer's."""
    layer = config.num_layers
    experts = arch.expert_fields(config, layer, 0) if config.is_moe else []
    for field in arch.mtp_fields(config) + experts:
        yield from field_tensors(field, gguf.tensors)


def check_tensors(gguf: GGUFFile, arch: Architecture, config: ModelConfig,
                  tensors: Iterable[tuple[Tensor, bool]] | None = None) -> None:
    """Every needed tensor (of `tensors`, else of the model's layers) is present, of the shape the
    metadata implies and of a type tierflow computes with."""
    for tensor, _ in needed_tensors(gguf, arch, config) if tensors is None else tensors:
        info = gguf.tensors.get(tensor.name)
        if info is None:
            layer = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else None
            kind = None if layer is None or arch.layer_kind is None or int(layer) >= config.num_layers \
                else arch.layer_kind(config, int(layer))
            why = "" if kind is None else f": {kind}"
            raise ModelFileError(f"{gguf.path.name}: missing tensor '{tensor.name}' (a {config.arch} model "
                                 f"needs it{why})")
        if info.shape != tensor.shape:
            raise ModelFileError(
                f"{gguf.path.name}: tensor '{tensor.name}' has shape {list(info.shape)}, "
                f"the metadata implies {list(tensor.shape)}"
            )
        if info.ggml_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES))
            raise UnsupportedModelError(
                f"{gguf.path.name}: tensor '{tensor.name}' has type {info.type_name}, which tierflow "
                f"does not support (supported types: {supported})"
            )
