"""The decoder loop, the weights it computes with and the kernels that compute them: no placement.

Each family's block (runtime/models/) says how one layer computes; this loop runs the embeddings,
the blocks and the head. Weights come from a `WeightSource`, asked for one layer at a time, so
that where the bytes live (resident, streamed, on the GPU) is the source's business and never a
branch in here. Each layer
comes with the `Kernels` that compute it (the CPU kernels, or the GPU kernels for a layer on the
GPU tier): the hidden state moves to a layer's device as it enters it, and only it crosses.

Shape legend: T new tokens, S positions in the cache so far, H query heads, K key/value heads,
D head size, E hidden size, F feed-forward size, V vocabulary.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tierflow.cpu_kernels import ops
from tierflow.cpu_kernels.linear import linear_each
from tierflow.runtime.config import ModelConfig
from tierflow.runtime.kv_cache import KVCache
from tierflow.runtime.recurrent_state import RecurrentPass
from tierflow.runtime.rope import layer_rope_tables

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


class CpuKernels:
    """The C extension's fused operations, on float32 numpy arrays."""

    def take(self, x: Activations) -> np.ndarray:
        return x if isinstance(x, np.ndarray) else x.cpu().numpy()

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        residual += x
        return ops.rms_norm(residual, weight, eps)

    def gated_rms_norm(self, x: np.ndarray, weight: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
        return ops.gated_rms_norm(np.ascontiguousarray(x), weight, np.ascontiguousarray(gate), eps)

    def swiglu(self, gate_up: Linear, x: np.ndarray) -> np.ndarray:
        return ops.silu_mul(gate_up(x))

    def linear_each(self, linears: Sequence[Linear], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        return linear_each(linears, xs)

    def swiglu_each(self, gate_ups: Sequence[Linear], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [ops.silu_mul(h) for h in linear_each(gate_ups, xs)]

    def swiglu_oai_each(self, gate_ups: Sequence[Linear], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [ops.swiglu_oai(h) for h in linear_each(gate_ups, xs)]

    def combine_experts(self, outputs: Sequence[Activations], picks: np.ndarray, weights: Activations
                        ) -> np.ndarray:
        rows = self.take(outputs[0]) if len(outputs) == 1 else np.concatenate([self.take(y) for y in outputs])
        return ops.weighted_rows(rows, picks, np.ascontiguousarray(self.take(weights), np.float32))

    def attention(self, qkv, keys, values, cos, sin, heads, start, neox, parents, tree_start, window=0,
                  scale=None, softcap=0.0, held_from=0, sinks=None) -> np.ndarray:
        return ops.attention(qkv, keys, values, cos, sin, heads, start, neox, parents, tree_start, window,
                             scale, softcap, held_from, sinks)


CPU_KERNELS = CpuKernels()


DENSE_KERNEL_TOKENS = 16  # DenseLinear computes up to this many rows in the C kernels, more in torch


class DenseLinear:
    """A float32 weight [out, in] (and bias) as a Linear: a few tokens (decode steps, small verify
    passes) by the C kernels' dense_matmul, on their threads and with the bits of one token at a time,
    larger batches by torch's GEMM."""

    def __init__(self, weight: torch.Tensor, bias: np.ndarray | None = None):
        self.weight = weight
        self.bias = bias
        self.nbytes = 4 * (weight.numel() + (0 if bias is None else bias.size))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] <= DENSE_KERNEL_TOKENS:
            return ops.dense_matmul(np.ascontiguousarray(x), self.weight.numpy(), self.bias)
        bias = None if self.bias is None else torch.from_numpy(self.bias)
        return F.linear(torch.from_numpy(x), self.weight, bias).numpy()


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

    def groups(self, chosen: np.ndarray, residual: Activations) -> Iterator[list[tuple[int, Weights]]]:
        """Each expert in chosen (int64 [T, k]: every token's top-k) once, with its weights, in
        groups the decoder computes together, in an order the source picks: those at hand first,
        then those that arrive together (a group waits for none of the later ones). residual
        [T, E] is the stream entering the FFN: with chosen, a hint of what the next layers will
        route to."""
        ...


class WeightSource(Protocol):
    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray: ...  # [T] -> new [T, E]

    def layer(self, layer_idx: int) -> Weights: ...

    def output_norm(self) -> np.ndarray: ...  # [E]

    def output(self) -> Linear: ...  # [E] -> [V]

    def rope_freq_factors(self) -> torch.Tensor | None: ...  # [rope_dim / 2]


# (layer_idx, chosen experts int64 [T, k], the stream entering the FFN [T, E], the layer's weights)
RoutingHook = Callable[[int, np.ndarray, Activations, Weights], None]


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


class Decoder:
    """Runs tokens through the model, appending to a KV cache: the embeddings (times the config's
    embedding scale), each layer's block (its family's, `block`) with the layer's rotary tables,
    the final norm and the output head (its logits soft-capped where the config says so)."""

    def __init__(self, config: ModelConfig, block: Block, weights: WeightSource, max_positions: int):
        self.config = config
        self.block = block
        self.weights = weights
        self.on_routing: RoutingHook | None = None  # told each MoE layer's routing (Engine.record_routing)
        tables = layer_rope_tables(config, max_positions, weights.rope_freq_factors())
        self.rotary = [(cos.numpy(), sin.numpy()) for cos, sin in tables]  # per layer, shared arrays

    def forward(self, token_ids: np.ndarray, cache: KVCache, all_logits: bool = False,
                parents: np.ndarray | None = None, tree_start: int | None = None,
                head: bool = True) -> np.ndarray:
        """Logits [T, V] for every new token if all_logits, else [1, V] for the last one; with
        head False, the final-normed hidden states [T, E] of every new token instead (what
        embeddings pool: the output head, the largest matmul, is skipped).

        token_ids [T] are placed at positions cache.length .. cache.length + T - 1. With parents
        they extend a token tree begun at cache slot tree_start (default: cache.length): parents
        (int32, one per tree token from tree_start on) holds -1 or an earlier tree token, and each
        token sits at position tree_start plus its depth, seeing only its ancestors
        (KVCache.keep_path keeps one path afterwards).
        """
        return self.forward_batch([SequenceInput(token_ids, cache, all_logits, parents, tree_start, head)])[0]

    @torch.inference_mode()
    def forward_batch(self, inputs: "list[SequenceInput]") -> list[np.ndarray]:
        """Several sequences in one pass over the weights, each on its own KV cache: their tokens
        go through every layer together (one read of each weight for all of them) and each row is
        computed as it would be alone, bit for bit. Returns each sequence's logits as forward does."""
        placed = [_Placed.of(item) for item in inputs]
        positions = np.concatenate([item.positions for item in placed])
        bounds = np.cumsum([0] + [len(item.input.token_ids) for item in placed])
        rows = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        rotary = {}  # (kernels, cos table) -> the tokens' cos, sin rows on that device, moved once per pass
        x = stack_rows([self._first_rows(item) for item in inputs])  # [T, E]
        for layer_idx in range(self.config.num_layers):
            w = self.weights.layer(layer_idx)
            kernels, (cos, sin) = w.kernels, self.rotary[layer_idx]
            x = kernels.take(x)
            if (kernels, id(cos)) not in rotary:
                rotary[kernels, id(cos)] = kernels.take(cos[positions]), kernels.take(sin[positions])
            sequences = tuple(item.layer(layer_idx, span) for item, span in zip(placed, rows))
            step = LayerPass(self.config, layer_idx, kernels, *rotary[kernels, id(cos)], sequences,
                             self.on_routing)
            x = self.block(x, w, step)
        x = CPU_KERNELS.take(x)
        for item, span in zip(inputs, rows):
            if item.on_hidden is not None:
                item.on_hidden(ops.rms_norm(x[span], self.weights.output_norm(), self.config.rms_norm_eps))
        wanted = [span if item.all_logits or not item.head else slice(span.stop - 1, span.stop)
                  for item, span in zip(inputs, rows)]
        for item in placed:
            item.done()
        x = x[wanted[0]] if len(wanted) == 1 else np.concatenate([x[span] for span in wanted])
        x = ops.rms_norm(x, self.weights.output_norm(), self.config.rms_norm_eps)  # [rows wanted, E]
        counts = np.cumsum([0] + [span.stop - span.start for span in wanted])
        outputs = [x[a:b] for a, b in zip(counts[:-1], counts[1:])]
        heads = [i for i, item in enumerate(inputs) if item.head]
        if heads:  # one matmul of the output head for every sequence that wants logits
            logits = self.weights.output()(stack_rows([outputs[i] for i in heads]))
            logits = soft_cap(logits, self.config.final_logit_softcap)
            ends = np.cumsum([0] + [outputs[i].shape[0] for i in heads])
            for i, a, b in zip(heads, ends[:-1], ends[1:]):
                outputs[i] = logits[a:b]
        return outputs

    def _first_rows(self, item: "SequenceInput") -> np.ndarray:
        """What the first layer reads for a sequence: its given rows, or its tokens' embeddings
        (times the config's scale)."""
        if item.embeddings is not None:
            return item.embeddings
        x = self.weights.embedding_rows(item.token_ids)
        if self.config.embedding_scale != 1.0:
            x *= np.float32(self.config.embedding_scale)
        return x


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's tokens for a pass and the KV cache they extend (see Decoder.forward)."""

    token_ids: np.ndarray  # int64 [T]
    cache: KVCache
    all_logits: bool = False
    parents: np.ndarray | None = None
    tree_start: int | None = None
    head: bool = True  # False: the final-normed hidden states of every token, not logits
    embeddings: np.ndarray | None = None  # [T, E]: the rows the first layer reads, for the tokens' own
    on_hidden: Callable[[np.ndarray], None] | None = None  # told the final-normed hidden states [T, E]


@dataclass(frozen=True)
class _Placed:
    """A sequence's input with its tokens' positions, its cache told what the pass writes."""

    input: SequenceInput
    start: int  # the cache's length before the pass
    positions: np.ndarray
    tree_start: int | None

    @classmethod
    def of(cls, item: SequenceInput) -> "_Placed":
        cache, count = item.cache, item.token_ids.shape[0]
        start = cache.length
        if item.parents is None:
            positions, tree_start = start + np.arange(count), None
        else:
            tree_start = start if item.tree_start is None else item.tree_start
            positions = tree_start + tree_depths(item.parents)[start - tree_start:]
        cache.will_write(start if item.parents is None else tree_start, start + count)
        if cache.recurrent is not None:
            # a verification's rows must be what decoding gives: token by token, as decoding runs
            cache.recurrent.begin_pass(start, count, item.parents, tree_start,
                                       exact=item.all_logits or item.parents is not None)
        return cls(item, start, positions, tree_start)

    def layer(self, layer_idx: int, rows: slice) -> SequencePass:
        cache = self.input.cache
        states = cache.recurrent
        recurrent = states.layer(layer_idx) if states is not None and layer_idx in states.layers else None
        return SequencePass(rows, cache.keys[layer_idx], cache.values[layer_idx], self.start,
                            self.input.parents, self.tree_start, cache.held_from[layer_idx], recurrent)

    def done(self) -> None:
        cache = self.input.cache
        cache.length = self.start + self.input.token_ids.shape[0]
        if cache.recurrent is not None:
            cache.recurrent.end_pass()


def soft_cap(logits: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(logits / cap) in float32, in llama.cpp's order (times 1 / cap, tanh, times cap);
    the logits themselves for cap 0."""
    if not cap:
        return logits
    return np.tanh(logits * (np.float32(1) / np.float32(cap))) * np.float32(cap)


def concat(parts: list[Activations]) -> Activations:
    """Outputs side by side: [T, a], [T, b], ... -> [T, a + b + ...]."""
    return np.concatenate(parts, axis=-1) if isinstance(parts[0], np.ndarray) else torch.cat(parts, dim=-1)


def stack_rows(parts: list[Activations]) -> Activations:
    """Row blocks one under another: [a, W], [b, W], ... -> [a + b + ..., W] (one part: itself)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each token of a tree given as parent indices (-1 for a root, else earlier)."""
    depths = np.zeros(len(parents), np.int64)
    for i, parent in enumerate(parents):
        depths[i] = 0 if parent < 0 else depths[parent] + 1
    return depths
