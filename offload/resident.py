"""ResidentWeights: every tensor loaded once into RAM, the simplest placement of a model.

Group-quantized matrices (Q4_0, Q4_K, Q8_0, ...) are packed for the CPU kernels (see
cpu_kernels/packed.py); float matrices become float32 torch tensors. Projections that read the same
input (Q, K and V; gate and up) are packed as one matrix when their formats agree, so a decode step
makes one kernel call for each. Peak memory while loading is the loaded weights plus one matrix's
temporaries; the file itself is only memory-mapped (its pages are the OS page cache, not
tierflow's). Streaming placements under tighter budgets build on the same `WeightSource` interface.
"""

from collections.abc import Callable

import numpy as np
import torch

from tierflow.cpu_kernels.dequant import SUPPORTED_TYPES, dequantize
from tierflow.cpu_kernels.linear import PackedLinear
from tierflow.cpu_kernels.packed import PackedMatrix, pack, packed_nbytes
from tierflow.cpu_kernels.quant_groups import (
    GROUPED_TYPES,
    QuantGroups,
    group_layout,
    stack_rows,
    to_quant_groups,
)
from tierflow.errors import BudgetError, ModelFileError, UnsupportedModelError
from tierflow.offload.gguf_file import GGUFFile, TensorInfo
from tierflow.runtime.config import ModelConfig
from tierflow.runtime.model import ConcatLinear, DenseLinear, LayerWeights, Linear
from tierflow.units import format_size

LoadProgress = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)

