"""The key/value cache, preallocated for the whole context so decoding never allocates."""

from collections.abc import Sequence

import numpy as np

from tierflow.runtime.config import ModelConfig


class KVCache:
    """Keys and values of every layer, float32, filled up to `length` positions.

    Keys are stored in blocks of 16 positions, each block transposed: [L, KvH, C/16, D, 16], so
    that the attention kernel scores 16 positions with vertical multiply-adds over one
    contiguous block; values are [L, KvH, C, D]. C is the context length rounded up to 16.
    """

    def __init__(self, config: ModelConfig, context_length: int):
        capacity = -(-context_length // 16) * 16
        heads, dim = config.num_kv_heads, config.head_dim
        self.keys = np.zeros((config.num_layers, heads, capacity // 16, dim, 16), np.float32)
        self.values = np.zeros((config.num_layers, heads, capacity, dim), np.float32)
        self.context_length = context_length
        self.length = 0  # positions holding valid entries, the same for every layer

    @property
    def num_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def truncate(self, length: int) -> None:
        """Forgets positions >= length (the entries are overwritten by the next write)."""
        self.length = max(0, min(length, self.length))

    def keep_path(self, start: int, offsets: Sequence[int]) -> None:
        """Of the tokens written from slot `start` on (a token tree), keeps those at the given
        offsets (a root-to-node path, ascending) as positions start, start + 1, ..., and forgets
        the rest. Their keys were rotated for those positions already (a tree token's position
        is start plus its depth), so moving them is all it takes."""
        src = start + np.asarray(offsets, np.int64)
        dst = start + np.arange(len(src))
        moved = src != dst
        if moved.any():
            s, d = src[moved], dst[moved]
            self.keys[:, :, d // 16, :, d % 16] = self.keys[:, :, s // 16, :, s % 16]
            self.values[:, :, d] = self.values[:, :, s]
        self.length = start + len(src)
