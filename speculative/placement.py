"""Loading a draft model beside its target: checked against the target's vocabulary, and placed
before it (the draft runs every step): on the GPU tier when there is a GPU budget and it fits,
in RAM otherwise, never streamed. The target then plans with what the draft left."""

import os
from dataclasses import dataclass

import torch

from tierflow.errors import BudgetError, ContextLengthError, InvalidArgumentError
from tierflow.offload.gguf.model_info import read_config
from tierflow.offload.gguf.model_path import resolve_model_path
from tierflow.offload.gguf.reader import GGUFFile, read_gguf
from tierflow.offload.gguf.tensors import check_tensors
from tierflow.offload.pack.extents import model_extents
from tierflow.offload.pack.packed_file import LoadProgress, open_pack
from tierflow.offload.plan.planner import kv_cache_bytes
from tierflow.offload.tiers.device import DeviceTier
from tierflow.offload.tiers.tiered import TieredWeights
from tierflow.runtime.generation import TokenGenerator
from tierflow.runtime.kv_cache import KVCache
from tierflow.runtime.model import Decoder, Kernels
from tierflow.units import format_size

VOCAB_KEY = "tokenizer.ggml.tokens"


@dataclass
class LoadedDraft:
    generator: TokenGenerator
    weights: TieredWeights

    def bytes_by_tier(self) -> dict[str, int]:
        return self.weights.bytes_by_tier()

    def close(self) -> None:
        self.weights.close()


def load_draft(model: str | os.PathLike, target: GGUFFile, target_vocab_size: int, context_length: int,
               cpu_budget: int | None, gpu_budget: int, gpu_device: torch.device,
               device_kernels: Kernels | None, progress: LoadProgress | None) -> LoadedDraft:
    """The draft model, resident, under the budgets (which the caller then reduces by its
    bytes_by_tier for the target); on the GPU tier (with its KV cache) it is computed by
    device_kernels (None: the CPU kernels, on the CPU standing in for a GPU)."""
    path = resolve_model_path(model)
    with read_gguf(path) as gguf:
        config = read_config(gguf)
        check_tensors(gguf, config)
        _check_vocabulary(gguf, target)
        if config.vocab_size != target_vocab_size:
            raise InvalidArgumentError(f"the draft {path.name} scores {config.vocab_size} tokens, the target "
                                       f"{target_vocab_size}: a draft must share the target's vocabulary")
        if context_length > config.context_length:
            raise ContextLengthError(f"the draft {path.name} holds {config.context_length} positions, "
                                     f"fewer than context_length {context_length}")
        globals_, layers = model_extents(gguf, config)
        layer_bytes = sum(layer.nbytes for layer in layers)
        on_gpu = 0 < layer_bytes + kv_cache_bytes(config, context_length) <= gpu_budget
        in_ram = globals_.nbytes + (0 if on_gpu else layer_bytes)
        if cpu_budget is not None and in_ram > cpu_budget:
            raise BudgetError(f"cpu_memory {format_size(cpu_budget)} cannot hold the draft model "
                              f"{path.name} ({format_size(in_ram)} in RAM), which is placed first")
        packed = open_pack(gguf, config, progress)
        device = DeviceTier(gpu_device, gpu_budget) if on_gpu else None
        gpu_layers = range(config.num_layers) if on_gpu else ()
        weights = TieredWeights(packed, (), 0, progress, gpu_layers, device, device_kernels)
    cache = KVCache(config, context_length, weights.allocate_cache)
    generator = TokenGenerator(Decoder(config, weights, context_length), cache)
    return LoadedDraft(generator, weights)


def _check_vocabulary(draft: GGUFFile, target: GGUFFile) -> None:
    ours, theirs = draft.metadata.get(VOCAB_KEY), target.metadata.get(VOCAB_KEY)
    if ours is None or theirs is None:
        raise InvalidArgumentError(f"the draft {draft.path.name} or the target has no vocabulary "
                                   f"({VOCAB_KEY}) to compare")
    if len(ours) != len(theirs):
        raise InvalidArgumentError(f"the draft {draft.path.name} has a vocabulary of {len(ours)} tokens, "
                                   f"the target {len(theirs)}: a draft must share the target's")
    differ = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if differ is not None:
        raise InvalidArgumentError(f"the draft {draft.path.name}'s token {differ} is {ours[differ]!r}, the "
                                   f"target's {theirs[differ]!r}: a draft must share the target's vocabulary")
