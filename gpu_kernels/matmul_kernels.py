"""Triton kernels: dequantize-and-multiply straight from the packed layout (see packed.py).

Legend: M tokens, N rows of W, K columns, T tiles of 64 rows; BM, BN, BK block sizes; BO = BK / 8
LUT byte columns, BC = BK / 4 int8 column quads, BG = BK / GROUP groups (1 where a group spans
blocks). Rows are the fast axis of every tile: the 64 rows of a tile are contiguous in every
layout, so a warp's loads coalesce.

- `matvec_kernel` (decode, M <= 4): one token and BN rows per program, the K range optionally
  split over programs (split-K) so that a short, wide matrix still fills the GPU; partial sums
  go to a [splits, M, N] workspace the launcher adds up in a fixed order (no atomics). It never
  builds a [BK, BN] tile of codes (per-element addresses would spill registers): a LUT program
  loads each byte of a [BO, BN] block once per bit plane, packs the planes of a byte column into
  one uint32 (plane p in byte p), and gets the codes of its 8 columns with two shifts, a mask and
  a multiply each (`gather_bits`); an int8 program loads [BC, BN, 4], four codes per load (or
  four fields: with CODEBOOK, 4-bit indices into the 16 codes at `codebook`, looked up there;
  with WIDTH 2..6, the low 4 (2 below WIDTH 4) bits of unsigned codes, joined in registers to
  their high bits from `high`, less ZERO). The partial sums of a group are added first, then its scale and
  min apply once: `s * sum(q x) + m * sum(x)` (groups are powers of two, so a block of BK columns
  holds whole groups or lies in one).
- Scales and mins (`_block_params`) come as float16 per group, or as the file's two-level scales
  (SUB_BITS 4, 6, 8: per group a code, per super block of SUB_GPS groups a float16 d and dmin;
  scale = d * (code - SUB_OFFSET), min = -(dmin * min code), ggml's float32 products), decoded
  where they are applied. MINS says where a group's min comes from: "half" (float16 mins),
  "sub" (the min codes), "zero" (LUT codes' zero code, -ZERO * scale) or "none".
- `matmul_kernel` (prefill): a [BM, BN] block of out per program, `tl.dot` on tensor cores over a
  [BK, BN] tile of W, read as the matrix-vector kernel reads it and dequantized once for the BM
  tokens (float16/bfloat16 activations: W rounded to their dtype; float32: tf32x3, close to
  float32 at three tf32 products).

With SILU_MUL, W is [gate; up] (rows 0..F-1 and F..2F-1): each program also reads the up rows
matching its gate rows and writes silu(gate) * up [M, F], never storing the 2F products.
"""

import triton
import triton.language as tl

from tierflow.gpu_kernels.launch import interpreting

INTERPRETED = interpreting()

# Under the interpreter a config costs seconds to try: one, small, so a test runs few programs.
if INTERPRETED:
    MATVEC_CONFIGS = [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32})]
    MATMUL_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32})]
else:
    MATVEC_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
                      for n, k, w in [(32, 128, 2), (32, 128, 4), (32, 256, 4), (64, 128, 4), (64, 128, 8),
                                      (64, 256, 4), (64, 256, 8), (128, 128, 4), (128, 256, 8)]]
    MATMUL_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                      for m, n, k, w, s in [(16, 64, 64, 4, 3), (32, 64, 64, 4, 3), (32, 128, 32, 4, 4),
                                            (64, 64, 32, 4, 4), (64, 128, 32, 8, 3), (128, 128, 32, 8, 3)]]
SPLIT_ALIGN = 32 if INTERPRETED else 256  # a split's K range is a multiple of every BLOCK_K above


