"""Triton kernels: dequantize-and-multiply straight from the packed layout (see packed.py).

Legend: M tokens, N rows of W, K columns, T tiles of 64 rows; BM, BN, BK block sizes; BO = BK / 8
LUT byte columns, BC = BK / 4 int8 column quads. Rows are the fast axis of every tile: the 64 rows
of a tile are contiguous in both layouts, so a warp's loads coalesce.

- `matvec_kernel` (decode, M <= 4): one token and BN rows per program, the K range optionally
  split over programs (split-K) so that a short, wide matrix still fills the GPU; partial sums
  go to a [splits, M, N] workspace the launcher adds up in a fixed order (no atomics). It never
  builds a [BK, BN] tile of codes (per-element addresses would spill registers): a LUT program
  loads each byte of a [BO, BN] block once per bit plane, packs the planes of a byte column into
  one uint32 (plane p in byte p), and gets the codes of its 8 columns with two shifts, a mask and
  a multiply each (`gather_bits`); an int8 program loads [BC, BN, 4], four codes per load (with
  NIBBLES, four 4-bit indices into the 16 codes at `codebook`, looked up there). Scales
  and mins apply per byte column (a group holds whole byte columns): `s * sum(q x) + m * sum(x)`.
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
                      for n, k, w in [(32, 128, 2), (32, 256, 4), (64, 128, 4), (64, 256, 4), (64, 256, 8),
                                      (128, 128, 4), (128, 256, 8)]]
    MATMUL_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                      for m, n, k, w, s in [(16, 64, 64, 4, 3), (32, 64, 64, 4, 3), (32, 128, 32, 4, 4),
                                            (64, 64, 32, 4, 4), (64, 128, 32, 8, 3), (128, 128, 32, 8, 3)]]
SPLIT_ALIGN = 32 if INTERPRETED else 256  # a split's K range is a multiple of every BLOCK_K above


def fitting_configs(configs: list, named_args: dict, **kwargs) -> list:
    """Matrix-vector configs that do not spill registers (ptxas, sm_90): at most 64 weights per
    thread, or 128 for a LUT matrix without the SiLU epilogue (one uint32 per 8 weights); a
    codebook's indices with the SiLU epilogue (gate and up codes looked up) also BLOCK_K <= 128."""
    args = {**named_args, **kwargs}
    limit = 128 if args.get("BITS") != 8 and not args.get("SILU_MUL") else 64
    max_k = 128 if args.get("NIBBLES") and args.get("SILU_MUL") else None
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
def _lut_dot(data, scales, mins, x_row, rows, k0, N, K, GROUP: tl.constexpr, BITS: tl.constexpr,
             HAS_MINS: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over k in k0 .. k0 + BK of W[rows, k] x[k], as [BO, BN] partial sums; uint8 [T, K/8, BITS, 64]."""
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
    params = (tile * (K // GROUP) + o * 8 // GROUP) * 64 + lane  # float16 [T, G, 64]
    part = dot * tl.load(scales + params, mask=mask, other=0).to(tl.float32)
    if HAS_MINS:
        part += tl.load(mins + params, mask=mask, other=0).to(tl.float32) * x_sum
    return part


@triton.jit
def _int8_quads(data, codebook, c, tile, lane, mask, K, NIBBLES: tl.constexpr):
    """The codes of column quads c [BC, 1] of rows (tile, lane) [1, BN]: [BC, BN, 4]. int8
    [T, K/4, 64, 4], or with NIBBLES uint8 [T, K/8, 64, 4], quad c in the low nibbles (c even) or
    the high nibbles (c odd) of byte column c // 2, each an index into the 16 codes at `codebook`."""
    quad = tl.arange(0, 4)
    if NIBBLES:
        byte_at = (tile * (K // 8) + c // 2) * 256 + lane * 4  # [BC, BN]
        nibbles = tl.load(data + byte_at[:, :, None] + quad, mask=mask[:, :, None], other=0).to(tl.int32)
        index = (nibbles >> (4 * (c % 2))[:, :, None]) & 0x0F
        q = tl.load(codebook + index)
    else:
        quad_at = (tile * (K // 4) + c) * 256 + lane * 4  # [BC, BN]
        q = tl.load(data + quad_at[:, :, None] + quad, mask=mask[:, :, None], other=0)
    return q


@triton.jit
def _int8_dot(data, scales, mins, codebook, x_row, rows, k0, N, K, GROUP: tl.constexpr,
              HAS_MINS: tl.constexpr, NIBBLES: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over k in k0 .. k0 + BK of W[rows, k] x[k], as [BC, BN] partial sums (int8 layout, or nibbles)."""
    c = k0 // 4 + tl.arange(0, BLOCK_K // 4)[:, None]  # [BC, 1] column quads
    tile, lane = rows[None, :] // 64, rows[None, :] % 64  # [1, BN]
    quad = tl.arange(0, 4)
    mask = (c < K // 4) & (rows[None, :] < N)
    q = _int8_quads(data, codebook, c, tile, lane, mask, K, NIBBLES)  # [BC, BN, 4]
    x4 = tl.load(x_row + c * 4 + quad[None, :], mask=c < K // 4, other=0).to(tl.float32)  # [BC, 4]
    dot = tl.sum(q.to(tl.float32) * x4[:, None, :], axis=2)
    params = (tile * (K // GROUP) + c * 4 // GROUP) * 64 + lane
    part = dot * tl.load(scales + params, mask=mask, other=0).to(tl.float32)
    if HAS_MINS:
        part += tl.load(mins + params, mask=mask, other=0).to(tl.float32) * tl.sum(x4, axis=1)[:, None]
    return part


@triton.jit
def _row_dot(data, scales, mins, codebook, x_row, rows, k0, N, K, GROUP: tl.constexpr, BITS: tl.constexpr,
             HAS_MINS: tl.constexpr, NIBBLES: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over k in k0 .. k0 + BK of W[rows, k] x[k]: [BN]."""
    if BITS == 8:
        part = _int8_dot(data, scales, mins, codebook, x_row, rows, k0, N, K, GROUP, HAS_MINS, NIBBLES,
                         BLOCK_K)
    else:
        part = _lut_dot(data, scales, mins, x_row, rows, k0, N, K, GROUP, BITS, HAS_MINS, BLOCK_K)
    return tl.sum(part, axis=0)


@triton.jit
def silu(x):
    """x * sigmoid(x), with e^-|x| so that nothing overflows."""
    e = tl.exp(-tl.abs(x))
    return x * tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.autotune(configs=MATVEC_CONFIGS,
                 key=["N_OUT", "K", "BITS", "GROUP", "NIBBLES", "SPLIT_K", "SILU_MUL"],
                 prune_configs_by={"early_config_prune": fitting_configs})
@triton.jit
def matvec_kernel(x, data, scales, mins, codebook, out, M, N, N_OUT, K, stride_x, K_PER_SPLIT,
                  GROUP: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr, NIBBLES: tl.constexpr,
                  SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """out [SPLIT_K, M, N_OUT] (float32 partials) or [M, N_OUT] (x's dtype, SPLIT_K == 1)."""
    block_n, split, token = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = block_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    x_row = x + token * stride_x
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        acc += _row_dot(data, scales, mins, codebook, x_row, rows, k0, N, K, GROUP, BITS, HAS_MINS, NIBBLES,
                        BLOCK_K)
        if SILU_MUL:  # the up rows of these gate rows
            up_rows = rows + N_OUT
            acc_up += _row_dot(data, scales, mins, codebook, x_row, up_rows, k0, N, K, GROUP, BITS, HAS_MINS,
                               NIBBLES, BLOCK_K)
    if SILU_MUL:
        acc = silu(acc) * acc_up
    out_at = out + (split * M + token) * N_OUT + rows
    tl.store(out_at, acc.to(out.dtype.element_ty), mask=rows < N_OUT)


@triton.jit
def _dequantize(data, scales, mins, codebook, rows, k0, N, K, GROUP: tl.constexpr, BITS: tl.constexpr,
                HAS_MINS: tl.constexpr, NIBBLES: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rows, k0 .. k0 + BK] as a float32 [BK, BN] tile, `scale * q + min`; zero outside W.

    Loaded as the matrix-vector kernel loads it (one address per byte column or column quad, not
    per code), then laid out [BK, BN] for tl.dot: columns 8o + j (LUT) or 4c + j (int8)."""
    PACK: tl.constexpr = 4 if BITS == 8 else 8  # columns per byte column or quad
    c = k0 // PACK + tl.arange(0, BLOCK_K // PACK)[:, None]  # [BK / PACK, 1]
    tile, lane = rows[None, :] // 64, rows[None, :] % 64  # [1, BN]
    mask = (c < K // PACK) & (rows[None, :] < N)
    j = tl.arange(0, PACK)[None, :, None]
    if BITS == 8:  # int8 [T, K/4, 64, 4], or nibbles
        q = _int8_quads(data, codebook, c, tile, lane, mask, K, NIBBLES)
        q = tl.permute(q, (0, 2, 1)).to(tl.float32)  # [BC, 4, BN]
    else:  # uint8 [T, K/8, BITS, 64]
        planes = _packed_planes(data, (tile * (K // 8) + c) * (BITS * 64) + lane, mask, BITS)
        q = gather_bits(planes[:, None, :], j.to(tl.uint32)).to(tl.float32)  # [BO, 8, BN]
    params = (tile * (K // GROUP) + c * PACK // GROUP) * 64 + lane  # float16 [T, G, 64]
    w = q * tl.load(scales + params, mask=mask, other=0).to(tl.float32)[:, None, :]
    if HAS_MINS:
        w += tl.load(mins + params, mask=mask, other=0).to(tl.float32)[:, None, :]
    return tl.reshape(w, (BLOCK_K, w.shape[2]))


@triton.jit
def _dot(a, w, acc, F32: tl.constexpr):
    if F32:
        return tl.dot(a, w, acc, input_precision="tf32x3")
    return tl.dot(a, w.to(a.dtype), acc)


@triton.autotune(configs=MATMUL_CONFIGS,
                 key=["M_BUCKET", "N_OUT", "K", "BITS", "GROUP", "NIBBLES", "SILU_MUL"])
@triton.jit
def matmul_kernel(x, data, scales, mins, codebook, out, M, N, N_OUT, K, stride_x, M_BUCKET,
                  GROUP: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr, NIBBLES: tl.constexpr,
                  SILU_MUL: tl.constexpr, F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """out [M, N_OUT] in x's dtype. M_BUCKET (M rounded up to a power of two) only keys autotuning."""
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_mask = (tokens[:, None] < M) & (ks[None, :] < K)
        xt = tl.load(x + tokens[:, None] * stride_x + ks[None, :], mask=x_mask, other=0)  # [BM, BK]
        w = _dequantize(data, scales, mins, codebook, rows, k0, N, K, GROUP, BITS, HAS_MINS, NIBBLES,
                        BLOCK_K)  # [BK, BN]
        acc = _dot(xt, w, acc, F32)
        if SILU_MUL:
            up = _dequantize(data, scales, mins, codebook, rows + N_OUT, k0, N, K, GROUP, BITS, HAS_MINS,
                             NIBBLES, BLOCK_K)
            acc_up = _dot(xt, up, acc_up, F32)
    if SILU_MUL:
        acc = silu(acc) * acc_up
    out_mask = (tokens[:, None] < M) & (rows[None, :] < N_OUT)
    tl.store(out + tokens[:, None] * N_OUT + rows[None, :], acc.to(out.dtype.element_ty), mask=out_mask)
