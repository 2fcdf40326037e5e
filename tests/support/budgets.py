"""cpu_memory for the placement a test means: the weight bytes it wants in RAM, plus what a load
keeps in RAM beside them (offload/plan/budgets.py: the KV cache and the largest pass's
activations), so that a test or a benchmark states its budgets in weights."""

from dataclasses import dataclass
from pathlib import Path

from tierflow.kv_types import kv_type
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan.budgets import CacheFootprint


def ram_beside_weights(model: Path, context_length: int, kv_cache_type: str | None = None,
                       gpu_layers: tuple[int, ...] = ()) -> int:
    """The KV cache and activations a load of `model` keeps within cpu_memory (the caches of
    layers computed on the GPU are not in RAM)."""
    with open_model_file(model) as opened:
        footprint = CacheFootprint.of(opened.config, context_length, kv_type(kv_cache_type), on_cpu=False)
    return footprint.ram_bytes(gpu_layers)


def streaming_budget(model: Path, context_length: int, num_streamed: int = 1, ring_slots: int = 3,
                     kv_cache_type: str | None = None) -> int:
    """cpu_memory for the globals, all but the last num_streamed layers and a ring of ring_slots
    of the largest layer, beside the KV cache and activations: a load that streams about
    num_streamed layers (the planner picks the ring's depth), and so reads them from the pack."""
    with open_model_file(model) as opened:
        sizes = pack_sizes(opened)
    layers = [x.nbytes for x in sizes.layers]
    resident = sum(layers[: len(layers) - num_streamed])
    return (sizes.globals.nbytes + resident + ring_slots * max(layers)
            + ram_beside_weights(model, context_length, kv_cache_type))


@dataclass(frozen=True)
class MoeBytes:
    """A MoE model's bytes as its pack lays them out, for budgets stated in experts."""

    globals: int  # embeddings, output head
    layers: int  # every layer but its experts: attention, norms, routers, shared experts
    expert: int  # the largest expert
    experts: int  # all of them
    ram_beside: int  # what cpu_memory keeps beside the weights (KV cache and activations)
    gpu_beside: int  # with every layer on the GPU: their KV caches there
    ram_beside_gpu: int  # ... and what cpu_memory then keeps beside the weights (the activations)

    def on_gpu(self, experts: int) -> int:
        """gpu_memory that holds every layer with its KV cache, and room for `experts` experts."""
        return self.layers + self.gpu_beside + experts * self.expert

    def in_ram(self, experts: int, layers_on_gpu: bool = True) -> int:
        """cpu_memory that holds the globals (and the layers, unless they are on the GPU) and
        room for `experts` experts."""
        if layers_on_gpu:
            return self.globals + self.ram_beside_gpu + experts * self.expert
        return self.globals + self.layers + self.ram_beside + experts * self.expert


def moe_bytes(model: Path, context_length: int) -> MoeBytes:
    with open_model_file(model) as opened:
        sizes = pack_sizes(opened)
        footprint = CacheFootprint.of(opened.config, context_length, kv_type(None), on_cpu=False)
        every_layer = tuple(range(opened.config.num_layers))
    experts = [x.nbytes for layer in sizes.experts for x in layer]
    return MoeBytes(sizes.globals.nbytes, sum(x.nbytes for x in sizes.layers), max(experts), sum(experts),
                    footprint.ram_bytes(()), footprint.gpu_bytes(every_layer),
                    footprint.ram_bytes(every_layer))
