"""The memory a model takes besides its weights, and the budgets a machine offers by default.

runtime/loader.py is the one place these become a load's budgets; the planner and the draft's
placement count with the same figures.
"""

import psutil

from tierflow.runtime.config import ModelConfig

CPU_MARGIN_FRACTION, CPU_MARGIN_MIN = 0.10, 1 << 30  # the default cpu_memory keeps this much RAM free


def kv_cache_bytes(config: ModelConfig, context_length: int) -> int:
    """KVCache's float32 keys and values, capacity rounded up to 16 positions as it allocates."""
    capacity = -(-context_length // 16) * 16
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 * capacity


def scratch_bytes(config: ModelConfig, tokens: int, keys: int) -> int:
    """Activations of a pass of `tokens` tokens attending to `keys` positions (an estimate)."""
    c = config
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return 4 * (tokens * (c.hidden_size + 2 * c.ffn_size + qkv) + tokens * keys * c.num_heads + c.vocab_size)


def available_ram_bytes(reserved_bytes: int = 0) -> int:
    """Available RAM less max(10% of total, 1 GiB) and `reserved_bytes`."""
    memory = psutil.virtual_memory()
    margin = max(int(CPU_MARGIN_FRACTION * memory.total), CPU_MARGIN_MIN)
    return max(0, memory.available - margin - reserved_bytes)
