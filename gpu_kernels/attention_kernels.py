"""Triton kernels: rotary embedding, KV-cache write and causal GQA attention in one launch.

Legend: T new tokens, H query heads, KvH key/value heads, GS = H / KvH query heads per key/value
head, D head size, R = 2 HALF rotated features, C cache capacity; BG, BS, BD block sizes.

One program per (new token, key/value head, split of the positions), flash-decoding style: it
rotates its GS query heads in registers and keeps a running softmax over the positions of its
split. Positions before `start` are read from the cache in its type (KV: f32, f16, q8_0, q4_0;
keys [KvH, C/16, I, 16], values [KvH, C, I], rows of I items: cpu_kernels/kv_layout.py), a
contiguous [I, 16] block of keys per step, each value converted exactly to float32; the new
tokens' own positions are read from qkv, one at a time, their keys rotated on the fly (a [BS, D]
tile of rotated keys would need per-element partner addresses and spill registers for the whole
kernel) and both rounded through the type in registers, as the cache will hold them. So no
program reads a cache slot that this launch writes, and the writes (split 0 of each token and
key/value head rotates its key and stores it and its value, quantized as llama.cpp's reference
quantizers do) need no grid-wide barrier. With more than one split, `merge_splits_kernel`
combines the splits' partial results.

Prefill works (token i of T scores its i + 1 new positions one by one) but is made for decode and
verify batches of a few tokens: a long prompt wants a flash-attention prefill kernel.

A sliding window (token at position p sees p - WINDOW + 1 .. p) starts each program at the first
block holding a position it sees and masks the positions before it, as it masks those before
HELD_FROM (the oldest the cache holds). Position p is in slot p % C: a block of 16 positions is a
block of 16 slots (C is a multiple of 16), and the launcher has checked that no two positions one
launch reads or writes share a slot of a ring (so what the launch writes are slots it does not
read, as above). A soft cap turns each score
s (queries scaled by the attention scale alone) into cap tanh(s / cap) before the base-2 softmax.

Rotation: feature d pairs with `partner` (d ^ 1 "normal", d +- R/2 "neox") and uses angle `pair`;
x'[d] = x[d] cos - x[partner] sin for the first of a pair, x[d] cos + x[partner] sin for the second.

A quantized cache is Hadamard-rotated as llama.cpp's (cpu_kernels/hadamard.py): with ROT_K > 0 the
queries and keys after rotary embedding in blocks of ROT_K features, with ROT_V > 0 the values
before they are stored or read from qkv, and the output back, in blocks of ROT_V. `_hadamard` takes
hadamard.py's float32 steps in its order (butterflies in registers, through reshapes).
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


KV_CODES = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3}  # the KV constexpr: the cache's type


@triton.jit
def _row_items(D: tl.constexpr, KV: tl.constexpr):
    """Items of a cache row (cpu_kernels/kv_layout.py): D values, or the D/32 blocks' bytes."""
    if KV == 2:
        return D // 32 * 34
    elif KV == 3:
        return D // 32 * 18
    else:
        return D


@triton.jit
def _item(d, KV: tl.constexpr):
    """The item of a row that holds feature d, and (q4_0) the shift of its nibble."""
    if KV == 2:
        return d // 32 * 34 + 2 + d % 32, 0
    elif KV == 3:
        return d // 32 * 18 + 2 + d % 16, d % 32 // 16 * 4
    else:
        return d, 0


