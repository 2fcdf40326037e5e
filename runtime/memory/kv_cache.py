"""The key/value cache, preallocated for the whole context (a ring for a sliding-window layer) so
decoding never allocates."""

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

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
from tierflow.kv_types import KV_TYPES, MAX_PASS_TOKENS, KVType, scored_slots
from tierflow.runtime.memory.kinds import RecurrentState
from tierflow.runtime.memory.recurrent_state import RecurrentStates

if TYPE_CHECKING:
    from tierflow.runtime.models.config import ModelConfig

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
    multiply-adds over one contiguous block; its values are [K, C, R]. C, the layer's capacity
    (`capacities`), is the context rounded up to 16, or for a sliding-window layer whose context
    is longer a ring of its window and a pass (kv_types.cache_positions): position p is in slot
    p % C, so a ring holds the latest C positions written. A quantized type holds its rows rotated
    by a Walsh-Hadamard transform where llama.cpp's does (cpu_kernels/hadamard.py): `write` takes
    and `read` gives them unrotated. With latent attention (ModelConfig.cache_rows) a layer holds
    one key row per position, [rotary key part, latent], and values of width 0: the latent part of
    the key row is the values (rotated with the keys in a quantized type). `allocate` gives a
    layer's zeroed arrays: by default numpy, in RAM; a layer computed on the GPU keeps its cache there
    (offload.tiers.tiered.TieredWeights.allocate_cache).

    A ring can go back (`truncate`) only as far as it still holds the window before the new end
    (`can_truncate_to`). After a context shift, a ring that had overwritten some of the kept
    positions no longer holds them: `held_from[layer]` is the oldest position a layer holds, and
    the kernels attend to none before it, as llama.cpp's sliding-window cache drops its evicted
    cells.
    """

    def __init__(self, config: "ModelConfig", context_length: int, allocate: Allocate | None = None,
                 kv_type: KVType | None = None):
        self.kv_type = KV_TYPES["f32"] if kv_type is None else kv_type
        rows = config.cache_rows
        rows.check(self.kv_type)
        self.key_rotation, self.value_rotation = cache_rotation_sizes(self.kv_type, rows)  # 0: none
        # the items a shift decodes, turns and encodes again: a key row, or a latent row's rotary part
        self._turned_items = row_items(self.kv_type, rows.rotary_dim if rows.latent else rows.key_dim)
        memory = config.memory  # each layer's kind (runtime/memory/kinds.py)
        layers = range(len(memory))
        self.windows = [kind.window for kind in memory]
        self.capacities = [kind.positions(context_length) for kind in memory]
        dtype, allocate = CACHE_DTYPES[self.kv_type.name], allocate or allocate_in_ram
        key_shapes, value_shapes = ([cache_shapes(self.kv_type, rows.heads, capacity, dim)[which]
                                     for capacity in self.capacities]
                                    for which, dim in ((0, rows.key_dim), (1, rows.value_dim)))
        self.keys = [allocate(i, key_shapes[i], dtype) for i in layers]
        self.values = [allocate(i, value_shapes[i], dtype) for i in layers]  # latent: [1, C, 0]
        self.context_length = context_length
        self.length = 0  # positions holding valid entries, the same for every layer
        self.held_from = [0] * len(memory)  # per layer: none before it since a context shift
        self._written = 0  # 1 + the last position written: a ring holds none before _written - C
        self.recurrent = None  # the linear-attention layers' states, where the model has such layers
        states = {i: kind.shape for i, kind in enumerate(memory) if isinstance(kind, RecurrentState)}
        if states:
            self.recurrent = RecurrentStates(
                next(iter(states.values())), states,
                lambda layer, shape: torch.as_tensor(allocate(layer, shape, torch.float32)))

    @property
    def num_bytes(self) -> int:
        recurrent = 0 if self.recurrent is None else self.recurrent.num_bytes
        return sum(array.nbytes for array in [*self.keys, *self.values]) + recurrent

    def read(self, layer: int, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s (keys, values) at the positions (ones it holds), each float32 [K, n, D],
        dequantized and rotated back."""
        keys, values, index = self._tensors(layer, positions)
        sizes = (self.key_rotation, self.value_rotation)
        return tuple(hadamard(decode(rows, self.kv_type), size).cpu().numpy()
                     for rows, size in zip(read_rows(keys, values, index), sizes))

    def write(self, layer: int, positions: Sequence[int] | np.ndarray, keys: np.ndarray | torch.Tensor,
              values: np.ndarray | torch.Tensor) -> None:
        """Stores keys and values [K, n, D] (float32) at the positions of layer `layer`, in the
        cache's type (rotated and quantized as llama.cpp does)."""
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

    def will_write(self, first: int, end: int) -> None:
        """Told before a pass writes positions up to `end` (its first slot `first`: a token tree's
        start, or its first token's position): refuses, before anything is written, a pass that a
        layer cannot take (a ring holds the window before a pass and at most MAX_PASS_TOKENS of
        its tokens), and notes what the rings overwrite."""
        for layer, (window, capacity) in enumerate(zip(self.windows, self.capacities)):
            if capacity and scored_slots(first, end, window) > capacity:
                raise InvalidArgumentError(
                    f"positions {first} .. {end - 1} do not fit in layer {layer}'s cache of {capacity} "
                    f"positions" + (f" (a ring of its window of {window} and a pass of at most "
                                    f"{MAX_PASS_TOKENS} tokens)" if window else ""))
        self._written = max(self._written, end)

    def _tensors(self, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s arrays as tensors sharing their memory, and the positions' slots on their
        device."""
        keys, values = (torch.as_tensor(array) for array in (self.keys[layer], self.values[layer]))
        slots = np.asarray(positions, np.int64) % self.capacities[layer]
        return keys, values, torch.as_tensor(slots, device=keys.device)

    def _oldest(self, layer: int) -> int:
        """The oldest position layer `layer` holds: all from it to the last written are there."""
        return max(self.held_from[layer], self._written - self.capacities[layer])

    def can_truncate_to(self, length: int) -> bool:
        """Whether the cache can go back to `length` positions (and hold there what it held before):
        every layer still holds the positions that a token at `length` sees and the cache had
        not lost to a context shift (a ring may have overwritten them since)."""
        length = max(0, min(length, self.length))
        if self.recurrent is not None and self.recurrent.reachable(length) != length:
            return False
        return self._rows_held(length)

    def _rows_held(self, length: int) -> bool:
        """Whether every layer with keys and values still holds what a token at `length` sees."""
        return length == 0 or all(self._holds_window(layer, length) for layer in range(len(self.keys))
                                  if self.capacities[layer])

    def reachable(self, length: int) -> int:
        """The longest length <= `length` the cache can go back to: itself where it can, else (a
        recurrent state) the nearest state kept before it, else 0."""
        length = max(0, min(length, self.length))
        if self.recurrent is not None:
            length = self.recurrent.reachable(length)
        return length if self._rows_held(length) else 0

    def checkpoint(self) -> None:
        """Keeps what going back to before the last token needs later (a recurrent state's; a KV
        cache needs nothing): a prompt's end, whose last token a chat's next turn recomputes."""
        if self.recurrent is not None:
            self.recurrent.checkpoint(self.length - 1)

    @property
    def can_shift(self) -> bool:
        """Whether `shift` can drop positions from the middle: not from a recurrent state."""
        return self.recurrent is None

    def _holds_window(self, layer: int, length: int) -> bool:
        window, held_from = self.windows[layer], self.held_from[layer]
        first_seen = max(length - window + 1, held_from) if window else held_from
        return held_from <= length and self._oldest(layer) <= first_seen

    def truncate(self, length: int) -> None:
        """Forgets positions >= length (the entries are overwritten by the next write); going back
        further than `can_truncate_to` allows is refused. At 0 the cache holds nothing, lost or not."""
        length = max(0, min(length, self.length))
        if not self._rows_held(length):
            raise InvalidArgumentError(f"the KV cache cannot go back to {length} positions: a sliding-window "
                                       f"layer's ring no longer holds the window before it")
        if self.recurrent is not None:
            self.recurrent.truncate(length)  # refuses a length it cannot go back to, naming what it holds
        self.length = length
        if length == 0:
            self.held_from = [0] * len(self.held_from)
            self._written = 0

    def keep_path(self, start: int, offsets: Sequence[int]) -> None:
        """Of the tokens written from slot `start` on (a token tree), keeps those at the given
        offsets (a root-to-node path, ascending) as positions start, start + 1, ..., and forgets
        the rest. Their keys were rotated for those positions already (a tree token's position
        is start plus its depth), so moving their rows, in whatever type, is all it takes."""
        if not self.can_truncate_to(start):
            raise InvalidArgumentError(f"a token tree from position {start}: the cache no longer holds the "
                                       f"window before it")
        if self.recurrent is not None:
            self.recurrent.keep_path(start, list(offsets))
        src = start + np.asarray(offsets, np.int64)
        dst = start + np.arange(len(src))
        moved = src != dst
        if moved.any():
            for layer in (layer for layer in range(len(self.keys)) if self.capacities[layer]):
                keys, values, s = self._tensors(layer, src[moved])
                d = self._tensors(layer, dst[moved])[2]
                write_rows(keys, values, d, *read_rows(keys, values, s))
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
        Features past rope_dim are not rotated. A key stored Hadamard-rotated is rotated back before
        it is turned and forward again before it is stored, as llama.cpp does; of a latent row only
        the rotary part is (its Hadamard blocks are its own), and the latent moves as stored. The
        moved entries were computed with the dropped tokens in view, so they approximate what a
        fresh prefill of the kept tokens would hold.
        A ring moves the positions it holds; kept positions it had overwritten stay lost
        (`held_from`).
        """
        if not self.can_shift:
            raise InvalidArgumentError("a recurrent state cannot drop tokens from its middle: prefill the "
                                       "kept tokens again")
        if not (keep >= 0 and num_dropped > 0 and keep + num_dropped <= self.length):
            raise InvalidArgumentError(f"cannot drop positions [{keep}, {keep + num_dropped}) of the "
                                       f"{self.length} the cache holds")
        for layer, (cos, sin) in enumerate(rotations):
            magnitude = np.hypot(cos, sin)
            back = [torch.from_numpy(row / magnitude)[None].double() for row in (cos, -sin)]  # [1, R/2] each
            oldest = self._oldest(layer)
            self._move_back(layer, np.arange(max(keep + num_dropped, oldest), self.length), num_dropped, back,
                            "neox" if neox else "normal")
            self.held_from[layer] = oldest if oldest <= keep else max(oldest - num_dropped, keep)
        self.length -= num_dropped
        self._written = self.length  # what a ring holds is now counted in the new positions

    def _move_back(self, layer: int, positions: np.ndarray, distance: int, back: list[torch.Tensor],
                   style: str) -> None:
        """Moves the entries at the positions (ascending) `distance` positions down, their keys
        turned back (rotary rows `back`), a chunk at a time. Where a layer's positions wrap around
        its ring, a move can land on the slot of a position still to be moved: there every chunk
        is read before any is written."""
        chunks = [positions[i:i + SHIFT_CHUNK] for i in range(0, len(positions), SHIFT_CHUNK)]
        staged: Iterator | list = (self._stored_rows(layer, chunk) for chunk in chunks)
        if self.length > self.capacities[layer]:
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
