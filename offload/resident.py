"""ResidentWeights: every tensor dequantized once into RAM, the simplest placement of a model.

Peak memory while loading is the float32 weights plus one tensor's temporaries; the file itself is
only memory-mapped (its pages are the OS page cache, not tierflow's). Streaming placements under
tighter budgets build on the same `WeightSource` interface.
"""

from collections.abc import Callable

import numpy as np
import torch

from tierflow.cpu_kernels.dequant import SUPPORTED_TYPES, dequantize
from tierflow.errors import BudgetError, ModelFileError, UnsupportedModelError
from tierflow.offload.gguf_file import GGUFFile, TensorInfo
from tierflow.runtime.config import ModelConfig
from tierflow.runtime.model import LayerWeights
from tierflow.units import format_size

LoadProgress = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)

_LAYER_TENSORS = {  # LayerWeights field -> GGUF name within blk.N
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
    "wv": "attn_v.weight", "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
}
_LAYER_BIASES = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}


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


def resident_bytes(config: ModelConfig, has_rope_freqs: bool) -> int:
    """Bytes of RAM the float32 weights take once loaded."""
    elements = sum(int(np.prod(s)) for s in expected_shapes(config).values())
    return 4 * (elements + (config.rope_dim // 2 if has_rope_freqs else 0))


class ResidentWeights:
    """A WeightSource holding every weight as a float32 torch tensor in RAM.

    The file's tensors must have passed `check_tensors` for this config.
    """

    def __init__(self, gguf: GGUFFile, config: ModelConfig, cpu_budget_bytes: int | None = None,
                 progress: LoadProgress | None = None):
        self.config = config
        self.num_bytes = resident_bytes(config, "rope_freqs.weight" in gguf.tensors)
        if cpu_budget_bytes is not None and self.num_bytes > cpu_budget_bytes:
            raise BudgetError(
                f"the weights need {format_size(self.num_bytes)} of RAM but cpu_memory is "
                f"{format_size(cpu_budget_bytes)}; raise cpu_memory (streaming from disk under "
                f"smaller budgets is not available yet)"
            )
        self._tensors = self._load_all(gguf, progress)

    def _load_all(self, gguf: GGUFFile, progress: LoadProgress | None) -> dict[str, torch.Tensor]:
        names = list(expected_shapes(self.config))
        if "rope_freqs.weight" in gguf.tensors:
            names.append("rope_freqs.weight")
        infos = [gguf.tensors[n] for n in names]
        total = sum(info.nbytes for info in infos)
        done = 0
        tensors = {}
        for info in infos:
            tensors[info.name] = _dequantize_tensor(gguf, info)
            done += info.nbytes
            if progress is not None:
                progress("load", done, total)
        return tensors

    def embedding_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._tensors["token_embd.weight"][token_ids]

    def layer(self, layer_idx: int) -> LayerWeights:
        prefix = f"blk.{layer_idx}."
        fields = {field: self._tensors[prefix + name] for field, name in _LAYER_TENSORS.items()}
        for field, name in _LAYER_BIASES.items():
            fields[field] = self._tensors.get(prefix + name)
        return LayerWeights(**fields)

    def output_norm(self) -> torch.Tensor:
        return self._tensors["output_norm.weight"]

    def output(self) -> torch.Tensor:
        return self._tensors.get("output.weight", self._tensors["token_embd.weight"])

    def rope_freq_factors(self) -> torch.Tensor | None:
        return self._tensors.get("rope_freqs.weight")

    def bytes_by_tier(self) -> dict[str, int]:
        return {"gpu": 0, "cpu": self.num_bytes, "disk": 0}


def _dequantize_tensor(gguf: GGUFFile, info: TensorInfo) -> torch.Tensor:
    array = dequantize(gguf.tensor_data(info.name), info.ggml_type, info.shape)
    return torch.from_numpy(array)
