"""Plain torch references of every GPU kernel, on any device: obviously right, and the fallback.

Each reads the same packed bytes and cache layouts as its kernel and computes in float32; a
kernel must match its reference to float32 rounding (the order of the sums is all that differs:
the GPU kernels dequantize exactly, with no int8 activation tables as the CPU kernels use).

Legend: M tokens, N rows, K columns, G groups, T tiles of 64 rows; attention: T new tokens,
H query heads, KvH key/value heads, D head size, C cache capacity, R rotary size.
"""

import torch
import torch.nn.functional as F

from tierflow.cpu_kernels.packed import field_bits
from tierflow.cpu_kernels.torch_ops import attention_reference  # noqa: F401 (the CPU op's, on any device
from tierflow.gpu_kernels.packed import DeviceMatrix, DeviceSubScales


def codes(w: DeviceMatrix) -> torch.Tensor:
    """The codes q [N, K] as int32, undoing the layout (narrow codes less their zero, a codebook's
    entries for its indices)."""
    if w.bits != 8:
        shifts = torch.arange(8, device=w.device, dtype=torch.int32)
        bits = (w.data.to(torch.int32)[..., None] >> shifts) & 1  # [T, K/8, b, 64, 8]
        planes = torch.arange(w.bits, device=w.device, dtype=torch.int32)[:, None, None]
        q = (bits << planes).sum(dim=2)  # [T, K/8, 64, 8]
    elif w.codebook is not None:
        q = w.codebook[_field_quads(w.data, field_bits(w.width, codebook=True)).long()]  # [T, K/4, 64, 4]
    elif w.width < 8:
        field = field_bits(w.width)
        q = _field_quads(w.data, field)
        if w.high is not None:
            q |= _high_bits(w.high, w.width - field) << field
        q -= w.zero
    else:
        q = w.data  # [T, K/4, 64, 4]
    return q.permute(0, 2, 1, 3).reshape(-1, w.cols)[: w.rows].to(torch.int32)


def _field_quads(data: torch.Tensor, field: int) -> torch.Tensor:
    """Bytes of `field`-bit fields [T, K*f/32, 64, 4] -> int32 quads [T, K/4, 64, 4]: byte column o
    holds quad (8 / f) * o + i at bits f*i .. f*i + f - 1."""
    shifts = field * torch.arange(8 // field, device=data.device, dtype=torch.int32)[:, None, None]
    quads = (data.to(torch.int32)[:, :, None] >> shifts) & ((1 << field) - 1)  # [T, K*f/32, 8/f, 64, 4]
    return quads.reshape(data.shape[0], -1, *data.shape[2:])


def _high_bits(high: torch.Tensor, h: int) -> torch.Tensor:
    """High bytes [T, K*h/32, 64, 4] -> each quad's h high bits [T, K/4, 64, 4]: byte b holds quad
    (8 / h) * b + i at bits h*i .. h*i + h - 1."""
    shifts = h * torch.arange(8 // h, device=high.device, dtype=torch.int32)[:, None, None]
    bits = (high.to(torch.int32)[:, :, None] >> shifts) & ((1 << h) - 1)  # [T, K*h/32, 8/h, 64, 4]
    return bits.reshape(high.shape[0], -1, *high.shape[2:])


def group_params(w: DeviceMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scales and mins [N, K], each repeated over its group (mins zero where absent, the
    zero code's where LUT codes have one): PackedMatrix.group_params(), per column."""
    def per_column(params: torch.Tensor) -> torch.Tensor:
        rows = params.permute(0, 2, 1).reshape(-1, w.cols // w.group)[: w.rows]  # [N, G]
        return rows.repeat_interleave(w.group, dim=1)

    if w.sub is not None:
        scales, mins = _sub_params(w.sub)
    else:
        scales, mins = w.scales.float(), None if w.mins is None else w.mins.float()
    if w.min_form == "zero":
        mins = scales * float(-w.zero)
    elif mins is None:
        mins = torch.zeros_like(scales)
    return per_column(scales), per_column(mins)


def _sub_params(sub: DeviceSubScales) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Two-level scales -> float32 scales and mins [T, G, 64] (mins None without min codes):
    d * (code - offset) and -(dmin * min code), one float32 rounding each, as ggml's."""
    halves = 2 if sub.with_mins else 1
    values = sub.groups_per_super * halves  # V codes per row and super block
    codes = sub.codes.to(torch.int32)  # [T, S', B, 64]
    tiles, supers = codes.shape[:2]
    if sub.bits == 8:
        v = codes
    else:
        low = codes[:, :, : values // 2]  # [T, S', V/2, 64]
        v = torch.stack([low & 0x0F, low >> 4], dim=3).reshape(tiles, supers, values, -1)
        if sub.bits == 6:
            top = codes[:, :, values // 2:, None]  # [T, S', V/4, 1, 64]
            shifts = 2 * torch.arange(4, device=codes.device, dtype=torch.int32)[:, None]
            v = v | (((top >> shifts) & 3) << 4).reshape(v.shape)
    v = v.reshape(tiles, supers, sub.groups_per_super, halves, -1).float()  # [T, S', gps, 1 or 2, 64]
    merge = lambda a: a.reshape(tiles, -1, a.shape[-1])  # noqa: E731  [T, S', gps, 64] -> [T, G, 64]
    supers_f32 = sub.supers.float()[:, :, :, None]  # [T, S', 1 or 2, 1, 64]
    scales = merge(supers_f32[:, :, 0] * (v[:, :, :, 0] - sub.offset))
    return scales, merge(-(supers_f32[:, :, 1] * v[:, :, :, 1])) if sub.with_mins else None


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
