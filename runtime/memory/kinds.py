"""The kinds of memory a layer keeps for a sequence, one object per layer (ModelConfig.memory).

A family says what each of its layers keeps (its config's `memory`, or the kinds its fields
imply: a window, a latent row, a recurrent state); the KV cache allocates and serves them, and
the planner counts them, by asking the kind, never by branching on the family:

    FullCache       every position's key and value rows (the whole context, rounded to 16)
    RingCache       a sliding-window layer's ring: its window and a pass (kv_types.cache_positions)
    LatentCache     multi-head latent attention's one row per position (rotary key part + latent)
    RecurrentState  a recurrent layer's fixed-size state (linear attention, Mamba), whatever the context
    RowsAndState    a layer that attends and runs a recurrence side by side: FullCache's rows and a state
    NoMemory        nothing: a layer that sees only its own token (an FFN-only layer)

Attention rows (the first three) are held by the KV cache's rows (attention_rows.py); a kind
held otherwise names its store (`sequence_store`: the SequenceMemory of kv_cache.py that holds
every layer of that kind for one sequence). A new kind is one class here with the protocol's
members, its store, and the family that declares it (`ModelConfig.layer_kinds`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierflow.errors import ModelFileError
from tierflow.kv_types import CacheRows, KVType, cache_positions
from tierflow.runtime.memory.recurrent_state import RecurrentStates, recurrent_state_bytes
from tierflow.runtime.memory.state_shapes import StateShape

# allocate(layer_idx, shape, dtype) -> a zeroed array of the layer's memory, where it computes
Allocate = Callable[[int, tuple[int, ...], torch.dtype], Any]


class LayerMemory(Protocol):
    """What one layer keeps for one sequence between passes."""

    @property
    def window(self) -> int: ...  # the positions a token sees back (itself included); 0: the whole context

    def positions(self, context_length: int) -> int: ...  # cache slots of key/value rows; 0: none

    def num_bytes(self, context_length: int, kv: KVType) -> int: ...  # one sequence's, at most

    def pass_bytes(self, tokens: int) -> int: ...  # activations a pass of `tokens` adds to attention's

    # (layers of this kind: {index: kind}, allocate) -> what holds them for a sequence; None: the
    # KV cache's attention rows hold it
    sequence_store: Callable[[dict[int, "LayerMemory"], Allocate], Any] | None


@dataclass(frozen=True)
class FullCache:
    """Key and value rows for every position of the context."""

    rows: CacheRows
    window = 0
    sequence_store = None  # the KV cache's attention rows

    def positions(self, context_length: int) -> int:
        return cache_positions(context_length, 0)

    def num_bytes(self, context_length: int, kv: KVType) -> int:
        return self.rows.position_bytes(kv) * self.positions(context_length)

    def pass_bytes(self, tokens: int) -> int:
        return 0


@dataclass(frozen=True)
class RingCache(FullCache):
    """A sliding-window layer's rows: a ring of its window and a pass where the context is longer."""

    window: int = 0

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ModelFileError(f"a sliding window must be positive, got {self.window}")

    def positions(self, context_length: int) -> int:
        return cache_positions(context_length, self.window)


@dataclass(frozen=True)
class LatentCache(FullCache):
    """Multi-head latent attention's rows: one per position, its values a view of its keys."""

    def __post_init__(self) -> None:
        if not self.rows.latent:
            raise ModelFileError("a latent cache needs latent rows (kv_lora_rank)")


@dataclass(frozen=True)
class RecurrentState:
    """A recurrent layer's state (recurrent_state.py; Gated DeltaNet's or Mamba's, as its shape
    says: state_shapes.py): no key or value rows."""

    shape: StateShape
    window = 0

    def positions(self, context_length: int) -> int:
        return 0

    def num_bytes(self, context_length: int, kv: KVType) -> int:
        return recurrent_state_bytes(self.shape)

    def pass_bytes(self, tokens: int) -> int:
        return self.shape.pass_bytes(tokens)

    @staticmethod
    def sequence_store(layers: dict[int, "RecurrentState"], allocate: Allocate) -> RecurrentStates:
        shape = next(iter(layers.values())).shape
        return RecurrentStates(shape, layers,
                               lambda layer, dims: torch.as_tensor(allocate(layer, dims, torch.float32)))


@dataclass(frozen=True)
class RowsAndState(RecurrentState):
    """A layer with attention and a recurrent layer side by side (Falcon-H1's): every position's key
    and value rows, which the KV cache's attention rows hold, and a state, which the recurrent
    states' store holds."""

    rows: CacheRows

    def positions(self, context_length: int) -> int:
        return cache_positions(context_length, 0)

    def num_bytes(self, context_length: int, kv: KVType) -> int:
        rows = self.rows.position_bytes(kv) * self.positions(context_length)
        return rows + super().num_bytes(context_length, kv)


@dataclass(frozen=True)
class NoMemory:
    """A layer that keeps nothing between passes (Nemotron-H's FFN-only layers): no rows, no state."""

    window = 0
    sequence_store = None  # the attention rows, which give it none

    def positions(self, context_length: int) -> int:
        return 0

    def num_bytes(self, context_length: int, kv: KVType) -> int:
        return 0

    def pass_bytes(self, tokens: int) -> int:
        return 0
