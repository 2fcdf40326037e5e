"""Triton kernels: rotary embedding, KV-cache write and causal GQA attention in one launch.

Legend: T new tokens, H query heads, KvH key/value heads, GS = H / KvH query heads per key/value
head, D head size, R = 2 HALF rotated features, C cache capacity; BG, BS, BD block sizes.

One program per (new token, key/value head, split of the positions), flash-decoding style: it
rotates its GS query heads in registers and keeps a running softmax over the positions of its
split. Positions before `start` are read from the cache (keys [KvH, C/16, D, 16], values
[KvH, C, D]), a contiguous [D, 16] block of keys per step; the new tokens' own positions are read
from qkv, one at a time, their keys rotated on the fly (a [BS, D] tile of rotated keys would need
per-element partner addresses and spill registers for the whole kernel). So no program reads a
cache slot that this launch writes, and the writes (split 0 of each token and key/value head
rotates its key and stores it and its value) need no grid-wide barrier. With more than one split,
`merge_splits_kernel` combines the splits' partial results.

Prefill works (token i of T scores its i + 1 new positions one by one) but is made for decode and
verify batches of a few tokens: a long prompt wants a flash-attention prefill kernel.

A sliding window (token at position p sees p - WINDOW + 1 .. p) starts each program at the first
block holding a position it sees and masks the positions before it; a soft cap turns each score
s (queries scaled by the attention scale alone) into cap tanh(s / cap) before the base-2 softmax.

Rotation: feature d pairs with `partner` (d ^ 1 "normal", d +- R/2 "neox") and uses angle `pair`;
x'[d] = x[d] cos - x[partner] sin for the first of a pair, x[d] cos + x[partner] sin for the second.
"""

import triton
import triton.language as tl

from tierflow.gpu_kernels.launch import interpreting

INTERPRETED = interpreting()
BLOCK_S = 16  # positions scored per step: one block of the key cache, contiguous [D, 16]
MAX_SPLITS = 64
LOG2_E = 1.4426950408889634  # the softmax runs in base 2 (exp2 is one instruction)
_LOG2_E = tl.constexpr(LOG2_E)  # the same, as kernels can read it