# LayerWeights field -> the GGUF matrices (within blk.N) it computes, in output order
_LAYER_LINEARS = {
    "qkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",),
}


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF shapes (ne0 first) of every tensor the decoder needs, keyed by tensor name."""
    e, f, v = config.hidden_size, config.ffn_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"token_embd.weight": (e, v), "output_norm.weight": (e,)}
    if not config.tied_embeddings:
        shapes["output.weight"] = (e, v)
    for i in range(config.num_layers):
        layer = {
            "attn_norm.weight": (e,), "attn_q.weight": (e, q), "attn_k.weight": (e, kv),
            "attn_v.weight": (e, kv), "attn_output.weight": (q, e), "ffn_norm.weight": (e,),
            "ffn_gate.weight": (e, f), "ffn_up.weight": (e, f), "ffn_down.weight": (f, e),
        }
        if config.arch == "qwen2":
            layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def check_tensors(gguf: GGUFFile, config: ModelConfig) -> None:
    """Every needed tensor is present, of the right shape and of a type tierflow computes with."""
    for name, shape in expected_shapes(config).items():
        info = gguf.tensors.get(name)
        if info is None:
            raise ModelFileError(f"{gguf.path.name}: missing tensor '{name}'")
        if info.shape != shape:
            raise ModelFileError(
                f"{gguf.path.name}: tensor '{name}' has shape {list(info.shape)}, "
                f"the metadata implies {list(shape)}"
            )
        if info.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{gguf.path.name}: tensor '{name}' has type {info.type_name}, which tierflow "
                f"does not support yet"
            )


def held_bytes(info: TensorInfo) -> int:
    """Bytes of RAM a tensor takes once loaded: packed if group-quantized, else float32."""
    if info.ggml_type in GROUPED_TYPES and len(info.shape) == 2:
        layout = group_layout(info.ggml_type)
        return packed_nbytes(info.shape[1], info.shape[0], layout.bits, layout.group, layout.has_min)
    return 4 * info.num_elements


def resident_bytes(gguf: GGUFFile, config: ModelConfig) -> int:
    """Bytes of RAM the loaded weights take (an upper bound: fused matrices pad less)."""
    names = list(expected_shapes(config))
    if "rope_freqs.weight" in gguf.tensors:
        names.append("rope_freqs.weight")
    return sum(held_bytes(gguf.tensors[name]) for name in names)


class ResidentWeights:
    """A WeightSource holding every weight in RAM: packed for the kernels, or float32.

    The file's tensors must have passed `check_tensors` for this config.
    """

    def __init__(self, gguf: GGUFFile, config: ModelConfig, cpu_budget_bytes: int | None = None,
                 progress: LoadProgress | None = None):
        self.config = config
        self.num_bytes = resident_bytes(gguf, config)
        if cpu_budget_bytes is not None and self.num_bytes > cpu_budget_bytes:
            raise BudgetError(
                f"the weights need {format_size(self.num_bytes)} of RAM but cpu_memory is "
                f"{format_size(cpu_budget_bytes)}; raise cpu_memory (streaming from disk under "
                f"smaller budgets is not available yet)"
            )
        self._gguf, self._progress = gguf, progress
        self._done, self._total = 0, sum(gguf.tensors[name].nbytes for name in expected_shapes(config))
        self._vectors = {name: self._vector(name) for name, shape in expected_shapes(config).items()
                         if len(shape) == 1}
        self._rope_freqs = (torch.from_numpy(self._vector("rope_freqs.weight"))
                            if "rope_freqs.weight" in gguf.tensors else None)
        self._layers = [self._load_layer(i) for i in range(config.num_layers)]
        embedding = self._matrix("token_embd.weight")
        self._embedding = embedding if isinstance(embedding, torch.Tensor) else pack(embedding)
        if config.tied_embeddings:
            self._output = self._as_linear(self._embedding)
        else:
            self._output = self._linear(["output.weight"])
        linears = [self._output] + [getattr(layer, f) for layer in self._layers for f in _LAYER_LINEARS]
        self.uses_kernels = any(_computed_by_kernels(linear) for linear in linears)
        self._gguf = self._progress = None

    # -- loading ---------------------------------------------------------------------------

    def _advance(self, info: TensorInfo) -> None:
        self._done += info.nbytes
        if self._progress is not None:
            self._progress("load", self._done, self._total)

    def _vector(self, name: str) -> np.ndarray:
        info = self._gguf.tensors[name]
        self._advance(info)
        return dequantize(self._gguf.tensor_data(name), info.ggml_type, info.shape)

    def _matrix(self, name: str) -> QuantGroups | torch.Tensor:
        """A matrix as codes per group when its type has them, else as float32 [out, in]."""
        info = self._gguf.tensors[name]
        self._advance(info)
        if info.ggml_type in GROUPED_TYPES:
            return to_quant_groups(self._gguf.tensor_data(name), info.ggml_type, info.shape)
        return _dequantize_tensor(self._gguf, info)

    @staticmethod
    def _as_linear(matrix: QuantGroups | PackedMatrix | torch.Tensor,
                   bias: np.ndarray | None = None) -> Linear:
        if isinstance(matrix, torch.Tensor):
            return DenseLinear(matrix, bias)
        return PackedLinear(matrix if isinstance(matrix, PackedMatrix) else pack(matrix), bias)

    def _linear(self, names: list[str]) -> Linear:
        """The matrices `names` (and their biases, if any) as one Linear, fused when formats agree."""
        matrices = [self._matrix(name) for name in names]
        biases = [self._vectors.get(name.removesuffix(".weight") + ".bias")
                  for name in names]
        bias = None if all(b is None for b in biases) else np.concatenate(
            [b if b is not None else np.zeros(_rows(m), np.float32) for b, m in zip(biases, matrices)])
        if all(isinstance(m, torch.Tensor) for m in matrices):
            return DenseLinear(torch.cat(matrices), bias)
        if all(isinstance(m, QuantGroups) for m in matrices) and len(
                {(m.bits, m.group) for m in matrices}) == 1:
            return PackedLinear(pack(stack_rows(matrices)), bias)
        return ConcatLinear([self._as_linear(m, b) for m, b in zip(matrices, biases)])

    def _load_layer(self, layer_idx: int) -> LayerWeights:
        prefix = f"blk.{layer_idx}."
        linears = {field: self._linear([f"{prefix}{name}.weight" for name in names])
                   for field, names in _LAYER_LINEARS.items()}
        return LayerWeights(attn_norm=self._vectors[prefix + "attn_norm.weight"],
                            ffn_norm=self._vectors[prefix + "ffn_norm.weight"], **linears)

    # -- the WeightSource interface --------------------------------------------------------

    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray:
        if isinstance(self._embedding, torch.Tensor):
            return self._embedding.numpy()[token_ids]
        return self._embedding.row_slice(token_ids)

    def layer(self, layer_idx: int) -> LayerWeights:
        return self._layers[layer_idx]

    def output_norm(self) -> np.ndarray:
        return self._vectors["output_norm.weight"]

    def output(self) -> Linear:
        return self._output

    def rope_freq_factors(self) -> torch.Tensor | None:
        return self._rope_freqs

    def bytes_by_tier(self) -> dict[str, int]:
        return {"gpu": 0, "cpu": self.num_bytes, "disk": 0}


def _computed_by_kernels(linear: Linear) -> bool:
    if isinstance(linear, ConcatLinear):
        return any(_computed_by_kernels(part) for part in linear.parts)
    return isinstance(linear, PackedLinear)


def _rows(matrix: QuantGroups | torch.Tensor) -> int:
    return matrix.q.shape[0] if isinstance(matrix, QuantGroups) else matrix.shape[0]


def _dequantize_tensor(gguf: GGUFFile, info: TensorInfo) -> torch.Tensor:
    array = dequantize(gguf.tensor_data(info.name), info.ggml_type, info.shape)
    return torch.from_numpy(array)
