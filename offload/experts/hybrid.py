"""Hybrid CPU-GPU expert scheduling (HybriMoE's balance): which device runs each active expert.

A MoE model placed with a GPU budget keeps a cache of its experts in VRAM (an ExpertCache over
device copies) over their bytes in RAM: all of them there (their home), or a cache of them there
over their home on disk (three tiers; an expert not in RAM is read first, whichever device runs
it). Per MoE layer and step, each activated expert runs:
- on the GPU, when it is cached there;
- or on the CPU, from RAM;
- or it is copied to the GPU (and cached) and runs there,
whichever of the last two lets both devices finish the layer soonest: list scheduling over the
cost model, the experts with most work first, each to the device where the layer's makespan grows
least (a tie stays on the CPU: no copy, no eviction). The GPU's work starts first and runs
asynchronously while the CPU computes its share; only activations cross, once each way. Copies go
through the device tier (offload/tiers/device.py): staged in pinned memory, on its copy stream, each
awaited by the compute stream only when its expert runs, so neither the host thread nor this
layer's GPU work waits on the next layer's prefetch; the tier counts the cached bytes against
gpu_memory.

Costs (ExpertCosts): an expert's compute time is its bytes over the device's kernel speed while
its token count is under the device's batch (memory-bound), growing linearly beyond; a copy is its
bytes over the host-to-device speed, and copies queue on one copy stream ahead of their compute.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tierflow.offload.experts.expert_cache import CacheStats, ExpertCache
from tierflow.offload.experts.policy import ExpertKey
from tierflow.offload.experts.store import ExpertRead, StreamedExperts
from tierflow.offload.experts.tier import ExpertTier
from tierflow.offload.pack.reader import PackedFile
from tierflow.offload.tiers.device import DeviceTier
from tierflow.runtime.compute.interfaces import Kernels, Weights
from tierflow.runtime.models.config import ModelConfig


@dataclass(frozen=True)
class ExpertCosts:
    cpu_gbps: float  # the CPU kernels' weight bytes per second (decode: memory-bound)
    gpu_gbps: float
    copy_gbps: float  # host to device
    cpu_batch: int = 8  # tokens an expert computes for the price of one, on each device
    gpu_batch: int = 64

    def cpu_seconds(self, nbytes: int, tokens: int) -> float:
        return nbytes / (self.cpu_gbps * 1e9) * max(1.0, tokens / self.cpu_batch)

    def gpu_seconds(self, nbytes: int, tokens: int) -> float:
        return nbytes / (self.gpu_gbps * 1e9) * max(1.0, tokens / self.gpu_batch)

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / (self.copy_gbps * 1e9)


@dataclass(frozen=True)
class Schedule:
    on_gpu: list[int]  # cached on the GPU: run there
    fetched: list[int]  # copied to the GPU, then run there
    on_cpu: list[int]  # run from RAM on the CPU
    cpu_seconds: float  # the predicted finish of each device
    gpu_seconds: float


def schedule_experts(tokens: dict[int, int], cached: set[int], nbytes: int, costs: ExpertCosts,
                     room: int | None = None) -> Schedule:
    """Where each active expert (id -> its token count) runs, given the ids cached on the GPU and
    room for how many more the cache may take this step (None: as many as pay)."""
    on_gpu = [e for e in tokens if e in cached]
    gpu = sum(costs.gpu_seconds(nbytes, tokens[e]) for e in on_gpu)
    cpu = copy = 0.0
    fetched, on_cpu = [], []
    for e in sorted((e for e in tokens if e not in cached), key=lambda e: (-tokens[e], e)):
        cpu_done = cpu + costs.cpu_seconds(nbytes, tokens[e])
        copy_done = copy + costs.copy_seconds(nbytes)
        gpu_done = max(gpu, copy_done) + costs.gpu_seconds(nbytes, tokens[e])
        if (room is None or len(fetched) < room) and max(gpu_done, cpu) < max(cpu_done, gpu):
            fetched.append(e)
            gpu, copy = gpu_done, copy_done
        else:
            on_cpu.append(e)
            cpu = cpu_done
    return Schedule(on_gpu, fetched, on_cpu, cpu, gpu)


@dataclass
class SchedulerStats:
    on_gpu: int = 0  # expert runs on the GPU from its cache
    fetched: int = 0  # ... after a copy
    on_cpu: int = 0  # expert runs on the CPU


class _DeviceExpert:
    """An expert's bytes on the device and the weights viewing them (an ExpertCache payload)."""

    def __init__(self, weights: Weights, data: torch.Tensor):
        self.weights, self.data, self.nbytes = weights, data, data.numel()


