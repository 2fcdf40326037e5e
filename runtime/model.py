"""The decoder: one definition of the Llama-family transformer (llama, qwen2), with no placement.

Weights come from a `WeightSource`, asked for one layer at a time, so that where the bytes live
(resident, streamed, on the GPU) is the source's business and never a branch in here. Each layer
comes with the `Kernels` that compute it (the CPU kernels, or the GPU kernels for a layer on the
GPU tier): the hidden state moves to a layer's device as it enters it, and only it crosses.

Shape legend: T new tokens, S positions in the cache so far, H query heads, K key/value heads,
D head size, E hidden size, F feed-forward size, V vocabulary.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tierflow.cpu_kernels import ops
from tierflow.runtime.config import ModelConfig
from tierflow.runtime.kv_cache import KVCache
from tierflow.runtime.rope import rope_tables

Activations = np.ndarray | torch.Tensor  # float32 [T, width]: numpy on the CPU, torch on a device
Linear = Callable[[Activations], Activations]  # x [T, in] -> [T, out], bias included


class Kernels(Protocol):
    """The per-layer operations on one device's activations (see cpu_kernels.ops)."""

    def take(self, x: Activations) -> Activations: ...  # x on this device (itself when there)

    def rms_norm(self, x: Activations, weight: Activations, eps: float) -> Activations: ...

    def add_rms_norm(self, residual: Activations, x: Activations, weight: Activations,
                     eps: float) -> Activations: ...  # residual += x; rms_norm(residual)

    def swiglu(self, gate_up: Linear, x: Activations) -> Activations: ...  # silu(gate) * up

    def attention(self, qkv: Activations, keys: Activations, values: Activations, cos: Activations,
                  sin: Activations, heads: int, start: int, neox: bool, parents: np.ndarray | None,
                  tree_start: int | None) -> Activations: ...


class CpuKernels:
    """The C extension's fused operations, on float32 numpy arrays."""

    def take(self, x: Activations) -> np.ndarray:
        return x if isinstance(x, np.ndarray) else x.cpu().numpy()

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        residual += x
        return ops.rms_norm(residual, weight, eps)

    def swiglu(self, gate_up: Linear, x: np.ndarray) -> np.ndarray:
        return ops.silu_mul(gate_up(x))

    def attention(self, qkv, keys, values, cos, sin, heads, start, neox, parents, tree_start) -> np.ndarray:
        return ops.attention(qkv, keys, values, cos, sin, heads, start, neox, parents, tree_start)


CPU_KERNELS = CpuKernels()


class DenseLinear:
    """A float32 weight [out, in] (and bias) as a Linear, computed by torch."""

    def __init__(self, weight: torch.Tensor, bias: np.ndarray | None = None):
        self.weight = weight
        self.bias = None if bias is None else torch.from_numpy(bias)
        self.nbytes = 4 * (weight.numel() + (0 if bias is None else bias.size))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return F.linear(torch.from_numpy(x), self.weight, self.bias).numpy()


class ConcatLinear:
    """Linears that read the same input, as one whose output is theirs side by side."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.nbytes = sum(part.nbytes for part in parts)

    def __call__(self, x: Activations) -> Activations:
        return _concat([part(x) for part in self.parts])


@dataclass(frozen=True)
class ExpertWeights:
    """One expert of a MoE layer: a SwiGLU FFN, computed by `kernels` on its weights' device."""

    gate_up: Linear  # [E] -> [2*F]
    down: Linear  # [F] -> [E]
    kernels: Kernels = CPU_KERNELS


class Experts(Protocol):
    """A MoE layer's experts, wherever they live (resident, cached, streamed: the source's business)."""

    def each(self, chosen: np.ndarray, residual: Activations) -> Iterator[tuple[int, ExpertWeights]]:
        """Each expert in chosen (int64 [T, k]: every token's top-k) once, with its weights, in an
        order the source picks (those at hand first, say); residual [T, E] is the stream entering
        the FFN: with chosen, a hint of what the next layers will route to."""
        ...


