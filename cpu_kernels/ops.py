"""The fused per-layer operations of the C extension, on torch tensors.

Each is one C call doing what several torch operations would (see csrc/ops.c for why): the
arithmetic is the same float32 math as the torch formulation in the docstrings.
"""

import torch

from tierflow.cpu_kernels import _kernels


def _floats(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, for x [T, E]."""
    x = _floats(x)
    out = torch.empty_like(x)
    _kernels.rms_norm(x.numpy(), weight.numpy(), eps, out.numpy())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2F] = [gate, up] -> [T, F]."""
    gate_up = _floats(gate_up)
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _kernels.silu_mul(gate_up.numpy(), out.numpy())
    return out


def attention(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, heads: int, start: int, neox: bool) -> torch.Tensor:
    """Causal attention of T new tokens at positions start .. start + T - 1.

    qkv [T, (H + 2K) * D] (rotated in place); keys [K, D, C] (transposed) and values [K, C, D],
    one layer's cache, into which the tokens' keys and values are written; cos, sin [T, R/2]. Token i sees cache positions
    0 .. start + i; query head h uses key/value head h // (H / K). Returns [T, H * D].
    """
    head_dim = values.shape[-1]
    out = torch.empty(qkv.shape[0], heads * head_dim)
    _kernels.attention(_floats(qkv).numpy(), keys.numpy(), values.numpy(), cos.numpy(), sin.numpy(),
                       out.numpy(), heads, start, 2 * cos.shape[-1], neox, head_dim**-0.5)
    return out