def fitting_configs(configs: list, named_args: dict, **kwargs) -> list:
    """Matrix-vector configs that do not spill registers (ptxas, sm_90): at most 64 weights per
    thread, or 128 for a LUT matrix without the SiLU epilogue (one uint32 per 8 weights); nibbles
    with the SiLU epilogue (gate and up codes looked up, or joined to their high bits) also
    BLOCK_K <= 128, and at most 32 weights per thread with high bits (Q3_K, Q5_K, Q6_K)."""
    args = {**named_args, **kwargs}
    silu, width = args.get("SILU_MUL"), args.get("WIDTH", 8)
    limit = 128 if args.get("BITS") != 8 and not silu else 32 if silu and width in (3, 5, 6) else 64
    max_k = 128 if silu and (args.get("CODEBOOK") or width < 8) else None
    fitting = [c for c in configs if c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= limit * 32 * c.num_warps
               and (max_k is None or c.kwargs["BLOCK_K"] <= max_k)]
    return fitting or configs


@triton.jit
def gather_bits(planes, j):
    """The codes of column j of byte columns whose planes are packed as uint32 (plane p in byte p):
    bit j of each byte, moved to bits 24 + p by one multiply (0x01020408 = sum of 2^(24 - 7p); the
    other products land below bit 24 at distinct places, or past bit 31), then shifted down."""
    return (((planes >> j) & 0x01010101) * 0x01020408) >> 24


@triton.jit
def _packed_planes(data, byte_at, mask, BITS: tl.constexpr):
    """The BITS plane bytes of each LUT byte column as one uint32, plane p in byte p."""
    planes = tl.zeros(byte_at.shape, tl.uint32)
    for p in tl.static_range(BITS):
        planes |= tl.load(data + byte_at + p * 64, mask=mask, other=0).to(tl.uint32) << (8 * p)
    return planes


