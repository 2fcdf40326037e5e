"""Loading a draft model beside its target: checked against the target's vocabulary, and placed
before it (the draft runs every step): on the GPU tier when there is a GPU budget and all of it
fits with its KV cache (unless kv_on_cpu keeps that in RAM), else in RAM, never streamed. Its KV
cache has the target's type and context. The target then plans with what is left."""

import os

from tierflow.errors import BudgetError, ContextLengthError, InvalidArgumentError
from tierflow.offload.gguf.model_file import ModelFile, open_model_file
from tierflow.offload.gguf.reader import GGUFFile
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan.budgets import CacheFootprint
from tierflow.offload.plan.planner import resident_plan
from tierflow.offload.store.model_path import resolve_model_path
from tierflow.progress import LoadProgress
from tierflow.runtime.loading.loader import Budgets, GpuTier, LoadedModel, load_planned
from tierflow.units import format_size

VOCAB_KEY = "tokenizer.ggml.tokens"


def load_draft(model: str | os.PathLike, target: ModelFile, budgets: Budgets, gpu: GpuTier,
               progress: LoadProgress | None = None) -> LoadedModel:
    """The draft model, resident, within the target's budgets (which the caller then reduces by
    its bytes_by_tier); on the GPU tier with its KV cache when all of it fits there."""
    path = resolve_model_path(model)
    with open_model_file(path) as draft:
        config = draft.config
        _check_vocabulary(draft.gguf, target.gguf)
        if config.vocab_size != target.config.vocab_size:
            raise InvalidArgumentError(f"the draft {path.name} scores {config.vocab_size} tokens, the target "
                                       f"{target.config.vocab_size}: a draft must share the target's "
                                       f"vocabulary")
        # A target run past its trained context was asked to (the loader refuses it otherwise).
        extended = budgets.context_length > target.config.context_length
        if budgets.context_length > config.context_length and not extended:
            raise ContextLengthError(f"the draft {path.name} holds {config.context_length} positions, "
                                     f"fewer than context_length {budgets.context_length}")
        config.cache_rows.check(budgets.kv)
        sizes = pack_sizes(draft)
        cache = CacheFootprint.of(config, budgets.context_length, budgets.kv, budgets.kv_on_cpu)
        every_layer = tuple(range(config.num_layers))
        layer_bytes = sum(x.nbytes for x in sizes.layers)
        on_gpu = not config.is_moe and 0 < layer_bytes + cache.gpu_bytes(every_layer) <= budgets.gpu_bytes
        gpu_layers = every_layer if on_gpu else ()
        in_ram = sizes.total_bytes - (layer_bytes if on_gpu else 0) + cache.ram_bytes(gpu_layers)
        if in_ram > budgets.cpu_bytes:
            raise BudgetError(f"cpu_memory {format_size(budgets.cpu_bytes)} cannot hold the draft model "
                              f"{path.name} ({format_size(in_ram)} in RAM with its KV cache and "
                              f"activations), which is placed first")
        plan = resident_plan(draft, sizes, on_gpu=on_gpu, gpu_budget=budgets.gpu_bytes,
                             cpu_budget=budgets.cpu_bytes, context_length=budgets.context_length,
                             kv=budgets.kv, kv_on_cpu=budgets.kv_on_cpu)
        return load_planned(draft, plan, gpu, progress)


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
