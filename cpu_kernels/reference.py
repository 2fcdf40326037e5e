"""References of the C kernels: the quantized matmuls in numpy, the fused layer ops in torch.

`matmul_reference` reproduces every step of a kernel (how activations become int8 tables or
int8 codes, which integers are summed per group, or per super block on two-level scales) from the
packed bytes, in float64 for the final sums, so a kernel must match it to float32 rounding.
`matmul_exact` is the product with the dequantized weights and unquantized activations: the gap
between the two is the kernels' one approximation, the int8 quantization of activations (as in
ggml's Q8 and Q8_K dot products).
"""

import numpy as np
import torch

from tierflow.cpu_kernels.hadamard import hadamard, rotation_sizes
from tierflow.cpu_kernels.kv_layout import check_pass_fits, decode, encode, kv_type_of, read_rows, write_rows
from tierflow.cpu_kernels.packed import PackedMatrix


def _group_scales(maxabs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inverse step, step) per group, float32 as the C code computes them."""
    maxabs = maxabs.astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(maxabs > 0, np.float32(127) / maxabs, np.float32(0)).astype(np.float32)
    return inverse, (maxabs / np.float32(127)).astype(np.float32)


def lut_tables(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] -> int8 tables [M, K/4, 16], steps [M, K/group], sums [M, K/group].

    Entry i of table t is the sum over j of (bit j of i - 1/2) * x[4t + j] (the subset sum less
    half the sum of all four), added in the C code's order and quantized with one step per group.
    """
    tokens, cols = x.shape
    fours = x.reshape(tokens, cols // 4, 4, 1).astype(np.float32)
    signs = (((np.arange(16)[None, :] >> np.arange(4)[:, None]) & 1) - np.float32(0.5)).astype(np.float32)
    terms = fours * signs  # [M, K/4, 4, 16], exact
    entries = ((terms[:, :, 0] + terms[:, :, 1]) + terms[:, :, 2]) + terms[:, :, 3]
    per_group = entries.reshape(tokens, cols // group, -1)
    inverse, steps = _group_scales(np.abs(per_group).max(axis=-1))
    codes = np.rint(per_group * inverse[..., None]).astype(np.int8).reshape(tokens, cols // 4, 16)
    return codes, steps, x.reshape(tokens, cols // group, group).sum(axis=-1, dtype=np.float64)


def int8_codes(x: np.ndarray, group: int, block: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] -> int8 codes [M, K], steps [M, K/block], sums [M, K/group]; one step per block
    columns (by default per group). A group's sum is its codes' sum times its step, as ggml's Q8_1
    keeps it (d * sum(q)): what a min multiplies, so the whole product is with the activations as
    the codes give them."""
    tokens, cols = x.shape
    blocks = x.reshape(tokens, cols // (block or group), -1).astype(np.float32)
    inverse, steps = _group_scales(np.abs(blocks).max(axis=-1))
    codes = np.rint(blocks * inverse[..., None]).astype(np.int8).reshape(tokens, cols)
    code_sums = codes.astype(np.int64).reshape(tokens, cols // group, group).sum(-1)
    group_steps = np.repeat(steps, (block or group) // group, axis=-1)  # [M, K/group]
    return codes, steps, code_sums * group_steps.astype(np.float64)


def _integer_sums(w: PackedMatrix, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token, row and group, the kernel's integer accumulator [M, N, G], plus steps and sums."""
    q = w.codes()
    if w.bits == 8:
        q = q.astype(np.int16) - w.centre
        codes, steps, sums = int8_codes(x, w.group)
        products = codes.astype(np.int64)[:, None, :] * q.astype(np.int64)[None, :, :]  # [M, N, K]
        return products.reshape(*products.shape[:2], -1, w.group).sum(-1), steps, sums
    tables, steps, sums = lut_tables(x, w.group)
    fours = q.reshape(w.rows, -1, 4).astype(np.int64)  # [N, K/4, 4]
    acc = np.zeros((x.shape[0], w.rows, w.cols // 4), np.int64)
    table_idx = np.arange(w.cols // 4)
    for p in range(w.bits):
        index = (((fours >> p) & 1) << np.arange(4)).sum(-1)  # [N, K/4] nibble of plane p
        acc += tables[:, table_idx[None, :], index].astype(np.int64) << p  # [M, N, K/4]
    return acc.reshape(*acc.shape[:2], -1, w.group // 4).sum(-1), steps, sums


def _two_level_reference(w: PackedMatrix, x: np.ndarray) -> np.ndarray:
    """The int8 kernel on two-level scales, as ggml's K-quant dot products: one activation step per
    super block; per super block, the integer sum over its groups of each group's dot product
    times the group's sub-scale, less the min codes times the groups' code sums, then d and dmin
    times the step in float32."""
    tokens, cols = x.shape
    gps = w.sub.groups_per_super
    codes, steps, _ = int8_codes(x, w.group, w.group * gps)  # steps [M, S]
    products = codes.astype(np.int64)[:, None, :] * w.codes().astype(np.int64)[None, :, :]  # [M, N, K]
    dots = products.reshape(tokens, w.rows, -1, w.group).sum(-1)  # [M, N, G]
    code_sums = codes.astype(np.int64).reshape(tokens, -1, w.group).sum(-1)  # [M, G]
    scale_codes, min_codes, d, dmin = w.sub_integers()
    per_super = lambda a: a.reshape(*a.shape[:-1], -1, gps).sum(-1)  # noqa: E731  [..., G] -> [..., S]
    total = per_super(dots * scale_codes[None]) * (d[None] * steps[:, None, :]).astype(np.float64)
    if min_codes is not None:
        mins = per_super(min_codes[None] * code_sums[:, None, :])
        total -= mins * (dmin[None] * steps[:, None, :]).astype(np.float64)
    return total.sum(-1)


def matmul_reference(w: PackedMatrix, x: np.ndarray) -> np.ndarray:
    """What the kernels compute for x [M, K] float32: [M, N] float64."""
    if w.bits == 8 and w.sub is not None:
        return _two_level_reference(w, x)
    acc, steps, sums = _integer_sums(w, x)
    scales, mins = w.group_params()
    if w.bits != 8:  # centred tables: each row's offset is its value at the centre code
        mins = mins + scales * np.float32(((1 << w.bits) - 1) / 2)
    else:  # centred codes, likewise
        mins = mins + scales * np.float32(w.centre)
    scaled = acc * (scales[None].astype(np.float64) * steps[:, None, :])
    return (scaled + mins[None].astype(np.float64) * sums[:, None, :]).sum(-1)


def matmul_exact(w: PackedMatrix, x: np.ndarray) -> np.ndarray:
    """x @ W.T with the packed weights and unquantized activations, float64."""
    return x.astype(np.float64) @ w.dequantize().astype(np.float64).T


# -- the fused layer operations (csrc/ops.c), as plain torch -----------------------------------


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
