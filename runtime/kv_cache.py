"""The key/value cache, preallocated for the whole context so decoding never allocates."""

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tierflow.cpu_kernels.kv_layout import CACHE_DTYPES, cache_shapes, decode, encode, read_rows, write_rows
from tierflow.cpu_kernels.reference import apply_rope
from tierflow.errors import InvalidArgumentError
from tierflow.kv_types import KV_TYPES, KVType
from tierflow.runtime.config import ModelConfig

SHIFT_CHUNK = 1024  # positions a context shift reads, re-rotates and writes at a time: bounds its copies

# allocate(layer_idx, shape, dtype) -> a zeroed array of the layer's cache, where it computes
Allocate = Callable[[int, tuple[int, ...], torch.dtype], np.ndarray | torch.Tensor]


def allocate_in_ram(_: int, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
    return torch.zeros(shape, dtype=dtype).numpy()


class KVCache:
    """Keys and values of every layer in one of llama.cpp's cache types, filled up to `length`.

    Each head's key or value at a position is a row in the type (D floats or halves, or q8_0 /
    q4_0 blocks: cpu_kernels/kv_layout.py). A layer's keys are [K, C/16, R, 16], the rows of 16
    positions transposed so that the attention kernels score 16 positions with vertical
    multiply-adds over one contiguous block; its values are [K, C, R]. C is the context length
    rounded up to 16. `allocate` gives a layer's zeroed arrays: by default numpy, in RAM; a layer
    computed on the GPU keeps its cache there (offload.tiered.TieredWeights.allocate_cache).
    """

    def __init__(self, config: ModelConfig, context_length: int, allocate: Allocate | None = None,
                 kv_type: KVType | None = None):
        self.kv_type = KV_TYPES["f32"] if kv_type is None else kv_type
        self.kv_type.check_head_dim(config.head_dim)
        capacity = -(-context_length // 16) * 16
        key_shape, value_shape = cache_shapes(self.kv_type, config.num_kv_heads, capacity, config.head_dim)
        dtype, allocate = CACHE_DTYPES[self.kv_type.name], allocate or allocate_in_ram
        layers = range(config.num_layers)
        self.keys = [allocate(i, key_shape, dtype) for i in layers]
        self.values = [allocate(i, value_shape, dtype) for i in layers]
        self.context_length = context_length
        self.length = 0  # positions holding valid entries, the same for every layer

    @property
    def num_bytes(self) -> int:
        return sum(array.nbytes for array in [*self.keys, *self.values])

    def read(self, layer: int, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s (keys, values) at the positions, each float32 [K, n, D], dequantized."""
        keys, values, index = self._tensors(layer, positions)
        return tuple(decode(rows, self.kv_type).cpu().numpy() for rows in read_rows(keys, values, index))

    def write(self, layer: int, positions: Sequence[int] | np.ndarray, keys: np.ndarray | torch.Tensor,
              values: np.ndarray | torch.Tensor) -> None:
        """Stores keys and values [K, n, D] (float32) at the positions of layer `layer`, in the
        cache's type (quantized as llama.cpp does)."""
        store_keys, store_values, index = self._tensors(layer, positions)
        rows = [encode(torch.as_tensor(x, device=store_keys.device), self.kv_type) for x in (keys, values)]
        write_rows(store_keys, store_values, index, *rows)

    def _tensors(self, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s arrays as tensors sharing their memory, and the positions on their device."""
        keys, values = (torch.as_tensor(array) for array in (self.keys[layer], self.values[layer]))
        return keys, values, torch.as_tensor(np.asarray(positions, np.int64), device=keys.device)

    def truncate(self, length: int) -> None:
        """Forgets positions >= length (the entries are overwritten by the next write)."""
        self.length = max(0, min(length, self.length))

    def keep_path(self, start: int, offsets: Sequence[int]) -> None:
        """Of the tokens written from slot `start` on (a token tree), keeps those at the given
        offsets (a root-to-node path, ascending) as positions start, start + 1, ..., and forgets
        the rest. Their keys were rotated for those positions already (a tree token's position
        is start plus its depth), so moving their rows, in whatever type, is all it takes."""
        src = start + np.asarray(offsets, np.int64)
        dst = start + np.arange(len(src))
        moved = src != dst
        if moved.any():
            for layer in range(len(self.keys)):
                keys, values, s = self._tensors(layer, src[moved])
                write_rows(keys, values, s.new_tensor(dst[moved]), *read_rows(keys, values, s))
        self.length = start + len(src)

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
                positions = np.arange(src, min(src + SHIFT_CHUNK, self.length))
                keys, values, moved = self._tensors(layer, positions)
                key_rows, value_rows = read_rows(keys, values, moved)  # copies: the moves may overlap
                turned = apply_rope(decode(key_rows, self.kv_type).double(),
                                    *(row.to(keys.device) for row in back), style)
                # the values move as stored; only the keys, turned, are stored again in the type
                key_rows = encode(turned.float(), self.kv_type)
                write_rows(keys, values, moved - num_dropped, key_rows, value_rows)
        self.length -= num_dropped

