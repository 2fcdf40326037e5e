"""The memory a model takes besides its weights, and the budgets a machine offers by default.

runtime/loading/loader.py is the one place these become a load's budgets; the planner and the draft's
placement count with the same figures. cpu_memory holds, beside the weights kept in RAM, the KV
cache of the layers computed there and the activations of the largest pass; gpu_memory the GPU
layers and their caches.
"""

import os
from dataclasses import dataclass

import psutil

from tierflow.errors import PlanBudgetError
from tierflow.kv_types import MAX_PASS_TOKENS, KVType
from tierflow.runtime.models.config import ModelConfig
from tierflow.runtime.models.latent_attention import QUERY_CHUNK
from tierflow.units import format_size, round_up_as_printed

CPU_MARGIN_FRACTION, CPU_MARGIN_MIN = 0.10, 1 << 30  # the default cpu_memory keeps this much RAM free


def layer_kv_bytes(config: ModelConfig, layer_idx: int, context_length: int, kv: KVType) -> int:
    """One layer's memory of one sequence with its keys and values stored as `kv`, as its kind
    counts it (runtime/memory/kinds.py): the whole context's rows, a ring, the latent rows, or a
    linear-attention layer's recurrent state (whatever the context)."""
    return config.layer_memory(layer_idx).num_bytes(context_length, kv)


def kv_cache_bytes(config: ModelConfig, context_length: int, kv: KVType) -> int:
    """The whole KV cache: every layer's keys and values."""
    return sum(layer_kv_bytes(config, i, context_length, kv) for i in range(config.num_layers))


def scratch_bytes(config: ModelConfig, tokens: int, keys: int) -> int:
    """Activations of a pass of `tokens` tokens attending to `keys` positions (an estimate). The
    attention kernel's scores are per thread, not per token: each thread scores one token's query
    heads of one key/value head at a time (group x keys floats), and the cores bound the threads.
    A layer's kind of memory adds its own pass (a linear-attention layer's recurrence)."""
    c = config
    if c.kv_lora_rank:
        return latent_scratch_bytes(config, tokens, keys)
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    scores = (os.cpu_count() or 1) * (c.num_heads // c.num_kv_heads) * keys
    recurrent = max(kind.pass_bytes(tokens) for kind in c.memory)
    return 4 * (tokens * (c.hidden_size + 2 * c.ffn_size + qkv) + scores + c.vocab_size) + recurrent


def latent_scratch_bytes(config: ModelConfig, tokens: int, keys: int) -> int:
    """scratch_bytes of latent attention (runtime/models/latent_attention.py, in torch): per token
    its queries in the cache rows' space and the heads' outputs; the cache rows read back, every
    key's; the scores of QUERY_CHUNK tokens at a time, in three copies (scores, masked, softmax)."""
    c, row = config, config.cache_rows.key_dim
    per_token = c.hidden_size + 2 * max(c.ffn_size, c.expert_ffn_size) + c.num_heads * (row + c.head_dim)
    scores = 3 * min(tokens, QUERY_CHUNK) * c.num_heads * keys
    return 4 * (tokens * per_token + keys * row + scores + c.vocab_size)


def activation_bytes(config: ModelConfig, context_length: int) -> int:
    """The activations of the largest pass: a prefill chunk at the context's end, whose attention
    scores every key (what cpu_memory keeps for them)."""
    return scratch_bytes(config, min(MAX_PASS_TOKENS, context_length), context_length)


@dataclass(frozen=True)
class RamBudget:
    """cpu_memory, of which `reserved` (the KV cache in RAM and the activations) is not the
    weights': their room is what is left."""

    budget: int
    reserved: int

    @property
    def room(self) -> int:
        return self.budget - self.reserved

    def beside(self) -> str:
        """What a refusal adds to the weights it names."""
        return (f" beside the KV cache and activations it keeps ({format_size(self.reserved)})"
                if self.reserved else "")

    def minimum(self, weight_bytes: int) -> int:
        """The least cpu_memory that holds `weight_bytes` of weights, rounded up as printed."""
        return round_up_as_printed(weight_bytes + self.reserved)

    def refuse(self, need: str, weight_bytes: int) -> PlanBudgetError:
        """The error for a budget that cannot hold `need`, `weight_bytes` of weights."""
        minimum = self.minimum(weight_bytes)
        return PlanBudgetError(f"cpu_memory {format_size(self.budget)} cannot hold {need}{self.beside()}: "
                               f"at least {format_size(minimum)} is needed", minimum)


@dataclass(frozen=True)
class CacheFootprint:
    """A load's KV cache, layer by layer, and the activations of its largest pass: what its
    budgets hold beside the weights."""

    kv: KVType
    on_cpu: bool  # every layer's cache in RAM, the GPU layers' too (llama.cpp's -nkvo)
    layer_bytes: tuple[int, ...]
    activation_bytes: int

    @classmethod
    def of(cls, config: ModelConfig, context_length: int, kv: KVType, on_cpu: bool,
           sequences: int = 1, draft_layers: int = 0) -> "CacheFootprint":
        """The footprint of `sequences` KV caches of context_length positions each (one per sequence
        decoded together), and a self-draft's one cache of the first draft_layers layers (which
        the draft computes with the target's own weights, where the target computes them); a
        pass's activations are bounded by its token count whatever it holds."""
        layer_bytes = tuple((sequences + (i < draft_layers)) * layer_kv_bytes(config, i, context_length, kv)
                            for i in range(config.num_layers))
        return cls(kv, on_cpu, layer_bytes, activation_bytes(config, context_length))

    def on_gpu(self) -> list[int]:
        """Each layer's cache bytes on the GPU were the layer computed there (0 with on_cpu)."""
        return [0 if self.on_cpu else n for n in self.layer_bytes]

    def gpu_bytes(self, gpu_layers: tuple[int, ...]) -> int:
        return 0 if self.on_cpu else sum(self.layer_bytes[i] for i in gpu_layers)

    def ram_bytes(self, gpu_layers: tuple[int, ...]) -> int:
        """What cpu_memory holds beside the weights: the caches in RAM and the activations."""
        return sum(self.layer_bytes) - self.gpu_bytes(gpu_layers) + self.activation_bytes

    def ram(self, cpu_budget: int, gpu_layers: tuple[int, ...]) -> RamBudget:
        return RamBudget(cpu_budget, self.ram_bytes(gpu_layers))


def available_ram_bytes() -> int:
    """Available RAM less max(10% of total, 1 GiB): the default cpu_memory."""
    memory = psutil.virtual_memory()
    margin = max(int(CPU_MARGIN_FRACTION * memory.total), CPU_MARGIN_MIN)
    return max(0, memory.available - margin)
