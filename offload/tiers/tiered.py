"""TieredWeights: the WeightSource of a plan: layers on the GPU tier, in RAM, or streamed.

Everything comes from the model's pack (offload/pack/): the globals (embeddings, output head,
norms) and the resident layers are read once into RAM at load (or, for a plan that reads nothing
from disk while it runs, built there from the GGUF: offload/pack/built.py); GPU layers are read
once and copied to the device tier (device.py), where they are computed by the device's kernels
(or, for the CPU standing in for a GPU with no kernels given, by the CPU kernels), with their KV cache
beside them; the streamed layers are read from disk every step by the
LayerStreamer into its ring of buffers. RAM held for weights is the globals, the resident layers
and the ring, which is what the cpu_memory budget bounds; the device tier counts its own bytes
against gpu_memory.
"""

from collections.abc import Iterator

import numpy as np
import torch

from tierflow.cpu_kernels.linear import PackedLinear
from tierflow.cpu_kernels.packed import PackedMatrix
from tierflow.errors import UnsupportedModelError
from tierflow.offload.experts.hybrid import HybridExperts
from tierflow.offload.experts.next_layer import early_router
from tierflow.offload.experts.store import ExpertStore, StreamedExperts
from tierflow.offload.experts.tier import LayerExperts
from tierflow.offload.io.disk import DiskFile, aligned_buffer, aligned_size
from tierflow.offload.io.streamer import LayerStreamer
from tierflow.offload.pack.reader import Extent, PackedFile
from tierflow.offload.plan.expert_plan import ExpertPlacement
from tierflow.offload.plan.planner import Plan
from tierflow.offload.tiers.device import DeviceTier
from tierflow.progress import LoadPhase, LoadProgress
from tierflow.runtime.compute.interfaces import ConcatLinear, Experts, Kernels, Linear, Weights
from tierflow.runtime.models.config import ModelConfig