class HybridExperts(ExpertTier):
    """MoE layers' experts with a cache of them on the GPU, the schedule between the devices, and
    their bytes in RAM: every expert there (`ram`, their home), or those a StreamedExperts cache
    holds, read from their home on disk when used (three tiers)."""

    def __init__(self, packed: PackedFile, config: ModelConfig, tier: DeviceTier, kernels: Kernels | None,
                 budget_bytes: int, costs: ExpertCosts, streamed: StreamedExperts | None = None,
                 layers: Sequence[int] | None = None, policy: str = "score"):
        """tier: the GPU's memory, which holds the cache (of budget_bytes, within its own budget);
        kernels: those of its device (None: the CPU standing in for a GPU, computing with the CPU
        kernels); streamed: the RAM cache of experts whose home is disk (None: the caller fills
        `ram`, per layer each expert's weights and pack bytes in RAM); layers: those served."""
        self.packed, self.tier, self.kernels, self.costs = packed, tier, kernels, costs
        self.streamed = streamed
        self.ram: dict[int, list[tuple[Weights, memoryview]]] = {}
        self._reads: dict[int, ExpertRead] = {}  # with `streamed`: this step's experts off the GPU
        super().__init__(config, ExpertCache(budget_bytes, lambda key: packed.experts[key[0]][key[1]].nbytes,
                                             self._upload, policy,
                                             discard=lambda key, payload: tier.free(payload.data)), layers)
        self.schedules = SchedulerStats()

    @property
    def ram_stats(self) -> CacheStats | None:
        """What the RAM cache did (experts at home on disk); None when every expert is in RAM."""
        return None if self.streamed is None else self.streamed.cache.stats

    def _route(self, layer_idx: int, expert_tokens: dict[int, int]
               ) -> tuple[list[int], Iterator[tuple[int, Weights]]]:
        """The schedule: the cached experts and those worth their copy run on the GPU (launched
        first, asynchronously), the rest on the CPU from RAM; those off the GPU are read into RAM
        first when their home is disk."""
        nbytes = self.packed.experts[layer_idx][0].nbytes
        cached = {e for e in expert_tokens if (layer_idx, e) in self.cache}
        room = self.cache.budget_bytes // nbytes - len(cached)  # the step's experts on the GPU stay there
        plan = schedule_experts(expert_tokens, cached, nbytes, self.costs, room)
        self.schedules.on_gpu += len(plan.on_gpu)
        self.schedules.fetched += len(plan.fetched)
        self.schedules.on_cpu += len(plan.on_cpu)
        if self.streamed is not None:
            off_gpu = plan.fetched + plan.on_cpu
            self._reads = dict(zip(off_gpu, self.streamed.cache.get(layer_idx, off_gpu) if off_gpu else []))
        return plan.on_gpu + plan.fetched, ((e, self._in_ram(layer_idx, e)[0]) for e in plan.on_cpu)

    def _in_ram(self, layer_idx: int, expert_id: int) -> tuple[Weights, memoryview]:
        """An expert's weights and bytes in RAM (waiting for its read, with its home on disk)."""
        if self.streamed is None:
            return self.ram[layer_idx][expert_id]
        read = self._reads[expert_id]
        if not read.future.done():
            self.waited_bytes += read.nbytes
        return read.weights(), read.data()

    def _on_disk(self, layer_idx: int, expert_id: int) -> bool:
        key = (layer_idx, expert_id)
        return self.streamed is not None and key not in self.cache and key not in self.streamed.cache

    def _weights(self, payload: _DeviceExpert) -> Weights:
        self.tier.ready(payload.data)  # the compute stream waits for the copy, the host does not
        return payload.weights

    def _upload(self, key: ExpertKey) -> _DeviceExpert:
        layer_idx, expert_id = key
        copy = self.tier.upload(self._in_ram(layer_idx, expert_id)[1], "an expert")
        if self.kernels is None:
            weights = self.packed.expert_weights(layer_idx, expert_id, memoryview(copy.numpy()))
        else:
            weights = self.packed.device_expert_weights(layer_idx, expert_id, copy, self.kernels)
        return _DeviceExpert(weights, copy)

    # With the home on disk the disk is the slow tier: predictions read ahead into RAM, not the GPU.

    def _predict(self, layer_idx: int, expert_ids: np.ndarray, confidences: np.ndarray) -> None:
        self.cache.predict(layer_idx, expert_ids, confidences)
        if self.streamed is not None:
            off_gpu = [(e, c) for e, c in zip(expert_ids.tolist(), confidences.tolist())
                       if (layer_idx, e) not in self.cache]
            self.streamed.cache.predict(layer_idx, [e for e, _ in off_gpu], [c for _, c in off_gpu])

    def _prefetch(self, layer_idx: int, min_confidence: float) -> None:
        self._ahead_cache().prefetch(layer_idx, min_confidence)

    def _fetched_bytes(self) -> int:
        return self._ahead_cache().stats.fetched_bytes

    def _ahead_cache(self) -> ExpertCache:
        """The cache predictions fetch ahead into: the GPU's, or RAM's when the home is disk."""
        return self.cache if self.streamed is None else self.streamed.cache

    def _release(self) -> None:
        self.cache.release()
        if self.streamed is not None:
            self.streamed.cache.release()
            self._reads = {}

    def _next_token(self, tokens: int) -> None:
        self.cache.next_token(tokens)
        if self.streamed is not None:
            self.streamed.cache.next_token(tokens)
