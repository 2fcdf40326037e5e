"""The attention layers' key and value rows of one sequence, preallocated for the whole context (a
ring for a sliding-window layer) so decoding never allocates: the FullCache, RingCache and
LatentCache kinds of runtime/memory/kinds.py, allocated."""

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from tierflow.cpu_kernels.hadamard import cache_rotation_sizes, hadamard
from tierflow.cpu_kernels.kv_layout import (
    CACHE_DTYPES,
    cache_shapes,
    decode,
    encode,
    read_rows,
    row_items,
    write_rows,
)
from tierflow.cpu_kernels.torch_ops import apply_rope
from tierflow.errors import InvalidArgumentError
from tierflow.kv_types import MAX_PASS_TOKENS, CacheRows, KVType, scored_slots
from tierflow.runtime.memory.kinds import Allocate, LayerMemory

SHIFT_CHUNK = 1024  # positions a context shift reads, re-rotates and writes at a time: bounds its copies

def allocate_in_ram(_: int, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
    return torch.zeros(shape, dtype=dtype).numpy()


class AttentionRows:
    """Keys and values of every attention layer in one of llama.cpp's cache types.

    Each head's key or value at a position is a row in the type (D floats or halves, or q8_0 /
    q4_0 blocks: cpu_kernels/kv_layout.py). A layer's keys are [K, C/16, R, 16], the rows of 16
    positions transposed so that the attention kernels score 16 positions with vertical
    multiply-adds over one contiguous block; its values are [K, C, R]. C, the layer's capacity, is
    what its kind says (`LayerMemory.positions`): the context rounded up to 16, or for a
    sliding-window layer whose context is longer a ring of its window and a pass: position p is in
    slot p % C, so a ring holds the latest C positions written; a layer of another kind (a
    recurrent state) has none. A quantized type holds its rows rotated by a Walsh-Hadamard
    transform where llama.cpp's does (cpu_kernels/hadamard.py): `write` takes and `read` gives
    them unrotated. Latent rows (CacheRows.latent) are one key row per position, [rotary key part,
    latent], and values of width 0: the latent part of the key row is the values (rotated with the
    keys in a quantized type).

    A ring can go back only as far as it still holds the window before the new end. After a
    context shift, a ring that had overwritten some of the kept positions no longer holds them:
    `held_from[layer]` is the oldest position a layer holds, and the kernels attend to none
    before it, as llama.cpp's sliding-window cache drops its evicted cells.
    """

    def __init__(self, memory: Sequence[LayerMemory], rows: CacheRows, context_length: int,
                 allocate: Allocate, kv_type: KVType):
        self.kv_type = kv_type
        rows.check(kv_type)
        self.key_rotation, self.value_rotation = cache_rotation_sizes(kv_type, rows)  # 0: none
        # the items a shift decodes, turns and encodes again: a key row, or a latent row's rotary part
        self._turned_items = row_items(kv_type, rows.rotary_dim if rows.latent else rows.key_dim)
        self.windows = [kind.window for kind in memory]
        self.capacities = [kind.positions(context_length) for kind in memory]
        dtype = CACHE_DTYPES[kv_type.name]
        key_shapes, value_shapes = ([cache_shapes(kv_type, rows.heads, capacity, dim)[which]
                                     for capacity in self.capacities]
                                    for which, dim in ((0, rows.key_dim), (1, rows.value_dim)))
        layers = range(len(memory))
        self.keys = [allocate(i, key_shapes[i], dtype) for i in layers]
        self.values = [allocate(i, value_shapes[i], dtype) for i in layers]  # latent: [1, C, 0]
        self.held_from = [0] * len(memory)  # per layer: none before it since a context shift
        self._written = 0  # 1 + the last position written: a ring holds none before _written - C

    @property
    def num_bytes(self) -> int:
        return sum(array.nbytes for array in [*self.keys, *self.values])

    can_shift = True

    def read(self, layer: int, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys, values, index = self._tensors(layer, positions)
        sizes = (self.key_rotation, self.value_rotation)
        return tuple(hadamard(decode(rows, self.kv_type), size).cpu().numpy()
                     for rows, size in zip(read_rows(keys, values, index), sizes))

    def write(self, layer: int, positions: Sequence[int] | np.ndarray, keys: np.ndarray | torch.Tensor,
              values: np.ndarray | torch.Tensor) -> None:
        store_keys, store_values, index = self._tensors(layer, positions)
        rows = [self._encoded(torch.as_tensor(x, device=store_keys.device), size)
                for x, size in ((keys, self.key_rotation), (values, self.value_rotation))]
        write_rows(store_keys, store_values, index, *rows)
        if len(index):
            self._written = max(self._written, int(np.max(positions)) + 1)

    def _encoded(self, rows: torch.Tensor, rotation: int) -> torch.Tensor:
        """Rows [K, n, D] float32 as the cache stores them: rotated and in its type. A latent
        cache's values (D = 0: its keys are its values) have nothing to encode."""
        if not rows.shape[-1]:
            return rows.to(CACHE_DTYPES[self.kv_type.name])
        return encode(hadamard(rows, rotation), self.kv_type)

    def begin_pass(self, start: int, count: int, parents: np.ndarray | None, tree_start: int | None,
                   exact: bool) -> None:
        """Refuses, before anything is written, a pass of `count` tokens from `start` (a tree's from
        slot tree_start) that a layer cannot take (a ring holds the window before a pass and at
        most MAX_PASS_TOKENS of its tokens), and notes what the rings overwrite."""
        first, end = (start if parents is None else tree_start), start + count
        for layer, (window, capacity) in enumerate(zip(self.windows, self.capacities)):
            if capacity and scored_slots(first, end, window) > capacity:
                raise InvalidArgumentError(
                    f"positions {first} .. {end - 1} do not fit in layer {layer}'s cache of {capacity} "
                    f"positions" + (f" (a ring of its window of {window} and a pass of at most "
                                    f"{MAX_PASS_TOKENS} tokens)" if window else ""))
        self._written = max(self._written, end)

    def layer_pass(self, layer: int) -> dict:
        """What a layer's pass reads and writes of these rows (SequencePass's fields)."""
        return dict(keys=self.keys[layer], values=self.values[layer], held_from=self.held_from[layer])

    def end_pass(self) -> None:
        pass

    def _tensors(self, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s arrays as tensors sharing their memory, and the positions' slots on their
        device."""
        keys, values = (torch.as_tensor(array) for array in (self.keys[layer], self.values[layer]))
        slots = np.asarray(positions, np.int64) % self.capacities[layer]
        return keys, values, torch.as_tensor(slots, device=keys.device)

    def _oldest(self, layer: int) -> int:
        """The oldest position layer `layer` holds: all from it to the last written are there."""
        return max(self.held_from[layer], self._written - self.capacities[layer])

    def reachable(self, length: int) -> int:
        """`length` if every layer still holds what a token at `length` sees (and had not lost it to
        a context shift), else 0."""
        held = length == 0 or all(self._holds_window(layer, length) for layer in range(len(self.keys))
                                  if self.capacities[layer])
        return length if held else 0

    def _holds_window(self, layer: int, length: int) -> bool:
        window, held_from = self.windows[layer], self.held_from[layer]
        first_seen = max(length - window + 1, held_from) if window else held_from
        return held_from <= length and self._oldest(layer) <= first_seen

    def truncate(self, length: int) -> None:
        if self.reachable(length) != length:
            raise InvalidArgumentError(f"the KV cache cannot go back to {length} positions: a sliding-window "
                                       f"layer's ring no longer holds the window before it")
        if length == 0:
            self.held_from = [0] * len(self.held_from)
            self._written = 0

    def checkpoint(self, length: int) -> None:
        """Rows need nothing kept to go back: a position's rows stay until overwritten."""

    def keep_path(self, start: int, offsets: Sequence[int]) -> None:
        """Moves the rows of the tree tokens at `offsets` from slot `start` to positions start,
        start + 1, ...: their keys were rotated for those positions already (a tree token's
        position is start plus its depth), so moving their rows, in whatever type, is all it takes."""
        src = start + np.asarray(offsets, np.int64)
        dst = start + np.arange(len(src))
        moved = src != dst
        if moved.any():
            for layer in (layer for layer in range(len(self.keys)) if self.capacities[layer]):
                keys, values, s = self._tensors(layer, src[moved])
                d = self._tensors(layer, dst[moved])[2]
                write_rows(keys, values, d, *read_rows(keys, values, s))

    def shift(self, length: int, keep: int, num_dropped: int,
              rotations: Sequence[tuple[np.ndarray, np.ndarray]], neox: bool) -> None:
        """KVCache.shift over these rows, of `length` positions."""
        for layer, (cos, sin) in enumerate(rotations):
            magnitude = np.hypot(cos, sin)
            back = [torch.from_numpy(row / magnitude)[None].double() for row in (cos, -sin)]  # [1, R/2] each
            oldest = self._oldest(layer)
            self._move_back(layer, np.arange(max(keep + num_dropped, oldest), length), num_dropped, back,
                            "neox" if neox else "normal", length)
            self.held_from[layer] = oldest if oldest <= keep else max(oldest - num_dropped, keep)
        self._written = length - num_dropped  # what a ring holds is now counted in the new positions

    def _move_back(self, layer: int, positions: np.ndarray, distance: int, back: list[torch.Tensor],
                   style: str, length: int) -> None:
        """Moves the entries at the positions (ascending) `distance` positions down, their keys
        turned back (rotary rows `back`), a chunk at a time. Where a layer's positions wrap around
        its ring, a move can land on the slot of a position still to be moved: there every chunk
        is read before any is written."""
        chunks = [positions[i:i + SHIFT_CHUNK] for i in range(0, len(positions), SHIFT_CHUNK)]
        staged: Iterator | list = (self._stored_rows(layer, chunk) for chunk in chunks)
        if length > self.capacities[layer]:
            staged = list(staged)  # at most a ring's rows
        for chunk, (key_rows, value_rows) in zip(chunks, staged):
            keys, values, moved = self._tensors(layer, chunk - distance)
            turned_rows, kept_rows = key_rows[..., :self._turned_items], key_rows[..., self._turned_items:]
            plain = hadamard(decode(turned_rows, self.kv_type), self.key_rotation)
            turned = apply_rope(plain.double(), *(row.to(keys.device) for row in back), style)
            # the values (and a latent) move as stored; only what was turned is stored again in the type
            stored = encode(hadamard(turned.float(), self.key_rotation), self.kv_type)
            write_rows(keys, values, moved, torch.cat([stored, kept_rows], dim=-1), value_rows)

    def _stored_rows(self, layer: int, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows (in the type) at the positions."""
        return read_rows(*self._tensors(layer, positions))
