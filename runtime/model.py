"""The decoder: one definition of the Llama-family transformer (llama, qwen2), with no placement.

Weights come from a `WeightSource`, asked for one layer at a time, so that where the bytes live
(resident, streamed, on the GPU) is the source's business and never a branch in here.

Shape legend: T new tokens, S positions in the cache so far, H query heads, K key/value heads,
D head size, E hidden size, F feed-forward size, V vocabulary.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from tierflow.runtime.config import ModelConfig
from tierflow.runtime.kv_cache import KVCache
from tierflow.runtime.rope import apply_rope, rope_tables


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Matrices are [out, in]; biases exist only for qwen2."""

    attn_norm: torch.Tensor  # [E]
    wq: torch.Tensor  # [H*D, E]
    wk: torch.Tensor  # [K*D, E]
    wv: torch.Tensor  # [K*D, E]
    wo: torch.Tensor  # [E, H*D]
    ffn_norm: torch.Tensor  # [E]
    w_gate: torch.Tensor  # [F, E]
    w_up: torch.Tensor  # [F, E]
    w_down: torch.Tensor  # [E, F]
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None


class WeightSource(Protocol):
    def embedding_rows(self, token_ids: torch.Tensor) -> torch.Tensor: ...  # [T] -> [T, E]

    def layer(self, layer_idx: int) -> LayerWeights: ...

    def output_norm(self) -> torch.Tensor: ...  # [E]

    def output(self) -> torch.Tensor: ...  # [V, E]

    def rope_freq_factors(self) -> torch.Tensor | None: ...  # [rope_dim / 2]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Decoder:
    """Runs tokens through the model, appending to a KV cache."""

    def __init__(self, config: ModelConfig, weights: WeightSource, max_positions: int):
        self.config = config
        self.weights = weights
        self.cos, self.sin = rope_tables(config, max_positions, weights.rope_freq_factors())

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Logits [T, V] for every new token if all_logits, else [1, V] for the last one.

        token_ids [T] are placed at positions cache.length .. cache.length + T - 1.
        """
        start_pos = cache.length
        positions = slice(start_pos, start_pos + token_ids.shape[0])
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.weights.embedding_rows(token_ids)  # [T, E]
        for layer_idx in range(self.config.num_layers):
            w = self.weights.layer(layer_idx)
            x = x + self._attention(rms_norm(x, w.attn_norm, self.config.rms_norm_eps), w,
                                    layer_idx, cache, start_pos, cos, sin)
            x = x + self._feed_forward(rms_norm(x, w.ffn_norm, self.config.rms_norm_eps), w)
        cache.length = start_pos + token_ids.shape[0]
        if not all_logits:
            x = x[-1:]
        x = rms_norm(x, self.weights.output_norm(), self.config.rms_norm_eps)
        return F.linear(x, self.weights.output())  # [T or 1, V]

    def _attention(self, x, w: LayerWeights, layer_idx, cache, start_pos, cos, sin) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        q = F.linear(x, w.wq, w.bq).view(num_tokens, cfg.num_heads, cfg.head_dim).transpose(0, 1)
        k = F.linear(x, w.wk, w.bk).view(num_tokens, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        v = F.linear(x, w.wv, w.bv).view(num_tokens, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        q = apply_rope(q, cos, sin, cfg.rope_style)  # [H, T, D]
        k = apply_rope(k, cos, sin, cfg.rope_style)  # [K, T, D]
        keys, values = cache.write(layer_idx, start_pos, k, v)  # [K, S, D]
        # The G = H / K query heads that share a key/value head attend as one batch of G*T rows,
        # so the cached keys and values are never copied per query head. Query head h uses
        # key/value head h // G, as in llama.cpp.
        group = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(cfg.num_kv_heads, group * num_tokens, cfg.head_dim)  # [K, G*T, D]
        scores = (q @ keys.transpose(1, 2)) * cfg.head_dim**-0.5  # [K, G*T, S]
        if num_tokens > 1:
            # Token i (at position start_pos + i) sees cache positions 0 .. start_pos + i.
            positions = torch.arange(keys.shape[1])
            visible = positions[None, :] <= (start_pos + torch.arange(num_tokens))[:, None]  # [T, S]
            scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values  # [K, G*T, D]
        out = out.reshape(cfg.num_heads, num_tokens, cfg.head_dim).transpose(0, 1)  # [T, H, D]
        return F.linear(out.reshape(num_tokens, -1), w.wo)

    @staticmethod
    def _feed_forward(x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, w.w_gate)) * F.linear(x, w.w_up), w.w_down)