@triton.jit
def _sub_code(sub_codes, block_at, v, mask, SUB_BITS: tl.constexpr, VALUES: tl.constexpr):
    """Code v [.., 1] of each row's VALUES sub codes in its super block, whose byte 0 (of B, 64
    apart) is at block_at [.., BN]: a byte (8 bits), a nibble (4), or a nibble and 2 top bits (6)."""
    if SUB_BITS == 8:
        code = tl.load(sub_codes + block_at + v * 64, mask=mask, other=0).to(tl.int32)
    else:
        low = tl.load(sub_codes + block_at + (v // 2) * 64, mask=mask, other=0).to(tl.int32)
        code = (low >> (4 * (v % 2))) & 0x0F
        if SUB_BITS == 6:
            top = tl.load(sub_codes + block_at + (VALUES // 2 + v // 4) * 64, mask=mask, other=0).to(tl.int32)
            code |= ((top >> (2 * (v % 4))) & 3) << 4
    return code


@triton.jit
def _block_params(scales, mins, sub_codes, sub_supers, rows, k0, N, K, GROUP: tl.constexpr,
                  ZERO: tl.constexpr, MINS: tl.constexpr, SUB_BITS: tl.constexpr, SUB_OFFSET: tl.constexpr,
                  SUB_GPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 scales and mins [BG, BN] of the groups of columns k0 .. k0 + BK in `rows` (the min
    meaningful only where MINS is not "none"), exactly as PackedMatrix.group_params() makes them."""
    BG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1  # as _by_group's
    g = k0 // GROUP + tl.arange(0, BG)[:, None]  # [BG, 1]
    tile, lane = rows[None, :] // 64, rows[None, :] % 64  # [1, BN]
    mask = (g < K // GROUP) & (rows[None, :] < N)
    if SUB_BITS == 0:  # float16 [T, G, 64]
        at = (tile * (K // GROUP) + g) * 64 + lane
        scale = tl.load(scales + at, mask=mask, other=0).to(tl.float32)
        if MINS == "half":
            min_ = tl.load(mins + at, mask=mask, other=0).to(tl.float32)
    else:  # codes uint8 [T, S', B, 64], supers float16 [T, S', 1 or 2, 64]
        HALVES: tl.constexpr = 2 if MINS == "sub" else 1  # scale (and min) codes per group
        VALUES: tl.constexpr = SUB_GPS * HALVES
        BYTES: tl.constexpr = VALUES if SUB_BITS == 8 else VALUES // 2 + (VALUES // 4 if SUB_BITS == 6 else 0)
        block = tile * (K // (GROUP * SUB_GPS)) + g // SUB_GPS  # the row's super block
        v = (g % SUB_GPS) * HALVES
        codes_at = block * (BYTES * 64) + lane
        supers_at = block * (HALVES * 64) + lane
        d = tl.load(sub_supers + supers_at, mask=mask, other=0).to(tl.float32)
        code = _sub_code(sub_codes, codes_at, v, mask, SUB_BITS, VALUES)
        scale = d * (code - SUB_OFFSET).to(tl.float32)
        if MINS == "sub":
            dmin = tl.load(sub_supers + supers_at + 64, mask=mask, other=0).to(tl.float32)
            min_ = -(dmin * _sub_code(sub_codes, codes_at, v + 1, mask, SUB_BITS, VALUES).to(tl.float32))
    if MINS == "zero":
        min_ = scale * (-ZERO)
    if MINS == "none":
        min_ = scale  # never read
    return scale, min_


@triton.jit
def _by_group(t, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """[P, X] values of a block's BK columns in order -> [BG, P / BG, X]: BG groups (GROUP a power of
    two: 1 where a group spans several blocks), so that per-group parameters apply once a group."""
    BG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1
    return tl.reshape(t, (BG, t.shape[0] // BG, t.shape[1]))


@triton.jit
def _lut_dot(data, scales, mins, sub_codes, sub_supers, x_row, rows, k0, N, K, GROUP: tl.constexpr,
             BITS: tl.constexpr, ZERO: tl.constexpr, MINS: tl.constexpr, SUB_BITS: tl.constexpr,
             SUB_OFFSET: tl.constexpr, SUB_GPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over k in k0 .. k0 + BK of W[rows, k] x[k], as [BG, BN] partial sums; uint8 [T, K/8, BITS, 64]."""
    o = k0 // 8 + tl.arange(0, BLOCK_K // 8)[:, None]  # [BO, 1] byte columns
    tile, lane = rows[None, :] // 64, rows[None, :] % 64  # [1, BN]
    mask = (o < K // 8) & (rows[None, :] < N)
    planes = _packed_planes(data, (tile * (K // 8) + o) * (BITS * 64) + lane, mask, BITS)  # [BO, BN]
    dot = tl.zeros(planes.shape, tl.float32)
    x_sum = tl.zeros(o.shape, tl.float32)
    for j in tl.static_range(8):
        xj = tl.load(x_row + o * 8 + j, mask=o < K // 8, other=0).to(tl.float32)  # [BO, 1]
        dot += gather_bits(planes, j).to(tl.float32) * xj
        x_sum += xj
    scale, min_ = _block_params(scales, mins, sub_codes, sub_supers, rows, k0, N, K, GROUP, ZERO, MINS,
                                SUB_BITS, SUB_OFFSET, SUB_GPS, BLOCK_K)  # [BG, BN]
    part = tl.sum(_by_group(dot, GROUP, BLOCK_K), axis=1) * scale
    if MINS != "none":
        part += min_ * tl.sum(_by_group(x_sum, GROUP, BLOCK_K), axis=1)
    return part


@triton.jit
def _field_codes(data, high, c, tile, lane, mask, K, WIDTH: tl.constexpr, FIELD: tl.constexpr):
    """The unsigned codes of WIDTH bits of column quads c [BC, 1] of rows (tile, lane) [1, BN]:
    [BC, BN, 4]. Their low FIELD bits are fields of data, uint8 [T, K*FIELD/32, 64, 4] (quad c at bits
    FIELD * (c % (8 / FIELD)) of byte column c // (8 / FIELD)); the WIDTH - FIELD above them are in
    `high`, uint8 [T, K*h/32, 64, 4] (bits h*i.. of byte column b: quad (8 / h) * b + i)."""
    quad = tl.arange(0, 4)
    PER_BLOCK: tl.constexpr = 8 // FIELD
    byte_at = (tile * (K * FIELD // 32) + c // PER_BLOCK) * 256 + lane * 4  # [BC, BN]
    fields = tl.load(data + byte_at[:, :, None] + quad, mask=mask[:, :, None], other=0).to(tl.int32)
    u = (fields >> (FIELD * (c % PER_BLOCK))[:, :, None]) & ((1 << FIELD) - 1)
    if WIDTH > FIELD:
        H: tl.constexpr = WIDTH - FIELD
        PER_BYTE: tl.constexpr = 8 // H  # quads per high byte
        high_at = (tile * (K * H // 32) + c // PER_BYTE) * 256 + lane * 4  # [BC, BN]
        top = tl.load(high + high_at[:, :, None] + quad, mask=mask[:, :, None], other=0).to(tl.int32)
        u |= ((top >> (H * (c % PER_BYTE))[:, :, None]) & ((1 << H) - 1)) << FIELD
    return u


@triton.jit
def _int8_quads(data, high, codebook, c, tile, lane, mask, K, WIDTH: tl.constexpr, ZERO: tl.constexpr,
                CODEBOOK: tl.constexpr):
    """The codes of column quads c [BC, 1] of rows (tile, lane) [1, BN]: [BC, BN, 4]. int8
    [T, K/4, 64, 4]; with CODEBOOK nibbles, each an index into the 16 codes at `codebook`; else
    unsigned codes of WIDTH bits in fields (_field_codes: nibbles from 4 bits on, else 2-bit
    fields), less ZERO."""
    if CODEBOOK:
        q = tl.load(codebook + _field_codes(data, high, c, tile, lane, mask, K, 4, 4))
    elif WIDTH < 4:
        q = _field_codes(data, high, c, tile, lane, mask, K, WIDTH, 2) - ZERO
    elif WIDTH < 8:
        q = _field_codes(data, high, c, tile, lane, mask, K, WIDTH, 4) - ZERO
    else:
        quad = tl.arange(0, 4)
        quad_at = (tile * (K // 4) + c) * 256 + lane * 4  # [BC, BN]
        q = tl.load(data + quad_at[:, :, None] + quad, mask=mask[:, :, None], other=0)
    return q


@triton.jit
def _int8_dot(data, high, scales, mins, codebook, sub_codes, sub_supers, x_row, rows, k0, N, K,
              GROUP: tl.constexpr, WIDTH: tl.constexpr, ZERO: tl.constexpr, CODEBOOK: tl.constexpr,
              MINS: tl.constexpr, SUB_BITS: tl.constexpr, SUB_OFFSET: tl.constexpr, SUB_GPS: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """sum over k in k0 .. k0 + BK of W[rows, k] x[k], as [BG, BN] partial sums (int8 layout, or fields)."""
    c = k0 // 4 + tl.arange(0, BLOCK_K // 4)[:, None]  # [BC, 1] column quads
    tile, lane = rows[None, :] // 64, rows[None, :] % 64  # [1, BN]
    quad = tl.arange(0, 4)
    mask = (c < K // 4) & (rows[None, :] < N)
    q = _int8_quads(data, high, codebook, c, tile, lane, mask, K, WIDTH, ZERO, CODEBOOK)  # [BC, BN, 4]
    x4 = tl.load(x_row + c * 4 + quad[None, :], mask=c < K // 4, other=0).to(tl.float32)  # [BC, 4]
    dot = tl.sum(q.to(tl.float32) * x4[:, None, :], axis=2)
    scale, min_ = _block_params(scales, mins, sub_codes, sub_supers, rows, k0, N, K, GROUP, ZERO, MINS,
                                SUB_BITS, SUB_OFFSET, SUB_GPS, BLOCK_K)  # [BG, BN]
    part = tl.sum(_by_group(dot, GROUP, BLOCK_K), axis=1) * scale
    if MINS != "none":
        part += min_ * tl.sum(_by_group(tl.sum(x4, axis=1)[:, None], GROUP, BLOCK_K), axis=1)
    return part


@triton.jit
def _row_dot(data, high, scales, mins, codebook, sub_codes, sub_supers, x_row, rows, k0, N, K,
             GROUP: tl.constexpr, BITS: tl.constexpr, WIDTH: tl.constexpr, ZERO: tl.constexpr,
             CODEBOOK: tl.constexpr, MINS: tl.constexpr, SUB_BITS: tl.constexpr, SUB_OFFSET: tl.constexpr,
             SUB_GPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over k in k0 .. k0 + BK of W[rows, k] x[k]: [BN]."""
    if BITS == 8:
        part = _int8_dot(data, high, scales, mins, codebook, sub_codes, sub_supers, x_row, rows, k0, N, K,
                         GROUP, WIDTH, ZERO, CODEBOOK, MINS, SUB_BITS, SUB_OFFSET, SUB_GPS, BLOCK_K)
    else:
        part = _lut_dot(data, scales, mins, sub_codes, sub_supers, x_row, rows, k0, N, K, GROUP, BITS, ZERO,
                        MINS, SUB_BITS, SUB_OFFSET, SUB_GPS, BLOCK_K)
    return tl.sum(part, axis=0)


@triton.jit
def silu(x):
    """x * sigmoid(x), with e^-|x| so that nothing overflows."""
    e = tl.exp(-tl.abs(x))
    return x * tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.autotune(configs=MATVEC_CONFIGS,
                 key=["N_OUT", "K", "BITS", "WIDTH", "GROUP", "CODEBOOK", "SUB_BITS", "SPLIT_K", "SILU_MUL"],
                 prune_configs_by={"early_config_prune": fitting_configs})
@triton.jit
def matvec_kernel(x, data, high, scales, mins, codebook, sub_codes, sub_supers, out, M, N, N_OUT, K,
                  stride_x, K_PER_SPLIT, GROUP: tl.constexpr, BITS: tl.constexpr, WIDTH: tl.constexpr,
                  ZERO: tl.constexpr, CODEBOOK: tl.constexpr, MINS: tl.constexpr, SUB_BITS: tl.constexpr,
                  SUB_OFFSET: tl.constexpr, SUB_GPS: tl.constexpr, SILU_MUL: tl.constexpr,
                  SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [SPLIT_K, M, N_OUT] (float32 partials) or [M, N_OUT] (x's dtype, SPLIT_K == 1)."""
    block_n, split, token = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = block_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    x_row = x + token * stride_x
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        acc += _row_dot(data, high, scales, mins, codebook, sub_codes, sub_supers, x_row, rows, k0, N, K,
                        GROUP, BITS, WIDTH, ZERO, CODEBOOK, MINS, SUB_BITS, SUB_OFFSET, SUB_GPS, BLOCK_K)
        if SILU_MUL:  # the up rows of these gate rows
            acc_up += _row_dot(data, high, scales, mins, codebook, sub_codes, sub_supers, x_row, rows + N_OUT,
                               k0, N, K, GROUP, BITS, WIDTH, ZERO, CODEBOOK, MINS, SUB_BITS, SUB_OFFSET,
                               SUB_GPS, BLOCK_K)
    if SILU_MUL:
        acc = silu(acc) * acc_up
    out_at = out + (split * M + token) * N_OUT + rows
    tl.store(out_at, acc.to(out.dtype.element_ty), mask=rows < N_OUT)


@triton.jit
def _dequantize(data, high, scales, mins, codebook, sub_codes, sub_supers, rows, k0, N, K,
                GROUP: tl.constexpr, BITS: tl.constexpr, WIDTH: tl.constexpr, ZERO: tl.constexpr,
                CODEBOOK: tl.constexpr, MINS: tl.constexpr, SUB_BITS: tl.constexpr, SUB_OFFSET: tl.constexpr,
                SUB_GPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rows, k0 .. k0 + BK] as a float32 [BK, BN] tile, `scale * q + min`; zero outside W.

    Loaded as the matrix-vector kernel loads it (one address per byte column or column quad, not
    per code), then laid out [BK, BN] for tl.dot: columns 8o + j (LUT) or 4c + j (int8)."""
    PACK: tl.constexpr = 4 if BITS == 8 else 8  # columns per byte column or quad
    c = k0 // PACK + tl.arange(0, BLOCK_K // PACK)[:, None]  # [BK / PACK, 1]
    tile, lane = rows[None, :] // 64, rows[None, :] % 64  # [1, BN]
    mask = (c < K // PACK) & (rows[None, :] < N)
    j = tl.arange(0, PACK)[None, :, None]
    if BITS == 8:  # int8 [T, K/4, 64, 4], or fields
        q = _int8_quads(data, high, codebook, c, tile, lane, mask, K, WIDTH, ZERO, CODEBOOK)
        q = tl.permute(q, (0, 2, 1)).to(tl.float32)  # [BC, 4, BN]
    else:  # uint8 [T, K/8, BITS, 64]
        planes = _packed_planes(data, (tile * (K // 8) + c) * (BITS * 64) + lane, mask, BITS)
        q = gather_bits(planes[:, None, :], j.to(tl.uint32)).to(tl.float32)  # [BO, 8, BN]
    scale, min_ = _block_params(scales, mins, sub_codes, sub_supers, rows, k0, N, K, GROUP, ZERO, MINS,
                                SUB_BITS, SUB_OFFSET, SUB_GPS, BLOCK_K)  # [BG, BN]
    w = _by_group(tl.reshape(q, (BLOCK_K, q.shape[2])), GROUP, BLOCK_K) * scale[:, None, :]
    if MINS != "none":
        w += min_[:, None, :]
    return tl.reshape(w, (BLOCK_K, w.shape[2]))


@triton.jit
def _dot(a, w, acc, F32: tl.constexpr):
    if F32:
        return tl.dot(a, w, acc, input_precision="tf32x3")
    return tl.dot(a, w.to(a.dtype), acc)


@triton.autotune(configs=MATMUL_CONFIGS,
                 key=["M_BUCKET", "N_OUT", "K", "BITS", "WIDTH", "GROUP", "CODEBOOK", "SUB_BITS", "SILU_MUL"])
@triton.jit
def matmul_kernel(x, data, high, scales, mins, codebook, sub_codes, sub_supers, out, M, N, N_OUT, K,
                  stride_x, M_BUCKET, GROUP: tl.constexpr, BITS: tl.constexpr, WIDTH: tl.constexpr,
                  ZERO: tl.constexpr, CODEBOOK: tl.constexpr, MINS: tl.constexpr, SUB_BITS: tl.constexpr,
                  SUB_OFFSET: tl.constexpr, SUB_GPS: tl.constexpr, SILU_MUL: tl.constexpr, F32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [M, N_OUT] in x's dtype. M_BUCKET (M rounded up to a power of two) only keys autotuning."""
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_mask = (tokens[:, None] < M) & (ks[None, :] < K)
        xt = tl.load(x + tokens[:, None] * stride_x + ks[None, :], mask=x_mask, other=0)  # [BM, BK]
        w = _dequantize(data, high, scales, mins, codebook, sub_codes, sub_supers, rows, k0, N, K, GROUP,
                        BITS, WIDTH, ZERO, CODEBOOK, MINS, SUB_BITS, SUB_OFFSET, SUB_GPS, BLOCK_K)  # [BK, BN]
        acc = _dot(xt, w, acc, F32)
        if SILU_MUL:
            up = _dequantize(data, high, scales, mins, codebook, sub_codes, sub_supers, rows + N_OUT, k0, N,
                             K, GROUP, BITS, WIDTH, ZERO, CODEBOOK, MINS, SUB_BITS, SUB_OFFSET, SUB_GPS,
                             BLOCK_K)
            acc_up = _dot(xt, up, acc_up, F32)
    if SILU_MUL:
        acc = silu(acc) * acc_up
    out_mask = (tokens[:, None] < M) & (rows[None, :] < N_OUT)
    tl.store(out + tokens[:, None] * N_OUT + rows[None, :], acc.to(out.dtype.element_ty), mask=out_mask)
