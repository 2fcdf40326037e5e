"""The key/value cache, preallocated for the whole context so decoding never allocates."""

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tierflow.cpu_kernels.reference import apply_rope
from tierflow.errors import InvalidArgumentError
from tierflow.runtime.config import ModelConfig

SHIFT_CHUNK = 1024  # positions a context shift reads, re-rotates and writes at a time: bounds its copies


class KVCache:
    """Keys and values of every layer, float32, filled up to `length` positions.

    A layer's keys are stored in blocks of 16 positions, each block transposed: [KvH, C/16, D, 16],
    so that the attention kernel scores 16 positions with vertical multiply-adds over one
    contiguous block; its values are [KvH, C, D]. C is the context length rounded up to 16.
    `allocate(layer, shape)` gives a layer's zeroed arrays: by default numpy, in RAM; a layer
    computed on the GPU keeps its cache there (offload.tiered.TieredWeights.allocate_cache).
    """

    def __init__(self, config: ModelConfig, context_length: int,
                 allocate: Callable[[int, tuple[int, ...]], np.ndarray | torch.Tensor] | None = None):
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

    def read(self, layer: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A layer's keys and values at positions (int64 [n]), each float32 numpy [K, n, D]."""
        keys, values = self.keys[layer], self.values[layer]
        index = _index_on(keys, positions)
        blocked = keys[:, index // 16, :, index % 16]  # [n, K, D]: the indexed axes go first
        return _numpy(blocked).transpose(1, 0, 2), _numpy(values[:, index])

    def write(self, layer: int, positions: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        """Stores float32 keys and values [K, n, D] at a layer's positions (int64 [n])."""
        cache_keys, cache_values = self.keys[layer], self.values[layer]
        index = _index_on(cache_keys, positions)
        cache_keys[:, index // 16, :, index % 16] = _like(cache_keys, keys.transpose(1, 0, 2))
        cache_values[:, index] = _like(cache_values, values)

    def shift(self, keep: int, num_dropped: int, rotations: Sequence[tuple[np.ndarray, np.ndarray]],
              neox: bool) -> None:
        """llama.cpp's context shift: keeps positions [0, keep), drops the next num_dropped, and moves
        the rest down by num_dropped, turning their keys back by as many positions.

        Rotary turns pair i of a key at position p by p * f_i, so R(p - n) = R(-n) R(p): one
        rotation by the angles of position n, the same for every moved key of a layer.
        rotations[layer] is that layer's rotary row (cos, sin [R/2]) of position num_dropped (rope
        scaling and frequency factors in it; layers may rotate with different bases); YaRN's
        magnitude, which that row carries and the keys carry already, is divided out.
        Features past rope_dim are not rotated. The moved entries were computed with the dropped
        tokens in view, so they approximate what a fresh prefill of the kept tokens would hold.
        """
        if not (keep >= 0 and num_dropped > 0 and keep + num_dropped <= self.length):
            raise InvalidArgumentError(f"cannot drop positions [{keep}, {keep + num_dropped}) of the "
                                       f"{self.length} the cache holds")
        style = "neox" if neox else "normal"
        for layer, (cos, sin) in enumerate(rotations):
            magnitude = np.hypot(cos, sin)
            back = [torch.from_numpy(row / magnitude)[None].double() for row in (cos, -sin)]  # [1, R/2] each
            for src in range(keep + num_dropped, self.length, SHIFT_CHUNK):
                moved = np.arange(src, min(src + SHIFT_CHUNK, self.length))
                keys, values = self.read(layer, moved)
                keys = apply_rope(torch.from_numpy(keys).double(), *back, style)
                self.write(layer, moved - num_dropped, keys.float().numpy(), values)
        self.length -= num_dropped


def _index_on(cache: np.ndarray | torch.Tensor, positions: np.ndarray) -> np.ndarray | torch.Tensor:
    index = np.asarray(positions, np.int64)
    return torch.from_numpy(index).to(cache.device) if isinstance(cache, torch.Tensor) else index


def _numpy(array: np.ndarray | torch.Tensor) -> np.ndarray:
    return array.float().cpu().numpy() if isinstance(array, torch.Tensor) else array


def _like(cache: np.ndarray | torch.Tensor, array: np.ndarray) -> np.ndarray | torch.Tensor:
    """array where it is written: on the cache's device, in its dtype."""
    if isinstance(cache, torch.Tensor):
        return torch.from_numpy(np.ascontiguousarray(array)).to(cache.device, cache.dtype)
    return array
