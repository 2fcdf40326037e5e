"""The key/value cache, preallocated for the whole context so decoding never allocates."""

import torch

from tierflow.runtime.config import ModelConfig


class KVCache:
    """Keys and values of every layer: [L, KvH, C, D] each, filled up to `length` positions."""

    def __init__(self, config: ModelConfig, context_length: int, dtype: torch.dtype = torch.float32):
        shape = (config.num_layers, config.num_kv_heads, context_length, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)
        self.context_length = context_length
        self.length = 0  # positions holding valid entries, the same for every layer

    @property
    def num_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def truncate(self, length: int) -> None:
        """Forgets positions >= length (the entries are overwritten by the next write)."""
        self.length = max(0, min(length, self.length))