class TieredWeights:
    def __init__(self, packed: PackedFile, config: ModelConfig, plan: Plan, device: DeviceTier | None = None,
                 device_kernels: Kernels | None = None, progress: LoadProgress | None = None):
        """Places the pack as `plan` says: its GPU layers on `device` (computed by device_kernels;
        None: the CPU kernels, for the CPU standing in for a GPU), its streamed layers read through
        a ring of plan.prefetch_depth + 1 slots, the rest in RAM. A MoE model's experts are placed
        as plan.experts says (offload/plan/expert_plan.py): those placed on the GPU by hand are
        uploaded; the others are in RAM, or streamed from disk through an expert cache in RAM
        (offload/experts/store.py), with a cache of them on the device scheduled against their
        bytes in RAM (offload/experts/hybrid.py) when the plan has one."""
        streamed, on_device = set(plan.streamed_layers), set(plan.gpu_layers)
        if any(packed.experts) and streamed:
            raise UnsupportedModelError("a MoE model's layers are not streamed: its experts stream instead "
                                        "(offload/experts/store.py)")
        self.packed, self.device, self.device_kernels = packed, device, device_kernels
        self.disk = DiskFile(packed.path) if packed.path is not None else None  # None: a BuiltPack
        self._buffers = []  # the resident extents' memory, alive as long as the weights
        placement = plan.experts
        self._gpu_experts = set(placement.gpu_layers) if placement else set()  # placed there by hand
        self._experts_in_ram = placement is not None and placement.home == "cpu"
        self.experts, self._streamed = _expert_tier(packed, self.disk, config, placement, device,
                                                    device_kernels)
        resident = [i for i in range(len(packed.layers)) if i not in streamed | on_device]
        ram_experts = [_experts_bytes(packed, i) if self._experts_in_ram and i not in self._gpu_experts else 0
                       for i in range(len(packed.layers))]
        total = packed.globals.nbytes + sum(packed.layers[i].nbytes for i in [*resident, *on_device])
        total += sum(_experts_bytes(packed, i) for i in self._gpu_experts) + sum(ram_experts)
        self._loaded, self._progress = 0, progress
        try:
            globals_ = packed.global_weights(self._read(packed.globals, total))
            self._layers = {i: self._layer(i, total, i in on_device) for i in range(len(packed.layers))
                            if i not in streamed}
            self.streamer = (LayerStreamer(self.disk, packed, sorted(streamed), plan.prefetch_depth)
                             if streamed else None)
        except BaseException:
            self.close()
            raise
        self._embedding: PackedMatrix | torch.Tensor = globals_["embedding"]
        self._output_norm, self._output = globals_["output_norm"], globals_["output"]
        self._rope_freqs = globals_["rope_freqs"]
        self.streamed_layers, self.gpu_layers = sorted(streamed), sorted(on_device)
        ring = self.streamer.nbytes if self.streamer else 0
        in_ram = packed.globals.nbytes + sum(packed.layers[i].nbytes + ram_experts[i] for i in resident)
        in_ram += sum(ram_experts[i] for i in on_device)
        on_disk = sum(packed.layers[i].nbytes for i in self.streamed_layers)
        self._fixed_ram = in_ram + ring
        if self._streamed is not None:
            in_ram += self._streamed.nbytes
            on_disk += sum(_experts_bytes(packed, i) for i in range(len(packed.layers))
                           if i not in self._gpu_experts)
        self._bytes = {"cpu": in_ram + ring, "disk": on_disk}
        layer_specs = [spec for extent in packed.layers for spec in extent.weights.values()
                       if isinstance(spec, dict)]  # the linears (the norms are [offset, size])
        self.uses_kernels = _computed_by_kernels(self._output) or any(map(_packed_spec, layer_specs))

    def _read(self, extent: Extent, total: int, keep: bool = True, into: memoryview | None = None
              ) -> memoryview:
        """The extent's bytes, checked, in a buffer of their own (kept while the weights live when
        `keep`) or at the start of `into` (page-aligned, the caller's)."""
        buffer = aligned_buffer(extent.nbytes) if into is None else into
        if self.disk is None:
            data = self.packed.build_into(extent, buffer)
        else:
            data = self.disk.read_into(buffer, extent.offset, extent.nbytes)
            self.packed.check(extent, data)
        if keep and into is None:
            self._buffers.append(buffer)
        self._loaded += extent.nbytes
        if self._progress is not None:
            self._progress(LoadPhase.LOADING, self._loaded, total)
        return data

    def _read_all(self, extents: list[Extent], total: int) -> list[memoryview]:
        """The extents' bytes side by side in one buffer, kept while the weights live: a layer's
        experts (each a MB or two) then share huge pages (offload/io/disk.aligned_buffer), where a
        buffer each left every expert on 4 KB pages and every page of a decode step's reads a TLB miss."""
        sizes = [aligned_size(extent.nbytes) for extent in extents]
        arena = aligned_buffer(sum(sizes))
        self._buffers.append(arena)
        starts = np.cumsum([0, *sizes])
        return [self._read(extent, total, into=memoryview(arena)[a:b])
                for extent, a, b in zip(extents, starts, starts[1:])]

    def _layer(self, index: int, total: int, on_device: bool) -> Weights:
        """Layer `index` in RAM, or copied to the device tier (its weights then view the copy), with
        its experts placed."""
        data = self._read(self.packed.layers[index], total, keep=not on_device)
        experts = self._layer_experts(index, total) if self.packed.experts[index] else None
        if isinstance(experts, LayerExperts):  # for predicting this layer's experts one layer early
            self._add_router(index, self.packed.layer_weights(index, data))
        if not on_device:
            return self.packed.layer_weights(index, data, experts)
        copy = self.device.upload(data)
        self.device.ready(copy)
        if self.device_kernels is not None:
            return self.packed.device_layer_weights(index, copy, self.device_kernels, experts)
        return self.packed.layer_weights(index, memoryview(copy.numpy()), experts)  # the CPU stand-in's

    def _layer_experts(self, index: int, total: int) -> Experts:
        """A MoE layer's experts: on the device (placed by hand), in RAM, or through the expert tier."""
        if index in self._gpu_experts:
            return ResidentExperts([self._expert_to_device(index, e, total)
                                    for e in range(len(self.packed.experts[index]))])
        if self._experts_in_ram:
            ram = [(self.packed.expert_weights(index, e, expert_data), expert_data)
                   for e, expert_data in enumerate(self._read_all(self.packed.experts[index], total))]
            if self.experts is None:
                return ResidentExperts([w for w, _ in ram])
            self.experts.ram[index] = ram
        return self.experts.layer_experts(index)

    def _expert_to_device(self, index: int, expert: int, total: int) -> Weights:
        data = self._read(self.packed.experts[index][expert], total, keep=False)
        copy = self.device.upload(data, "an expert")
        self.device.ready(copy)
        if self.device_kernels is not None:
            return self.packed.device_expert_weights(index, expert, copy, self.device_kernels)
        return self.packed.expert_weights(index, expert, memoryview(copy.numpy()))

    def _add_router(self, index: int, weights: Weights) -> None:
        self.experts.predictor.add_router(index, *early_router(weights))

    def allocate_cache(self, layer_idx: int, shape: tuple[int, ...],
                       dtype: torch.dtype = torch.float32) -> np.ndarray | torch.Tensor:
        """A zeroed KV cache array of layer `layer_idx`, where the layer is computed: for a layer
        on the device tier, there (counted against gpu_memory); else in RAM."""
        if layer_idx not in self.gpu_layers:
            return torch.zeros(shape, dtype=dtype).numpy()
        array = self.device.zeros(shape, dtype)
        return array if self.device_kernels is not None else array.numpy()

    # -- the WeightSource interface --------------------------------------------------------

    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray:
        if isinstance(self._embedding, torch.Tensor):
            return self._embedding.numpy()[token_ids]
        return self._embedding.row_slice(token_ids)

    def layer(self, layer_idx: int) -> Weights:
        weights = self._layers.get(layer_idx)
        if weights is None:
            return self.streamer.get(layer_idx)
        if self.streamer is not None:
            self.streamer.release()  # the streamed layer before this one is done with
        return weights

    def held_layer(self, layer_idx: int) -> Weights:
        """A layer held in RAM or on the device tier, for a decoder beside the model's own (a
        self-draft's): unlike layer(), it leaves the streamer alone, which runs in layer order."""
        weights = self._layers.get(layer_idx)
        if weights is None:
            raise ValueError(f"layer {layer_idx} is streamed, not held")
        return weights

    def output_norm(self) -> np.ndarray:
        """Asked for once a pass's layers are done: the last streamed layer's slot is free, so the
        whole ring reads the next pass's first streamed layers while the head and whatever comes
        between passes (a draft proposing the next tree) run."""
        if self.streamer is not None:
            self.streamer.release()
        return self._output_norm

    def output(self) -> Linear:
        return self._output

    def rope_freq_factors(self) -> torch.Tensor | None:
        return self._rope_freqs

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes held on the device tier (layers and, once allocated, their KV caches, or cached
        experts), weight bytes held in RAM (globals, resident layers, the ring) and read from disk."""
        return {"gpu": self.device.used if self.device else 0, **self._bytes}

    def reset_peak(self) -> None:
        """Starts measuring peak_bytes_by_tier afresh (at a generation's start)."""
        if self.device is not None:
            self.device.reset_peak()
        if self._streamed is not None:
            self._streamed.buffers.reset_peak()

    def peak_bytes_by_tier(self) -> dict[str, int]:
        """The most bytes held per tier since reset_peak(): what bytes_by_tier counts, with the
        GPU tier's and the streamed experts' buffers at their highest (the rest does not change)."""
        cpu = self._bytes["cpu"]
        if self._streamed is not None:
            cpu = self._fixed_ram + self._streamed.buffers.peak_mapped_bytes
        return {"gpu": self.device.peak if self.device else 0, "cpu": cpu, "disk": self._bytes["disk"]}

    def close(self) -> None:
        if getattr(self, "streamer", None) is not None:
            self.streamer.close()
        if self._streamed is not None:
            self._streamed.close()
        if self.disk is not None:
            self.disk.close()


def _packed_spec(spec: dict) -> bool:
    return spec["kind"] == "packed" or (spec["kind"] == "concat" and any(map(_packed_spec, spec["parts"])))


def _computed_by_kernels(linear: Linear) -> bool:
    if isinstance(linear, ConcatLinear):
        return any(_computed_by_kernels(part) for part in linear.parts)
    return isinstance(linear, PackedLinear)


class ResidentExperts:
    """A MoE layer's experts, all in RAM."""

    def __init__(self, experts: list[Weights]):
        self.experts = experts

    def dropped(self, chosen: np.ndarray, weights, verifying: bool = False) -> None:
        return None  # every expert is at hand

    def groups(self, chosen: np.ndarray, residual, dropped: None = None
               ) -> Iterator[list[tuple[int, Weights]]]:
        yield [(e, self.experts[e]) for e in np.unique(chosen).tolist()]


def _expert_tier(packed: PackedFile, disk: DiskFile | None, config: ModelConfig,
                 placement: ExpertPlacement | None, device: DeviceTier | None, device_kernels: Kernels | None
                 ) -> tuple[ExpertStore | HybridExperts | None, StreamedExperts | None]:
    """(the tier the experts not placed on the GPU by hand come through, if any; the RAM cache of
    those whose home is disk, if any)."""
    if placement is None:
        return None, None
    layers = [i for i in config.moe_layers if i not in placement.gpu_layers]
    streamed = StreamedExperts(packed, disk, placement.ram_cache_bytes) if placement.home == "disk" else None
    if placement.gpu_cache_bytes:
        tier = HybridExperts(packed, config, device, device_kernels, placement.gpu_cache_bytes,
                             placement.scheduler, streamed, layers)
    else:
        tier = ExpertStore(streamed, config, layers) if streamed is not None and layers else None
    if tier is not None:
        tier.skip_below, tier.union_cap = placement.skip_below, placement.union_cap
    return tier, streamed


def _experts_bytes(packed: PackedFile, layer_idx: int) -> int:
    return sum(extent.nbytes for extent in packed.experts[layer_idx])
