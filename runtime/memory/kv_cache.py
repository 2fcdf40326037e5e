"""A sequence's memory between passes: each layer's kind (runtime/memory/kinds.py) allocated, the
attention layers' rows (attention_rows.py) and the linear-attention layers' recurrent states
(recurrent_state.py), behind one protocol that the decoder and the token loop use without asking
which kinds a model has."""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from tierflow.errors import InvalidArgumentError
from tierflow.kv_types import KV_TYPES, KVType
from tierflow.runtime.memory.attention_rows import AttentionRows, allocate_in_ram
from tierflow.runtime.memory.kinds import Allocate, LayerMemory

if TYPE_CHECKING:
    from tierflow.runtime.models.config import ModelConfig


class SequenceMemory(Protocol):
    """What one kind of memory does for a sequence (the KV cache holds one of each kind it has)."""

    num_bytes: int
    can_shift: bool  # whether positions can be dropped from the middle (a context shift)

    def begin_pass(self, start: int, count: int, parents: np.ndarray | None, tree_start: int | None,
                   exact: bool) -> None: ...  # told before a pass (Decoder.forward's arguments)

    def layer_pass(self, layer: int) -> dict: ...  # the layer's share of a pass: SequencePass's fields

    def end_pass(self) -> None: ...

    def reachable(self, length: int) -> int: ...  # the longest length <= length it can go back to

    def truncate(self, length: int) -> None: ...  # goes back to `length` (one reachable gives)

    def keep_path(self, start: int, offsets: list[int]) -> None: ...  # a token tree's kept path

    def checkpoint(self, length: int) -> None: ...  # keeps what going back to `length` needs later


class KVCache:
    """Every layer's memory of one sequence, filled up to `length` positions (the same for every
    layer): the attention layers' key and value rows (`rows`: full, ring or latent, in one of
    llama.cpp's cache types) and, where the model has linear-attention layers, their recurrent
    states. `allocate` gives a layer's zeroed arrays: by default numpy, in RAM; a
    layer computed on the GPU keeps its memory there (offload.tiers.tiered.TieredWeights.allocate_cache).
    The cache names no kind: each layer's comes from the config (`ModelConfig.memory`), and a kind the
    attention rows do not hold brings its own store (kinds.py `sequence_store`).

    Going back (prefix reuse, rejected guesses, a tree's kept path) goes as far as every kind can:
    a ring only while it holds the window before the new end, a recurrent state to a checkpoint or
    a length its records reach.
    """

    def __init__(self, config: "ModelConfig", context_length: int, allocate: Allocate | None = None,
                 kv_type: KVType | None = None):
        kinds = config.memory
        allocate = allocate or allocate_in_ram
        self.kv_type = KV_TYPES["f32"] if kv_type is None else kv_type
        self.rows = AttentionRows(kinds, config.cache_rows, context_length, allocate, self.kv_type)
        by_kind: dict[type, dict[int, LayerMemory]] = {}
        for layer, kind in enumerate(kinds):
            by_kind.setdefault(type(kind), {})[layer] = kind
        # the rows, then what holds each other kind (the linear-attention layers' recurrent states)
        self.memories: list[SequenceMemory] = [self.rows] + [
            kind.sequence_store(layers, allocate) for kind, layers in by_kind.items() if kind.sequence_store]
        self.context_length = context_length
        self.length = 0  # positions holding valid entries, the same for every layer

    # the attention rows, as the kernels, the shift and the tests read them
    keys = property(lambda self: self.rows.keys)
    values = property(lambda self: self.rows.values)
    capacities = property(lambda self: self.rows.capacities)
    held_from = property(lambda self: self.rows.held_from)

    def read(self, layer: int, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s (keys, values) at the positions (ones it holds), each float32 [K, n, D],
        dequantized and rotated back."""
        return self.rows.read(layer, positions)

    def write(self, layer: int, positions: Sequence[int] | np.ndarray, keys: np.ndarray | torch.Tensor,
              values: np.ndarray | torch.Tensor) -> None:
        """Stores keys and values [K, n, D] (float32) at the positions of layer `layer`, in the
        cache's type (rotated and quantized as llama.cpp does)."""
        self.rows.write(layer, positions, keys, values)

    @property
    def num_bytes(self) -> int:
        return sum(memory.num_bytes for memory in self.memories)

    # -- a pass --------------------------------------------------------------------------------

    def begin_pass(self, count: int, parents: np.ndarray | None, tree_start: int | None, exact: bool) -> int:
        """Tells every kind of memory that a pass of `count` tokens follows the `length` held (a
        token tree's from slot tree_start); each refuses, before anything is written, one it cannot
        take. An exact pass (verification) must give what decoding gives. Returns its start."""
        start = self.length
        for memory in self.memories:
            memory.begin_pass(start, count, parents, tree_start, exact)
        return start

    def layer_pass(self, layer: int) -> dict:
        """What layer `layer` computes the current pass with: SequencePass's fields of each kind."""
        fields = {}
        for memory in self.memories:
            fields.update(memory.layer_pass(layer))
        return fields

    def end_pass(self, length: int) -> None:
        self.length = length
        for memory in self.memories:
            memory.end_pass()

    # -- going back ----------------------------------------------------------------------------

    def reachable(self, length: int) -> int:
        """The longest length <= `length` the cache can go back to: itself where every kind can,
        else the longest all of them reach (a recurrent state's nearest checkpoint), else 0."""
        length = max(0, min(length, self.length))
        while True:
            reached = length
            for memory in self.memories:
                reached = memory.reachable(reached)
            if reached == length:
                return length
            length = reached

    def can_truncate_to(self, length: int) -> bool:
        """Whether the cache can go back to `length` positions (and hold there what it held before)."""
        length = max(0, min(length, self.length))
        return all(memory.reachable(length) == length for memory in self.memories)

    def truncate(self, length: int) -> None:
        """Forgets positions >= length (the entries are overwritten by the next write); going back
        further than `can_truncate_to` allows is refused, naming what cannot. At 0 the cache holds
        nothing, lost or not."""
        length = max(0, min(length, self.length))
        for memory in self.memories:
            memory.truncate(length)
        self.length = length

    def keep_path(self, start: int, offsets: Sequence[int]) -> None:
        """Of the tokens written from slot `start` on (a token tree), keeps those at the given
        offsets (a root-to-node path, ascending) as positions start, start + 1, ..., and forgets
        the rest."""
        if not self.can_truncate_to(start):
            raise InvalidArgumentError(f"a token tree from position {start}: the cache no longer holds the "
                                       f"window before it")
        for memory in self.memories:
            memory.keep_path(start, list(offsets))
        self.length = start + len(offsets)

    def checkpoint(self) -> None:
        """Keeps what going back to before the last token needs later: a prompt's end, whose last
        token a chat's next turn recomputes."""
        for memory in self.memories:
            memory.checkpoint(self.length - 1)

    # -- a context shift -----------------------------------------------------------------------

    @property
    def can_shift(self) -> bool:
        """Whether `shift` can drop positions from the middle: not from a recurrent state."""
        return all(memory.can_shift for memory in self.memories)

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
        self.rows.shift(self.length, keep, num_dropped, rotations, neox)
        self.length -= num_dropped
