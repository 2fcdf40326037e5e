"""Plain torch references of every GPU kernel, on any device: obviously right, and the fallback.

Each reads the same packed bytes and cache layouts as its kernel and computes in float32; a
kernel must match its reference to float32 rounding (the order of the sums is all that differs:
the GPU kernels dequantize exactly, with no int8 activation tables as the CPU kernels use).

Legend: M tokens, N rows, K columns, G groups, T tiles of 64 rows; attention: T new tokens,
H query heads, KvH key/value heads, D head size, C cache capacity, R rotary size.
"""

import torch
import torch.nn.functional as F

from tierflow.cpu_kernels.reference import attention_reference  # noqa: F401 (the CPU op's, on any device)
from tierflow.gpu_kernels.packed import DeviceMatrix


def codes(w: DeviceMatrix) -> torch.Tensor:
    """The codes q [N, K] as int32, undoing the layout."""
    if w.codebook is not None:
        indices = torch.stack([w.data & 0x0F, w.data >> 4], dim=2).long()  # [T, K/8, 2, 64, 4]
        q = w.codebook[indices].permute(0, 3, 1, 2, 4)  # [T, 64, K/8, 2, 4]
    elif w.bits == 8:
        q = w.data.permute(0, 2, 1, 3)  # [T, 64, K/4, 4]
    else:
        shifts = torch.arange(8, device=w.device, dtype=torch.int32)
        bits = (w.data.to(torch.int32)[..., None] >> shifts) & 1  # [T, K/8, b, 64, 8]
        planes = torch.arange(w.bits, device=w.device, dtype=torch.int32)[:, None, None]
        q = (bits << planes).sum(dim=2).permute(0, 2, 1, 3)  # [T, 64, K/8, 8]
    return q.reshape(-1, w.cols)[: w.rows].to(torch.int32)


def group_params(w: DeviceMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scales and mins [N, K], each repeated over its group (mins zero where absent)."""
    def per_column(params: torch.Tensor) -> torch.Tensor:
        rows = params.permute(0, 2, 1).reshape(-1, w.cols // w.group)[: w.rows]  # [N, G]
        return rows.float().repeat_interleave(w.group, dim=1)

    scales = per_column(w.scales)
    return scales, (torch.zeros_like(scales) if w.mins is None else per_column(w.mins))


def dequantize(w: DeviceMatrix) -> torch.Tensor:
    """The float32 weights [N, K]: scale * q + min."""
    scales, mins = group_params(w)
    return codes(w).float() * scales + mins


def matmul_reference(w: DeviceMatrix, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N], in x's dtype (computed in float32)."""
    return (x.float() @ dequantize(w).T).to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [M, 2F] -> [M, F]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def matmul_silu_mul_reference(w: DeviceMatrix, x: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for w = [gate; up] [2F, K] -> [M, F]."""
    gate_up = x.float() @ dequantize(w).T
    return silu_mul_reference(gate_up).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, per row of x [M, E]."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm_reference(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the next sublayer's input and the updated stream."""
    total = (residual.float() + x.float()).to(residual.dtype)
    return rms_norm_reference(total, weight, eps), total
