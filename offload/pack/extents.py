"""The sizes of a model's pack, computed from the GGUF header alone (no weight is read).

The planner needs every layer's bytes before anything is packed; they follow from the shapes and
types, laid out exactly as offload/pack/packed_file.py's writer lays them out (arrays 64-byte aligned
in the order it writes them, extents padded to 4 KiB). tests/test_planner.py checks the two
against each other byte for byte.
"""

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from tierflow.cpu_kernels.packed import TILE_ROWS
from tierflow.cpu_kernels.quant_groups import GROUPED_TYPES, group_layout
from tierflow.offload.gguf.reader import GGUFFile, TensorInfo
from tierflow.offload.io.disk import ALIGNMENT
from tierflow.offload.pack.packed_file import ARRAY_ALIGNMENT, EXPERT_TENSORS, QK_NORMS, layer_linears
from tierflow.runtime.config import ModelConfig


@dataclass(frozen=True)
class LinearSize:
    nbytes: int
    bits: int | None  # None: a float32 matrix, computed by torch


@dataclass(frozen=True)
class ExtentSize:
    nbytes: int  # padded to ALIGNMENT
    groups: tuple[tuple[str, int], ...]  # (group, bytes), adding up to nbytes
    linears: tuple[LinearSize, ...]  # what a pass computes with it (none for the embeddings)


class _ExtentSizer:
    """Mirrors packed_file._ExtentBuilder: arrays 64-byte aligned in the order the pack writes them."""

    def __init__(self):
        self.size, self.groups, self.linears, self._mark = 0, [], [], 0

    def add(self, nbytes: int) -> None:
        self.size = -(-self.size // ARRAY_ALIGNMENT) * ARRAY_ALIGNMENT + nbytes

    def matrix(self, rows: int, cols: int, ggml_type: int, bias: bool) -> LinearSize:
        if bias:
            self.add(4 * rows)
        if ggml_type not in GROUPED_TYPES:
            self.add(4 * rows * cols)
            return LinearSize(4 * rows * cols, None)
        layout = group_layout(ggml_type)
        padded = -(-rows // TILE_ROWS) * TILE_ROWS
        arrays = [padded * cols * layout.bits // 8, padded * (cols // layout.group) * 2]
        arrays += arrays[1:] if layout.has_min or layout.bits != 8 else []
        for nbytes in arrays:
            self.add(nbytes)
        return LinearSize(sum(arrays), layout.bits)

    def linear(self, gguf: GGUFFile, names: list[str]) -> None:
        """Matrices reading one input: one fused matrix when their formats agree (as the pack)."""
        infos = [gguf.tensors[f"{name}.weight"] for name in names]
        biased = [f"{name}.bias" in gguf.tensors for name in names]
        rows, cols = sum(info.shape[1] for info in infos), infos[0].shape[0]
        formats = {(group_layout(i.ggml_type).bits, group_layout(i.ggml_type).group)
                   if i.ggml_type in GROUPED_TYPES else None for i in infos}
        if len(formats) == 1:
            self.linears.append(self.matrix(rows, cols, infos[0].ggml_type, any(biased)))
        else:
            self.linears += [self.matrix(i.shape[1], i.shape[0], i.ggml_type, b)
                             for i, b in zip(infos, biased)]

    def vector(self, info: TensorInfo) -> None:
        self.add(4 * info.num_elements)

    def close_group(self, name: str) -> None:
        self.groups.append((name, self.size - self._mark))
        self._mark = self.size

    def extent(self, last_group: str, linears: list[LinearSize] | None = None) -> ExtentSize:
        padded = -(-self.size // ALIGNMENT) * ALIGNMENT
        self.groups.append((last_group, padded - self._mark))
        return ExtentSize(padded, tuple(self.groups), tuple(self.linears if linears is None else linears))


def model_extents(gguf: GGUFFile, config: ModelConfig) -> tuple[ExtentSize, list[ExtentSize]]:
    """The pack's globals extent and layer extents, sized from the header (tensors checked)."""
    sizer = _ExtentSizer()
    embd = gguf.tensors["token_embd.weight"]
    head = [sizer.matrix(embd.shape[1], embd.shape[0], embd.ggml_type, False)]
    sizer.close_group("embeddings")
    sizer.vector(gguf.tensors["output_norm.weight"])
    if not config.tied_embeddings:
        sizer.linear(gguf, ["output"])
        head = sizer.linears
    if "rope_freqs.weight" in gguf.tensors:
        sizer.vector(gguf.tensors["rope_freqs.weight"])
    globals_ = sizer.extent("output", head)
    layers = []
    for i in range(config.num_layers):
        sizer, prefix = _ExtentSizer(), f"blk.{i}."
        sizer.vector(gguf.tensors[prefix + "attn_norm.weight"])
        sizer.vector(gguf.tensors[prefix + "ffn_norm.weight"])
        if config.qk_norm:
            for name in QK_NORMS.values():
                sizer.vector(gguf.tensors[f"{prefix}{name}.weight"])
        for field, names in layer_linears(config).items():
            sizer.linear(gguf, [prefix + name for name in names])
            if field == "wo":
                sizer.close_group("attention")
        if config.shared_expert_ffn_size:
            sizer.linears.append(sizer.matrix(1, config.hidden_size, GGMLQuantizationType.F32, False))
        layers.append(sizer.extent("router" if config.is_moe else "ffn"))
    return globals_, layers


def expert_extents(gguf: GGUFFile, config: ModelConfig) -> list[list[ExtentSize]]:
    """Per layer, the pack's extent of each expert (none in a dense model)."""
    if not config.is_moe:
        return [[] for _ in range(config.num_layers)]
    experts = []
    for i in range(config.num_layers):
        sizer = _ExtentSizer()
        for names in EXPERT_TENSORS.values():
            sizer.linear(gguf, [f"blk.{i}.{name}" for name in names])
        experts.append([sizer.extent("expert")] * config.num_experts)
    return experts
