"""Launchers of the per-layer operations: `rms_norm`, `add_rms_norm` and `silu_mul`.

The same operations as cpu_kernels.ops, on device tensors (float32, float16 or bfloat16; computed
in float32). Legend: M tokens, E features, F feed-forward size.
"""

import torch

from tierflow.gpu_kernels.launch import (
    ACTIVATION_DTYPES,
    cdiv,
    check_device,
    check_tensor,
    load_kernels,
    power_of_two,
)

MAX_FEATURES = 1 << 16  # one row is one block of registers
SILU_BLOCK = 1024


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight for x [M, E] -> [M, E]."""
    return _norm(x, None, weight, eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place), then rms_norm(residual): one pass for the residual add and the
    next sublayer's norm (residual, x [M, E] -> [M, E])."""
    return _norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [M, 2F] = [gate, up] -> [M, F]."""
    kernels = load_kernels("ops_kernels")
    check_tensor("gate_up", gate_up, ACTIVATION_DTYPES, (None, None))
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even width, not {gate_up.shape[1]}")
    check_device(kernels, gate_up=gate_up)
    tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        kernels.silu_mul_kernel[(tokens, cdiv(size, SILU_BLOCK))](gate_up, out, size, BLOCK_F=SILU_BLOCK)
    return out


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    kernels = load_kernels("ops_kernels")
    check_tensor("x", x, ACTIVATION_DTYPES, (None, None))
    features = x.shape[1]
    if not 0 < features <= MAX_FEATURES:
        raise ValueError(f"rms_norm handles 1 .. {MAX_FEATURES} features, not {features}")
    check_tensor("weight", weight, ACTIVATION_DTYPES, (features,))
    if residual is not None:
        check_tensor("residual", residual, (x.dtype,), tuple(x.shape))
    check_device(kernels, x=x, residual=residual, weight=weight)
    out = torch.empty_like(x)
    if x.shape[0]:
        block = power_of_two(features)
        kernels.rms_norm_kernel[(x.shape[0],)](x, x if residual is None else residual, weight, out, features,
                                               float(eps), HAS_RESIDUAL=residual is not None, BLOCK_E=block,
                                               num_warps=min(16, max(1, block // 512)))
    return out
