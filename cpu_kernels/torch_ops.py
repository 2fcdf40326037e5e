"""The fused layer operations (csrc/ops.c) and attention in plain torch, on any device: what the
GPU tier computes where no Triton kernel serves, the latent cache's and a cache shift's rotary
(apply_rope), and what the C kernels are checked against.
"""

import numpy as np
import torch

from tierflow.cpu_kernels.hadamard import hadamard, rotation_sizes
from tierflow.cpu_kernels.kv_layout import check_pass_fits, decode, encode, kv_type_of, read_rows, write_rows


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def gated_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float
                             ) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps) * torch.nn.functional.silu(gate)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu_oai_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return gate / (1.0 + torch.exp(1.702 * -gate)) * (up + 1.0)


def weighted_rows_reference(rows: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights[..., None] * rows[picks]).sum(dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotates the first rope_dim features of every head.

    x [H, T, D]; cos, sin [T, R/2] with R = rope_dim <= D. "normal" rotates adjacent pairs,
    "neox" the two halves of the rotary part (each family's file says which it uses).
    """
    rope_dim = cos.shape[-1] * 2
    rotary, rest = x[..., :rope_dim], x[..., rope_dim:]
    if style == "normal":
        pairs = rotary.unflatten(-1, (rope_dim // 2, 2))  # [H, T, R/2, 2]
        first, second = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1)
        rotated = rotated.flatten(-2)
    else:
        first, second = rotary[..., : rope_dim // 2], rotary[..., rope_dim // 2 :]
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def attention_reference(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, heads: int, start: int, neox: bool,
                        parents: np.ndarray | None = None, tree_start: int | None = None, window: int = 0,
                        scale: float | None = None, softcap: float = 0.0, held_from: int = 0,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """ops.attention in torch, on any device (the GPU kernel's reference too): the same cache
    writes, in the cache's type (keys [K, C/16, I, 16], values [K, C, I]: kv_layout.py), position
    p in slot p % C, then attention over the dequantized cache; token trees, window, scale, soft
    cap, held_from and sinks alike. A quantized cache rotates as llama.cpp's (hadamard.py): the queries
    and keys after rotary embedding, the values before they are stored and the output back.
    qkv is not modified.

    Returns [T, H * D].
    """
    kv_heads, tokens, capacity = keys.shape[0], qkv.shape[0], values.shape[1]
    head_dim = qkv.shape[1] // (heads + 2 * kv_heads)
    kv = kv_type_of(keys, head_dim)
    first_slot = start if parents is None or tree_start is None else tree_start
    check_pass_fits(capacity, start, tokens, first_slot, window, held_from)
    q, k, v = qkv.float().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    style = "neox" if neox else "normal"
    q = apply_rope(q.reshape(tokens, heads, head_dim).transpose(0, 1), cos, sin, style)  # [H, T, D]
    k = apply_rope(k.reshape(tokens, kv_heads, head_dim).transpose(0, 1), cos, sin, style)  # [K, T, D]
    v = v.reshape(tokens, kv_heads, head_dim).transpose(0, 1)
    key_rotation, value_rotation = rotation_sizes(kv, head_dim)
    q, k, v = hadamard(q, key_rotation), hadamard(k, key_rotation), hadamard(v, value_rotation)
    new = torch.arange(start, start + tokens, device=keys.device)
    write_rows(keys, values, new % capacity, encode(k, kv), encode(v, kv))
    visible = visible_slots(start, tokens, parents, tree_start, window, held_from)  # [T, start + T]
    oldest = int(visible.any(axis=0).argmax()) if visible.size else 0  # a ring holds none before it
    visible = torch.from_numpy(visible[:, oldest:]).to(qkv.device)  # [T, S]
    seen = torch.arange(oldest, start + tokens, device=keys.device)
    seen_rows = read_rows(keys, values, seen % capacity)
    seen_keys, seen_values = (decode(rows, kv) for rows in seen_rows)  # [K, S, D]
    group = heads // kv_heads  # query head h uses key/value head h // group
    q = q.reshape(kv_heads, group * tokens, head_dim)
    scores = q @ seen_keys.transpose(1, 2) * (head_dim**-0.5 if scale is None else scale)  # [K, G*T, S]
    if softcap:
        scores = torch.tanh(scores * (1 / softcap)) * softcap
    scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
    out = hadamard(_softmax(scores, sinks, tokens) @ seen_values, value_rotation)  # [K, G*T, D]
    return out.reshape(heads, tokens, head_dim).transpose(0, 1).reshape(tokens, heads * head_dim)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """Softmax of scores [K, G*T, S] (query head k*G + g, token t in row g*T + t) over S, with each
    head's sink (sinks [H]) as one more logit whose probability goes to no value."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    kv_heads, rows, _ = scores.shape
    column = sinks.float().to(scores.device).reshape(kv_heads, -1, 1).repeat_interleave(tokens, dim=1)
    return torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]


def visible_slots(start: int, tokens: int, parents: np.ndarray | None, tree_start: int | None,
             window: int = 0, held_from: int = 0) -> np.ndarray:
    """[T, start + T] bool: which positions (in a tree: slots) each new token attends to. Causal,
    or for a token tree from slot tree_start: everything before the tree, and the token's ancestors; with a
    window, of those only the slots whose positions are within window - 1 of the token's
    (a tree token's position is tree_start + its depth); none before held_from."""
    positions = np.arange(start + tokens)  # each slot's
    visible = positions[None, :] <= start + np.arange(tokens)[:, None]
    if parents is not None:
        tree_start = start if tree_start is None else tree_start
        ancestry = np.eye(len(parents), dtype=bool)  # [tree token, tree token]: itself or an ancestor
        for node, parent in enumerate(parents):
            if parent >= 0:
                ancestry[node] |= ancestry[parent]
        visible[:, tree_start:] = ancestry[start - tree_start:]
        positions[tree_start:] = tree_start + ancestry.sum(axis=1) - 1  # its depth
    if window:
        visible &= positions[None, :] > positions[start:, None] - window
    return visible & (positions >= held_from)[None, :]