@triton.jit
def _scale(byte_at, step, mask):
    """A block's f16 scale from its two bytes (low at byte_at, high at byte_at + step), as float32."""
    low = tl.load(byte_at, mask=mask, other=0).to(tl.uint16)
    high = tl.load(byte_at + step, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_items(rows, at, d, block_at, step, mask, KV: tl.constexpr):
    """Features d of rows stored in the type, as float32 (exact): at the items at + step * item,
    their blocks' scales at block_at + step * (d // 32 * block bytes)."""
    item, shift = _item(d, KV)
    x = tl.load(rows + at + step * item, mask=mask, other=0)
    if KV == 2:
        scale = _scale(rows + block_at + step * (d // 32 * 34), step, mask)
        return x.to(tl.int8, bitcast=True).to(tl.float32) * scale
    elif KV == 3:
        scale = _scale(rows + block_at + step * (d // 32 * 18), step, mask)
        return (((x >> shift) & 15).to(tl.int32) - 8).to(tl.float32) * scale
    else:
        return x.to(tl.float32)


@triton.jit
def _roundf(v):
    """C's roundf (halves away from zero) exactly: floor(|v| + 0.5) would round before the floor."""
    a = tl.abs(v)
    whole = tl.floor(a)
    rounded = whole + tl.floor(2 * (a - whole))
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def _quantize(x, BLOCK_D: tl.constexpr, KV: tl.constexpr):
    """Row x [BLOCK_D] (zeros past D) as llama.cpp's reference quantizer does it: the codes
    [BLOCK_D / 32, 32] (q8_0: q; q4_0: q in 0..15) and each block's scale d as float16."""
    blocks = tl.reshape(x, [BLOCK_D // 32, 32])
    j = tl.arange(0, 32)[None, :]
    if KV == 2:
        d = tl.max(tl.abs(blocks), axis=1) / 127
        inverse = tl.where(d == 0, 0.0, 1 / d)
        codes = _roundf(blocks * inverse[:, None])
    else:  # d = m / -8 for the first value of largest magnitude
        largest = tl.argmax(tl.abs(blocks), axis=1, tie_break_left=True)
        d = tl.sum(tl.where(j == largest[:, None], blocks, 0.0), axis=1) / -8
        inverse = tl.where(d == 0, 0.0, 1 / d)
        codes = tl.minimum(tl.floor(blocks * inverse[:, None] + 8.5), 15.0)
    return codes, d.to(tl.float16)


@triton.jit
def _roundtrip(x, BLOCK_D: tl.constexpr, KV: tl.constexpr):
    """Row x [BLOCK_D] as the cache gives it back once stored in the type (float32)."""
    if KV == 0:
        return x
    elif KV == 1:
        return x.to(tl.float16).to(tl.float32)
    else:
        codes, d = _quantize(x, BLOCK_D, KV)
        values = (codes - 8.0 if KV == 3 else codes) * d.to(tl.float32)[:, None]
        return tl.reshape(values, [BLOCK_D])


@triton.jit
def _store_row(rows, at, step, x, BLOCK_D: tl.constexpr, D: tl.constexpr, KV: tl.constexpr):
    """Stores row x [BLOCK_D] in the type: item i at rows + at + step * i (1: a value row; 16: a key
    row into its transposed block)."""
    dims = tl.arange(0, BLOCK_D)
    if KV < 2:
        tl.store(rows + at + step * dims, x.to(rows.dtype.element_ty), mask=dims < D)
    else:
        codes, d = _quantize(x, BLOCK_D, KV)
        block_bytes: tl.constexpr = 34 if KV == 2 else 18
        b = tl.arange(0, BLOCK_D // 32)
        bits = d.to(tl.uint16, bitcast=True)
        block_at = rows + at + step * (b * block_bytes)
        tl.store(block_at, (bits & 255).to(tl.uint8), mask=b < D // 32)
        tl.store(block_at + step, (bits >> 8).to(tl.uint8), mask=b < D // 32)
        if KV == 2:
            feature = tl.reshape(dims, [BLOCK_D // 32, 32])
            byte = codes.to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
            tl.store(rows + at + step * (feature // 32 * 34 + 2 + feature % 32), byte, mask=feature < D)
        else:  # byte j of a block: q[j] | q[j + 16] << 4
            halves = tl.reshape(codes.to(tl.int32), [BLOCK_D // 32, 2, 16])
            low, high = tl.split(tl.permute(halves, [0, 2, 1]))  # [BLOCK_D / 32, 16] each
            item = tl.arange(0, BLOCK_D // 32)[:, None] * 18 + 2 + tl.arange(0, 16)[None, :]
            tl.store(rows + at + step * item, (low | (high << 4)).to(tl.uint8),
                     mask=tl.arange(0, BLOCK_D // 32)[:, None] < D // 32)


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
def _butterfly(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr):
    """One stage of the Walsh-Hadamard transform of rows x [ROWS, BLOCK_D]: features j and j + HALF of
    each run of 2 HALF become their sum and their difference."""
    pairs = tl.permute(tl.reshape(x, [ROWS * BLOCK_D // (2 * HALF), 2, HALF]), [0, 2, 1])
    first, second = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(first + second, first - second), [0, 2, 1]), [ROWS, BLOCK_D])


@triton.jit
def _hadamard(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, N: tl.constexpr):
    """Rows x [ROWS, BLOCK_D] with each block of N features times the orthonormal Hadamard matrix
    (N = 0: x): the stages for N = 2, 4, ..., then times float32 N^-1/2 (hadamard.scale_of)."""
    if N > 0:
        for stage in tl.static_range(16):
            if (1 << stage) < N:
                x = _butterfly(x, ROWS, BLOCK_D, 1 << stage)
        x = x * (N**-0.5)
    return x


@triton.jit
def _hadamard_row(x, BLOCK_D: tl.constexpr, N: tl.constexpr):
    """One row x [BLOCK_D], as _hadamard."""
    return tl.reshape(_hadamard(tl.reshape(x, [1, BLOCK_D]), 1, BLOCK_D, N), [BLOCK_D])


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
                     BASE, SPLIT_SIZE, NUM_SPLITS, WINDOW, HELD_FROM, softcap, sinks, D: tl.constexpr,
                     HALF: tl.constexpr, GROUP: tl.constexpr, NEOX: tl.constexpr, SPLIT: tl.constexpr,
                     SOFTCAP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_D: tl.constexpr, KV: tl.constexpr = 0, ROT_K: tl.constexpr = 0,
                     ROT_V: tl.constexpr = 0, SINKS: tl.constexpr = False):
    """out [T, H, D] (one split), else partials [T, H, splits, D] and stats [T, H, splits, 2].
    WINDOW: positions a token sees (C or more: all of them); HELD_FROM: the first position the
    cache holds; scale: the attention scale, times log2 e unless SOFTCAP. The splits cover the
    positions from BASE (a multiple of 16) on. KV: the cache's type (KV_CODES); the new tokens'
    keys and values are read as stored in it. ROT_K, ROT_V: the Hadamard sizes (0: none). SINKS:
    sinks [H] holds each query head's sink logit, which split 0 counts as a position of no value."""
    tl.static_assert(BLOCK_S == 16, "a step scores one block of 16 cached keys")
    token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = (H + 2 * KVH) * D  # of qkv
    g = tl.arange(0, BLOCK_G)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dims = tl.arange(0, BLOCK_D)
    q = _rotated(qkv, token * row + (kv_head * GROUP + g) * D, d, cos, sin, token * HALF, g < GROUP,
                 D, HALF, NEOX)
    q = _hadamard(q, BLOCK_G, BLOCK_D, ROT_K) * scale  # [BG, BD]
    position = start + token
    first = tl.maximum(position + 1 - WINDOW, HELD_FROM)  # the first position the token sees
    ROW: tl.constexpr = _row_items(D, KV)
    block_keys = keys + kv_head * (C // 16) * ROW * 16  # this head's [C/16, ROW, 16]
    head_values = values + kv_head * C * ROW  # [C, ROW]
    if split == 0:
        key_at = token * row + (H + kv_head) * D
        k = _hadamard_row(_rotated(qkv, key_at, dims, cos, sin, token * HALF, dims < D, D, HALF, NEOX),
                          BLOCK_D, ROT_K)
        slot = position % C
        _store_row(block_keys, (slot // 16) * ROW * 16 + slot % 16, 16, k, BLOCK_D, D, KV)
        v = _hadamard_row(tl.load(qkv + key_at + KVH * D + dims, mask=dims < D, other=0.0), BLOCK_D, ROT_V)
        _store_row(head_values, slot * ROW, 1, v, BLOCK_D, D, KV)

    lo = BASE + split * SPLIT_SIZE
    hi = tl.minimum(lo + SPLIT_SIZE, position + 1)  # causal: positions 0 .. start + token
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if SINKS:  # the running softmax starts from the sink: a max of it and a sum of exp(0) = 1
        own = tl.arange(0, BLOCK_G) < tl.where(split == 0, GROUP, 0)  # the heads, in split 0 only
        sink = tl.load(sinks + kv_head * GROUP + tl.arange(0, BLOCK_G), mask=own, other=float("-inf"))
        m_i = sink * _LOG2_E
        l_i = tl.where(own, 1.0, 0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    cached_hi = tl.minimum(hi, start)
    # earlier positions, from the cache (lo % 16 == 0), from the block holding `first` on
    for s0 in range(tl.maximum(lo, first // BLOCK_S * BLOCK_S), cached_hi, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        seen = (s < cached_hi) & (s >= first)
        key_at = s0 % C // 16 * ROW * 16 + tl.arange(0, BLOCK_S)[None, :]
        keys_t = _load_items(block_keys, key_at, dims[:, None], key_at, 16,
                             seen[None, :] & (dims[:, None] < D), KV)  # [BD, BS]
        value_at = s[:, None] % C * ROW
        vals = _load_items(head_values, value_at, d, value_at, 1, seen[:, None] & (d < D), KV)  # [BS, BD]
        m_i, l_i, acc = _softmax_step(q, keys_t, vals, seen, m_i, l_i, acc, softcap, SOFTCAP)
    for s in range(tl.maximum(tl.maximum(lo, start), first), hi):  # this launch's tokens, from qkv
        new_at = (s - start) * row
        k = _rotated(qkv, new_at + (H + kv_head) * D, dims, cos, sin, (s - start) * HALF, dims < D, D, HALF,
                     NEOX)
        k = _roundtrip(_hadamard_row(k, BLOCK_D, ROT_K), BLOCK_D, KV)  # as split 0 stores it
        v = tl.load(qkv + new_at + (H + KVH + kv_head) * D + dims, mask=dims < D, other=0.0)
        v = _roundtrip(_hadamard_row(v, BLOCK_D, ROT_V), BLOCK_D, KV)
        score = _base2_logits(tl.sum(q * k[None, :], axis=1), softcap, SOFTCAP)  # [BG]
        m_new = tl.maximum(m_i, score)
        alpha, p = tl.exp2(m_i - m_new), tl.exp2(score - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v[None, :]
        m_i = m_new

    acc = _hadamard(acc, BLOCK_G, BLOCK_D, ROT_V)  # back from the rotated values (linear: before the merge)
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
