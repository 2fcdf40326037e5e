"""cpu_memory for the placement a test means: the weight bytes it wants in RAM, plus what a load
keeps in RAM beside them (offload/plan/budgets.py: the KV cache and the largest pass's
activations), so that a test or a benchmark states its budgets in weights."""

from pathlib import Path

from tierflow.kv_types import kv_type
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.plan.budgets import CacheFootprint


def ram_beside_weights(model: Path, context_length: int, kv_cache_type: str | None = None,
                       gpu_layers: tuple[int, ...] = ()) -> int:
    """The KV cache and activations a load of `model` keeps within cpu_memory (the caches of
    layers computed on the GPU are not in RAM)."""
    with open_model_file(model) as opened:
        footprint = CacheFootprint.of(opened.config, context_length, kv_type(kv_cache_type), on_cpu=False)
    return footprint.ram_bytes(gpu_layers)
