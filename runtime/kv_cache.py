"""The key/value cache, preallocated for the whole context so decoding never allocates."""

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tierflow.kv_types import KVType
from tierflow.runtime.config import ModelConfig


class KVCache:
    """Keys and values of every layer, float32, filled up to `length` positions.

    A layer's keys are stored in blocks of 16 positions, each block transposed: [KvH, C/16, D, 16],
    so that the attention kernel scores 16 positions with vertical multiply-adds over one
    contiguous block; its values are [KvH, C, D]. C is the context length rounded up to 16.
    `allocate(layer, shape)` gives a layer's zeroed arrays: by default numpy, in RAM; a layer
    computed on the GPU keeps its cache there (offload.tiered.TieredWeights.allocate_cache).
    """

    def __init__(self, config: ModelConfig, context_length: int,
                 allocate: Callable[[int, tuple[int, ...]], np.ndarray | torch.Tensor] | None = None,
                 kv_type: KVType | None = None):
        self.kv_type = kv_type  # the type asked for; the storage stays float32 until it is implemented
        capacity = -(-context_length // 16) * 16
        heads, dim = config.num_kv_heads, config.head_dim
        allocate = allocate or (lambda _, shape: np.zeros(shape, np.float32))
        layers = range(config.num_layers)
        self.keys = [allocate(i, (heads, capacity // 16, dim, 16)) for i in layers]
        self.values = [allocate(i, (heads, capacity, dim)) for i in layers]
        self.context_length = context_length
        self.length = 0  # positions holding valid entries, the same for every layer

    @property
    def num_bytes(self) -> int:
        return sum(array.nbytes for array in [*self.keys, *self.values])

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
            for keys, values in zip(self.keys, self.values):
                if isinstance(keys, torch.Tensor):
                    s, d = torch.from_numpy(s).to(keys.device), torch.from_numpy(d).to(keys.device)
                keys[:, d // 16, :, d % 16] = keys[:, s // 16, :, s % 16]
                values[:, d] = values[:, s]
        self.length = start + len(src)
