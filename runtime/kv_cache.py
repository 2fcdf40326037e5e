"""The key/value cache, preallocated for the whole context so decoding never allocates."""

import numpy as np

from tierflow.runtime.config import ModelConfig


class KVCache:
    """Keys and values of every layer, float32, filled up to `length` positions.

    Keys are stored transposed, [L, KvH, D, C], so that the attention kernel scores 16
    positions with vertical multiply-adds; values are [L, KvH, C, D]. C is the context length
    rounded up to a multiple of 16 (the kernel's block of positions), plus 16 when a row of keys
    would be a multiple of 4 KiB: rows that far apart share cache sets, and the kernel reads
    D of them at once.
    """

    def __init__(self, config: ModelConfig, context_length: int):
        capacity = -(-context_length // 16) * 16
        if (capacity * 4) % 4096 == 0:
            capacity += 16
        heads, dim = config.num_kv_heads, config.head_dim
        self.keys = np.zeros((config.num_layers, heads, dim, capacity), np.float32)
        self.values = np.zeros((config.num_layers, heads, capacity, dim), np.float32)
        self.context_length = context_length
        self.length = 0  # positions holding valid entries, the same for every layer

    @property
    def num_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def truncate(self, length: int) -> None:
        """Forgets positions >= length (the entries are overwritten by the next write)."""
        self.length = max(0, min(length, self.length))
