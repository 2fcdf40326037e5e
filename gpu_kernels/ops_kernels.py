"""Triton kernels of the small per-layer operations: RMSNorm (with its residual add) and SiLU * up.

Legend: M rows (tokens), E features, F = half the gate/up width. One program per row (and, for
silu_mul, per block of F): a row of E <= 65536 floats fits one block, so the sum of squares is one
reduction in registers, computed in float32.
"""

import triton
import triton.language as tl

from tierflow.gpu_kernels.launch import interpreting
from tierflow.gpu_kernels.matmul_kernels import silu

INTERPRETED = interpreting()


@triton.jit
def rms_norm_kernel(x, residual, weight, out, E, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_E: tl.constexpr):
    """out[m] = h * rsqrt(mean(h^2) + eps) * weight with h = x[m] (+ residual[m], written back to
    residual: the stream's update and the next layer's input in one pass)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < E
    h = tl.load(x + row * E + cols, mask=mask, other=0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual + row * E + cols, mask=mask, other=0).to(tl.float32)
        h = h.to(residual.dtype.element_ty)  # normalise exactly what the stream now holds
        tl.store(residual + row * E + cols, h, mask=mask)
        h = h.to(tl.float32)
    inverse = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(h * h, axis=0) / E + eps))  # IEEE-rounded, as the CPU
    w = tl.load(weight + cols, mask=mask, other=0).to(tl.float32)
    tl.store(out + row * E + cols, (h * inverse * w).to(out.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(gate_up, out, F, BLOCK_F: tl.constexpr):
    """out [M, F] = silu(gate_up[:, :F]) * gate_up[:, F:]."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < F
    gate = tl.load(gate_up + row * 2 * F + cols, mask=mask, other=0).to(tl.float32)
    up = tl.load(gate_up + row * 2 * F + F + cols, mask=mask, other=0).to(tl.float32)
    tl.store(out + row * F + cols, (silu(gate) * up).to(out.dtype.element_ty), mask=mask)
