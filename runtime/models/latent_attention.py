"""Multi-head latent attention (DeepSeek-V2/V3's MLA) in its absorbed form, as llama.cpp's
deepseek2 graph computes it, in torch on the layer's device.

Keys and values are compressed into one latent per position (`attn_kv_a_mqa`: the latent and a
rotary key part shared by all heads); the cache holds that position's row [rotated key part,
normed latent] once, for every head (ModelConfig.cache_rows). Each head's query is split into an
unrotated part, absorbed into the latent space through `attn_k_b`, and a rotary part; its scores
are then one dot product with the cached row, and the attention's output, in latent space, goes
through `attn_v_b` per head before `attn_output`. The values are the latent part of the same
cached rows: nothing is stored twice, and no head's full key or value is ever stored.

A quantized cache (q8_0, q4_0) holds the rows Walsh-Hadamard rotated (cpu_kernels/hadamard.py,
`cache_rotation_sizes`): the queries are rotated alike, so the scores are unchanged, and the
output, a weighted sum of rotated latents, is rotated back before attn_v_b.

Shape legend: T new tokens, S cache slots seen, H heads, N unrotated query part, R rotary part
(rope_dim), L latent (kv_lora_rank), V each head's value size, E hidden size.
"""

import numpy as np
import torch

from tierflow.cpu_kernels.hadamard import cache_rotation_sizes, hadamard
from tierflow.cpu_kernels.kv_layout import check_pass_fits, decode, encode, kv_type_of, read_rows, write_rows
from tierflow.cpu_kernels.torch_ops import apply_rope, visible_slots
from tierflow.runtime.compute.interfaces import Activations, LayerPass, SequencePass, Weights

QUERY_CHUNK = 64  # new tokens scored at a time: the scores of a pass are at most H x 64 x S floats


def latent_attention(p: LayerPass, w: Weights, x: Activations) -> Activations:
    """Causal self-attention through the latent cache: x [T, E] -> [T, E]."""
    cfg, kernels = p.config, p.kernels
    latent_width, style = cfg.kv_lora_rank, cfg.rope_style
    cos, sin = torch.as_tensor(p.cos), torch.as_tensor(p.sin)
    compressed = torch.as_tensor(w.kv_a(x))  # [T, L + R]
    latent = torch.as_tensor(kernels.rms_norm(kernels.take(compressed[:, :latent_width].contiguous()),
                                              w.kv_a_norm, cfg.rms_norm_eps))  # [T, L]
    key_rope = apply_rope(compressed[None, :, latent_width:], cos, sin, style)[0]  # [T, R]
    rows = torch.cat([key_rope, latent], dim=-1)  # [T, R + L]: what the cache holds
    rotation = cache_rotation_sizes(kv_type_of(p.sequences[0].keys, rows.shape[1]), cfg.cache_rows)[0]
    queries = hadamard(_absorbed_queries(p, w, x, cos, sin), rotation)  # [H, T, R + L]
    rows = hadamard(rows, rotation)  # as stored (0: no rotation)
    out = torch.cat([_attend(p, s, queries[:, s.rows], _store_and_read(s, rows[s.rows]))  # [S, R + L] seen
                     for s in p.sequences], dim=1)
    out = hadamard(out, rotation)  # [H, T, L]
    value_b = torch.as_tensor(w.v_b).view(cfg.num_heads, -1, latent_width)  # [H, V, L]
    heads_out = torch.bmm(out, value_b.transpose(1, 2))  # [H, T, V]
    return w.wo(kernels.take(heads_out.transpose(0, 1).reshape(x.shape[0], -1).contiguous()))


def _absorbed_queries(p: LayerPass, w: Weights, x: Activations, cos: torch.Tensor, sin: torch.Tensor
                      ) -> torch.Tensor:
    """Each head's query in the cache rows' space: [rotated rotary part, unrotated part through
    attn_k_b] -> [H, T, R + L]."""
    cfg, kernels = p.config, p.kernels
    if cfg.q_lora_rank:
        q = w.q_b(kernels.rms_norm(w.q_a(x), w.q_a_norm, cfg.rms_norm_eps))
    else:
        q = w.q(x)
    unrotated = cfg.head_dim - cfg.rope_dim
    q = torch.as_tensor(q).view(x.shape[0], cfg.num_heads, cfg.head_dim).transpose(0, 1)  # [H, T, N + R]
    q_rope = apply_rope(q[..., unrotated:], cos, sin, cfg.rope_style)  # [H, T, R]
    key_b = torch.as_tensor(w.k_b).view(cfg.num_heads, cfg.kv_lora_rank, unrotated)  # [H, L, N]
    q_latent = torch.bmm(q[..., :unrotated], key_b.transpose(1, 2))  # [H, T, L]
    return torch.cat([q_rope, q_latent], dim=-1)


def _store_and_read(s: SequencePass, rows: torch.Tensor) -> torch.Tensor:
    """Writes the new tokens' rows (rotated where the type is) at their slots, then reads back
    (dequantized) every slot from held_from to the pass's last: [S, R + L]."""
    keys, values = torch.as_tensor(s.keys), torch.as_tensor(s.values)  # [1, C/16, R + L, 16], [1, C, 0]
    capacity, tokens = values.shape[1], rows.shape[0]
    kv = kv_type_of(keys, rows.shape[1])
    first_slot = s.start if s.parents is None or s.tree_start is None else s.tree_start
    check_pass_fits(capacity, s.start, tokens, first_slot, 0, s.held_from)
    new = torch.arange(s.start, s.start + tokens, device=keys.device) % capacity
    write_rows(keys, values, new, encode(rows[None].to(keys.device), kv), values[:, new])
    seen = torch.arange(s.held_from, s.start + tokens, device=keys.device) % capacity
    return decode(read_rows(keys, values, seen)[0][0], kv).to(rows.device)


def _attend(p: LayerPass, s: SequencePass, queries: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one sequence's queries [H, T, R + L] over the rows it has seen [S, R + L],
    whose latent part are the values: [H, T, L]. Scores are made QUERY_CHUNK tokens at a time."""
    cfg, tokens = p.config, queries.shape[1]
    visible = visible_slots(s.start, tokens, s.parents, s.tree_start, 0, s.held_from)[:, s.held_from:]
    mask = torch.from_numpy(np.ascontiguousarray(visible)).to(queries.device)  # [T, S]
    values = seen[:, cfg.rope_dim:]  # [S, L]
    outputs = []
    for first in range(0, tokens, QUERY_CHUNK):
        chunk = slice(first, first + QUERY_CHUNK)
        scores = queries[:, chunk] @ seen.T * cfg.query_scale  # [H, t, S]
        scores = scores.masked_fill(~mask[chunk], float("-inf"))
        outputs.append(torch.softmax(scores, dim=-1) @ values)
    return torch.cat(outputs, dim=1)