@triton.jit
def _tanh(x):
    """tanh from exp2 (which the interpreter runs too), accurate near 0: sign(x) (1 - e) / (1 + e)
    with e = exp(-2 |x|)."""
    e = tl.exp2(tl.abs(x) * (-2.0 * _LOG2_E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _base2_logits(scores, softcap, SOFTCAP: tl.constexpr):
    """Scores as base-2 logits: already so without a cap (the queries carry log2 e), else
    capped as llama.cpp does, s * (1 / cap), tanh, * cap, then times log2 e."""
    if SOFTCAP:
        scores = _tanh(scores * (1.0 / softcap)) * softcap * _LOG2_E
    return scores


@triton.jit
def _rotated(qkv, at, d, cos, sin, cs_at, mask, D: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr):
    """Features d of the heads at qkv + at, rotated by the cos/sin rows at cs_at (broadcasting)."""
    if NEOX:
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        pair = tl.where(first, d, d - HALF)
    else:
        first = d % 2 == 0
        partner = d ^ 1
        pair = d // 2
    rotated = mask & (d < 2 * HALF)
    x = tl.load(qkv + at + d, mask=mask & (d < D), other=0.0)
    other = tl.load(qkv + at + partner, mask=rotated, other=0.0)
    c = tl.load(cos + cs_at + pair, mask=rotated, other=1.0)
    s = tl.load(sin + cs_at + pair, mask=rotated, other=0.0)
    return x * c + tl.where(first, -other, other) * s


@triton.jit
def _softmax_step(q, keys_t, values, seen, m_i, l_i, acc, softcap, SOFTCAP: tl.constexpr):
    """One block of positions into the running (max, sum, weighted values) of each query head."""
    scores = _base2_logits(tl.dot(q, keys_t, input_precision="ieee"), softcap, SOFTCAP)  # [BG, BS]
    scores = tl.where(seen[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every block sees a position
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def attention_kernel(qkv, keys, values, cos, sin, out, partials, stats, start, H, KVH, C, scale,
                     SPLIT_SIZE, NUM_SPLITS, WINDOW, softcap, D: tl.constexpr, HALF: tl.constexpr,
                     GROUP: tl.constexpr, NEOX: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """out [T, H, D] (one split), else partials [T, H, splits, D] and stats [T, H, splits, 2].
    WINDOW: positions a token sees (C or more: all of them); scale: the attention scale, times
    log2 e unless SOFTCAP."""
    tl.static_assert(BLOCK_S == 16, "a step scores one block of 16 cached keys")
    token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = (H + 2 * KVH) * D  # of qkv
    g = tl.arange(0, BLOCK_G)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dims = tl.arange(0, BLOCK_D)
    q = _rotated(qkv, token * row + (kv_head * GROUP + g) * D, d, cos, sin, token * HALF, g < GROUP,
                 D, HALF, NEOX) * scale  # [BG, BD]
    position = start + token
    first = tl.maximum(position + 1 - WINDOW, 0)  # the first position the token sees
    block_keys = keys + kv_head * (C // 16) * D * 16  # this head's [C/16, D, 16]
    head_values = values + kv_head * C * D  # [C, D]
    if split == 0:
        key_at = token * row + (H + kv_head) * D
        k = _rotated(qkv, key_at, dims, cos, sin, token * HALF, dims < D, D, HALF, NEOX)
        tl.store(block_keys + ((position // 16) * D + dims) * 16 + position % 16, k, mask=dims < D)
        v = tl.load(qkv + key_at + KVH * D + dims, mask=dims < D)
        tl.store(head_values + position * D + dims, v, mask=dims < D)

    lo = split * SPLIT_SIZE
    hi = tl.minimum(lo + SPLIT_SIZE, position + 1)  # causal: positions 0 .. start + token
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    cached_hi = tl.minimum(hi, start)
    # earlier positions, from the cache (lo % 16 == 0), from the block holding `first` on
    for s0 in range(tl.maximum(lo, first // BLOCK_S * BLOCK_S), cached_hi, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        seen = (s < cached_hi) & (s >= first)
        keys_t = tl.load(block_keys + (s0 // 16 * D + dims[:, None]) * 16 + tl.arange(0, BLOCK_S)[None, :],
                         mask=seen[None, :] & (dims[:, None] < D), other=0.0)  # [BD, BS]
        vals = tl.load(head_values + s[:, None] * D + d, mask=seen[:, None] & (d < D), other=0.0)  # [BS, BD]
        m_i, l_i, acc = _softmax_step(q, keys_t, vals, seen, m_i, l_i, acc, softcap, SOFTCAP)
    for s in range(tl.maximum(tl.maximum(lo, start), first), hi):  # this launch's tokens, from qkv

        new_at = (s - start) * row
        k = _rotated(qkv, new_at + (H + kv_head) * D, dims, cos, sin, (s - start) * HALF, dims < D, D, HALF,
                     NEOX)
        v = tl.load(qkv + new_at + (H + KVH + kv_head) * D + dims, mask=dims < D, other=0.0)
        score = _base2_logits(tl.sum(q * k[None, :], axis=1), softcap, SOFTCAP)  # [BG]
        m_new = tl.maximum(m_i, score)
        alpha, p = tl.exp2(m_i - m_new), tl.exp2(score - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v[None, :]
        m_i = m_new

    heads = token * H + kv_head * GROUP + tl.arange(0, BLOCK_G)  # [BG] rows of [T, H]
    mask = (g < GROUP) & (d < D)
    if SPLIT:
        at = heads * NUM_SPLITS + split
        tl.store(partials + at[:, None] * D + d, acc, mask=mask)
        tl.store(stats + at * 2, m_i, mask=tl.arange(0, BLOCK_G) < GROUP)
        tl.store(stats + at * 2 + 1, l_i, mask=tl.arange(0, BLOCK_G) < GROUP)
    else:
        tl.store(out + heads[:, None] * D + d, acc / l_i[:, None], mask=mask)


@triton.jit
def merge_splits_kernel(partials, stats, out, NUM_SPLITS, D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """out [T, H, D] from the splits' partials: each rescaled to the largest max, then normalised."""
    head = tl.program_id(0)  # a row of [T, H]
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    ok = splits < NUM_SPLITS
    at = head * NUM_SPLITS + splits
    m = tl.load(stats + at * 2, mask=ok, other=float("-inf"))
    weights = tl.exp2(m - tl.max(m, axis=0))  # a split that saw nothing has m = -inf: weight 0
    total = tl.sum(tl.load(stats + at * 2 + 1, mask=ok, other=0.0) * weights, axis=0)
    mask = ok[:, None] & (dims[None, :] < D)
    acc = tl.load(partials + at[:, None] * D + dims[None, :], mask=mask, other=0.0)  # [splits, D]
    tl.store(out + head * D + dims, tl.sum(acc * weights[:, None], axis=0) / total, mask=dims < D)
