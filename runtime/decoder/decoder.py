"""The decoder loop: embeddings, each layer's block, the head; no placement.

Each family's block (runtime/models/) says how one layer computes; this loop runs the embeddings,
the blocks and the head. Weights come from a `WeightSource`, asked for one layer at a time, so
that where the bytes live (resident, streamed, on the GPU) is the source's business and never a
branch in here. Each layer
comes with the `Kernels` that compute it (the CPU kernels, or the GPU kernels for a layer on the
GPU tier): the hidden state moves to a layer's device as it enters it, and only it crosses.

Shape legend: T new tokens, S positions in the cache so far, H query heads, K key/value heads,
D head size, E hidden size, F feed-forward size, V vocabulary.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tierflow.cpu_kernels import ops
from tierflow.runtime.compute.cpu import CPU_KERNELS
from tierflow.runtime.compute.interfaces import (
    Block,
    LayerPass,
    RoutingHook,
    SequencePass,
    WeightSource,
    stack_rows,
)
from tierflow.runtime.decoder.rope import layer_rope_tables
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.runtime.models.config import ModelConfig


class Decoder:
    """Runs tokens through the model, appending to a KV cache: the embeddings (times the config's
    embedding scale), each layer's block (its family's, `block`) with the layer's rotary tables,
    the final norm and the output head (its logits soft-capped and divided by the logit scale where
    the config says so)."""

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
            if self.config.logit_scale != 1.0:  # llama.cpp's order: times 1 / scale, in float32
                logits = logits * (np.float32(1) / np.float32(self.config.logit_scale))
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
        # a verification's rows must be what decoding gives (a recurrent state: token by token)
        cache.begin_pass(count, item.parents, tree_start, exact=item.all_logits or item.parents is not None)
        return cls(item, start, positions, tree_start)

    def layer(self, layer_idx: int, rows: slice) -> SequencePass:
        return SequencePass(rows=rows, start=self.start, parents=self.input.parents,
                            tree_start=self.tree_start, **self.input.cache.layer_pass(layer_idx))

    def done(self) -> None:
        self.input.cache.end_pass(self.start + self.input.token_ids.shape[0])


def soft_cap(logits: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(logits / cap) in float32, in llama.cpp's order (times 1 / cap, tanh, times cap);
    the logits themselves for cap 0."""
    if not cap:
        return logits
    return np.tanh(logits * (np.float32(1) / np.float32(cap))) * np.float32(cap)


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each token of a tree given as parent indices (-1 for a root, else earlier)."""
    depths = np.zeros(len(parents), np.int64)
    for i, parent in enumerate(parents):
        depths[i] = 0 if parent < 0 else depths[parent] + 1
    return depths