@dataclass(frozen=True)
class MoEWeights:
    router: Linear  # [E] -> [num_experts] logits
    experts: Experts
    shared: ExpertWeights | None = None  # qwen2moe: an expert every token uses, scaled by
    shared_gate: Linear | None = None  # sigmoid(hidden @ shared_gate) [E] -> [1]


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Projections that read the same input are one Linear each."""

    attn_norm: Activations  # [E]
    qkv: Linear  # [E] -> [H*D + 2*K*D]: queries, keys, values (with qwen2's biases)
    wo: Linear  # [H*D] -> [E]
    ffn_norm: Activations  # [E]
    gate_up: Linear | None = None  # [E] -> [2*F]: gate, then up (a dense FFN)
    down: Linear | None = None  # [F] -> [E]
    moe: MoEWeights | None = None  # instead of gate_up and down
    q_norm: Activations | None = None  # [H*D], OLMoE: RMSNorm of the queries before rotary
    k_norm: Activations | None = None  # [K*D]
    kernels: Kernels = CPU_KERNELS  # what computes this layer, on its weights' device


class WeightSource(Protocol):
    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray: ...  # [T] -> new [T, E]

    def layer(self, layer_idx: int) -> LayerWeights: ...

    def output_norm(self) -> np.ndarray: ...  # [E]

    def output(self) -> Linear: ...  # [E] -> [V]

    def rope_freq_factors(self) -> torch.Tensor | None: ...  # [rope_dim / 2]


RoutingHook = Callable[[int, np.ndarray], None]  # (layer_idx, chosen experts int64 [T, k])


class Decoder:
    """Runs tokens through the model, appending to a KV cache."""

    def __init__(self, config: ModelConfig, weights: WeightSource, max_positions: int):
        self.config = config
        self.weights = weights
        self.on_routing: RoutingHook | None = None  # told each MoE layer's routing (Engine.record_routing)
        cos, sin = rope_tables(config, max_positions, weights.rope_freq_factors())
        self.cos, self.sin = cos.numpy(), sin.numpy()

    @torch.inference_mode()
    def forward(self, token_ids: np.ndarray, cache: KVCache, all_logits: bool = False,
                parents: np.ndarray | None = None, tree_start: int | None = None) -> np.ndarray:
        """Logits [T, V] for every new token if all_logits, else [1, V] for the last one.

        token_ids [T] are placed at positions cache.length .. cache.length + T - 1. With parents
        they extend a token tree begun at cache slot tree_start (default: cache.length): parents
        (int32, one per tree token from tree_start on) holds -1 or an earlier tree token, and each
        token sits at position tree_start plus its depth, seeing only its ancestors
        (KVCache.keep_path keeps one path afterwards).
        """
        start_pos = cache.length
        if parents is None:
            positions = start_pos + np.arange(token_ids.shape[0])
        else:
            tree_start = start_pos if tree_start is None else tree_start
            positions = tree_start + tree_depths(parents)[start_pos - tree_start:]
        rotary = {}  # kernels -> the tokens' cos, sin rows on their device, moved once per pass
        x = self.weights.embedding_rows(token_ids)  # [T, E], a new tensor: updated in place below
        eps = self.config.rms_norm_eps
        for layer_idx in range(self.config.num_layers):
            w = self.weights.layer(layer_idx)
            kernels = w.kernels
            x = kernels.take(x)
            if kernels not in rotary:
                rotary[kernels] = kernels.take(self.cos[positions]), kernels.take(self.sin[positions])
            attended = self._attention(kernels.rms_norm(x, w.attn_norm, eps), w, layer_idx, cache, start_pos,
                                       *rotary[kernels], parents, tree_start)
            h = kernels.add_rms_norm(x, attended, w.ffn_norm, eps)  # x: the residual stream entering the FFN
            x += self._ffn(h, w, x, layer_idx)
        cache.length = start_pos + token_ids.shape[0]
        x = CPU_KERNELS.take(x)
        if not all_logits:
            x = x[-1:]
        x = ops.rms_norm(x, self.weights.output_norm(), self.config.rms_norm_eps)
        return self.weights.output()(x)  # [T or 1, V]

    def _attention(self, x, w: LayerWeights, layer_idx, cache, start_pos, cos, sin, parents,
                   tree_start) -> Activations:
        cfg = self.config
        qkv = w.qkv(x)
        if w.q_norm is not None:
            qkv = self._norm_queries_and_keys(qkv, w)
        out = w.kernels.attention(qkv, cache.keys[layer_idx], cache.values[layer_idx], cos, sin,
                                  cfg.num_heads, start_pos, cfg.rope_style == "neox", parents, tree_start)
        return w.wo(out)  # [T, E]

    def _norm_queries_and_keys(self, qkv: Activations, w: LayerWeights) -> Activations:
        cfg, kernels = self.config, w.kernels
        q_end = cfg.num_heads * cfg.head_dim
        k_end = q_end + cfg.num_kv_heads * cfg.head_dim
        q, k, v = (_contiguous(qkv[:, a:b]) for a, b in ((0, q_end), (q_end, k_end), (k_end, qkv.shape[1])))
        eps = cfg.rms_norm_eps
        return _concat([kernels.rms_norm(q, w.q_norm, eps), kernels.rms_norm(k, w.k_norm, eps), v])

    def _ffn(self, h: Activations, w: LayerWeights, residual: Activations, layer_idx: int) -> Activations:
        if w.moe is None:
            return w.down(w.kernels.swiglu(w.gate_up, h))
        return self._moe(h, w.moe, w.kernels, residual, layer_idx)

    def _moe(self, h: Activations, moe: MoEWeights, kernels: Kernels, residual: Activations,
             layer_idx: int) -> Activations:
        """Each token's top-k experts by the router's softmax, their outputs summed with those
        probabilities as weights (rescaled to sum to 1 where the architecture does), plus the
        gated shared expert. Each expert computes all the tokens routed to it at once."""
        hidden = torch.as_tensor(h)  # [T, E], shares memory
        probs = torch.softmax(torch.as_tensor(moe.router(h)).float(), dim=-1)  # [T, num_experts]
        weights, chosen = probs.topk(self.config.experts_used, dim=-1)  # [T, k]
        if self.config.renormalize_expert_weights:
            weights /= weights.sum(dim=-1, keepdim=True)
        chosen_ids = chosen.cpu().numpy()
        if self.on_routing is not None:
            self.on_routing(layer_idx, chosen_ids)
        outputs = {}  # expert id -> its rows, their top-k slots, its output (on its device until all ran)
        for expert_id, expert in moe.experts.each(chosen_ids, residual):
            rows, slots = (chosen == expert_id).nonzero(as_tuple=True)
            outputs[expert_id] = rows, slots, _expert_ffn(expert, hidden[rows])
        out = torch.zeros_like(hidden)
        for expert_id in sorted(outputs):  # the same sum in whatever order the experts ran
            rows, slots, y = outputs[expert_id]
            out.index_add_(0, rows, weights[rows, slots, None] * torch.as_tensor(y).to(out.device))
        if moe.shared is not None:
            gate = torch.sigmoid(torch.as_tensor(moe.shared_gate(h)))  # [T, 1]
            out += gate * torch.as_tensor(_expert_ffn(moe.shared, hidden)).to(out.device)
        return kernels.take(out)


def _expert_ffn(expert: ExpertWeights, x: torch.Tensor) -> Activations:
    x = expert.kernels.take(x)
    return expert.down(expert.kernels.swiglu(expert.gate_up, x))


def _contiguous(x: Activations) -> Activations:
    return np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x.contiguous()


def _concat(parts: list[Activations]) -> Activations:
    return np.concatenate(parts, axis=-1) if isinstance(parts[0], np.ndarray) else torch.cat(parts, dim=-1)


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each token of a tree given as parent indices (-1 for a root, else earlier)."""
    depths = np.zeros(len(parents), np.int64)
    for i, parent in enumerate(parents):
        depths[i] = 0 if parent < 0 else depths[parent] + 1
    return depths
