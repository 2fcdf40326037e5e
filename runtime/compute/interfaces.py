"""The contracts between the decoder, the families' blocks and where weights live.

A family's block (runtime/models/) computes one layer from its `Weights` with a `LayerPass`; the
decoder (runtime/decoder/) asks a `WeightSource` for each layer's weights; offload/ implements the
sources and the `Experts` of a MoE layer; the `Kernels` of a layer's device compute it: the C
kernels (compute/cpu.py) or the GPU's (gpu_kernels/layer_kernels.py). Nothing here knows where
bytes live or which family runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from tierflow.runtime.compute.cpu import CPU_KERNELS

if TYPE_CHECKING:
    from tierflow.runtime.memory.recurrent_state import RecurrentPass
    from tierflow.runtime.models.config import ModelConfig

Activations = np.ndarray | torch.Tensor  # float32 [T, width]: numpy on the CPU, torch on a device
Linear = Callable[[Activations], Activations]  # x [T, in] -> [T, out], bias included


class Kernels(Protocol):
    """The per-layer operations on one device's activations (see cpu_kernels.ops)."""

    def take(self, x: Activations) -> Activations: ...  # x on this device (itself when there)

    def rms_norm(self, x: Activations, weight: Activations, eps: float) -> Activations: ...

    def add_rms_norm(self, residual: Activations, x: Activations, weight: Activations,
                     eps: float) -> Activations: ...  # residual += x; rms_norm(residual)

    def gated_rms_norm(self, x: Activations, weight: Activations, gate: Activations,
                       eps: float) -> Activations: ...  # rms_norm(x) * silu(gate), gate of x's shape

    def swiglu(self, gate_up: Linear, x: Activations) -> Activations: ...  # silu(gate) * up

    def linear_each(self, linears: Sequence[Linear], xs: Sequence[Activations]
                    ) -> list[Activations]: ...  # [linear(x) for each]: a MoE layer's experts at once

    def swiglu_each(self, gate_ups: Sequence[Linear], xs: Sequence[Activations]
                    ) -> list[Activations]: ...  # [swiglu(gate_up, x) for each]

    def swiglu_oai_each(self, gate_ups: Sequence[Linear], xs: Sequence[Activations]
                        ) -> list[Activations]: ...  # the same with gpt-oss's clamped SwiGLU (ops.swiglu_oai)

    def combine_experts(self, outputs: Sequence[Activations], picks: np.ndarray, weights: Activations
                        ) -> Activations: ...  # rows = the outputs' rows in turn (from any device);
    # [T, E]: each token's sum over j of weights[t, j] * rows[picks[t, j]] (picks, weights [T, k])

    def attention(self, qkv: Activations, keys: Activations, values: Activations, cos: Activations,
                  sin: Activations, heads: int, start: int, neox: bool, parents: np.ndarray | None,
                  tree_start: int | None, window: int = 0, scale: float | None = None,
                  softcap: float = 0.0, held_from: int = 0, sinks: Activations | None = None
                  ) -> Activations: ...  # sinks [H]: one more logit per query head's softmax


def concat(parts: list[Activations]) -> Activations:
    """Outputs side by side: [T, a], [T, b], ... -> [T, a + b + ...]."""
    return np.concatenate(parts, axis=-1) if isinstance(parts[0], np.ndarray) else torch.cat(parts, dim=-1)


def stack_rows(parts: list[Activations]) -> Activations:
    """Row blocks one under another: [a, W], [b, W], ... -> [a + b + ..., W] (one part: itself)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)


class ConcatLinear:
    """Linears that read the same input, as one whose output is theirs side by side."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.nbytes = sum(part.nbytes for part in parts)

    def __call__(self, x: Activations) -> Activations:
        return concat([part(x) for part in self.parts])


class Weights:
    """One layer's (or one expert's) weights, named as its family's tensor map names its fields
    (`w.qkv`, `w.attn_norm`, ...), with the kernels of the device they live on; a MoE layer's
    `experts` hands over its experts wherever they live."""

    def __init__(self, fields: dict[str, "Linear | Activations"], kernels: "Kernels | None" = None,
                 experts: "Experts | None" = None):
        self.fields = fields
        self.kernels = CPU_KERNELS if kernels is None else kernels
        self.experts = experts

    def __getattr__(self, name: str):
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(f"these weights have no field {name!r}") from None


class Experts(Protocol):
    """A MoE layer's experts, wherever they live (resident, cached, streamed: the source's business)."""

    def dropped(self, chosen: np.ndarray, weights: Activations, verifying: bool = False) -> np.ndarray | None:
        """The choices (bool [T, k]) to leave out, their weight given to the token's other experts,
        or None: none. Only where the user traded exactness for fewer bytes read (an expert tier's
        `skip_below` and `union_cap`); weights [T, k] are the router's weights of the choices;
        verifying: the pass verifies a token tree."""
        ...

    def groups(self, chosen: np.ndarray, residual: Activations, dropped: np.ndarray | None = None
               ) -> Iterator[list[tuple[int, Weights]]]:
        """Each expert in chosen (int64 [T, k]: every token's top-k) once, with its weights, in
        groups the decoder computes together, in an order the source picks: those at hand first,
        then those that arrive together (a group waits for none of the later ones). residual
        [T, E] is the stream entering the FFN: with chosen, a hint of what the next layers will
        route to. dropped: what `dropped` left out (those experts are not handed over)."""
        ...


class WeightSource(Protocol):
    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray: ...  # [T] -> new [T, E]

    def layer(self, layer_idx: int) -> Weights: ...

    def output_norm(self) -> np.ndarray: ...  # [E]

    def output(self) -> Linear: ...  # [E] -> [V]

    def rope_freq_factors(self) -> torch.Tensor | None: ...  # [rope_dim / 2]


# (layer_idx, chosen experts int64 [T, k], their router weights [T, k], the stream entering the FFN [T, E],
# the layer's weights)
RoutingHook = Callable[[int, np.ndarray, Activations, Activations, Weights], None]


@dataclass(frozen=True)
class SequencePass:
    """One sequence's share of a layer's pass: its rows of the activations and its KV cache."""

    rows: slice  # its tokens' rows in the pass's activations
    keys: Activations  # the layer's KV cache of this sequence (see KVCache)
    values: Activations
    start: int  # position of its first new token (its cache slot: start % the layer's capacity)
    parents: np.ndarray | None  # a token tree's parents (Decoder.forward)
    tree_start: int | None
    held_from: int = 0  # the oldest position the layer's cache holds (KVCache.held_from)
    recurrent: "RecurrentPass | None" = None  # a linear-attention layer's recurrence over its state


@dataclass(frozen=True)
class LayerPass:
    """What one layer of one forward pass computes with, besides its weights. A pass computes
    one or several sequences (each with its own KV cache) whose tokens are stacked: everything
    but attention treats the rows alike, and attention runs each sequence over its own cache."""

    config: ModelConfig
    layer_idx: int
    kernels: Kernels  # of the layer's device
    cos: Activations  # [T, R/2] rotary rows of the pass's tokens, on the layer's device
    sin: Activations
    sequences: tuple[SequencePass, ...]
    on_routing: RoutingHook | None = None


Block = Callable[[Activations, Weights, LayerPass], Activations]  # a family's layer: x [T, E] -> x, in place
