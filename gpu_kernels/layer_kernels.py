"""TritonKernels: the decoder's per-layer operations (runtime.compute.interfaces.Kernels) on one device.

A layer placed on the GPU tier is computed by these: its weights are DeviceLinears viewing the
layer's uploaded bytes, its KV cache lives on the device, and the hidden state arrives once per
layer through `take` (a host-to-device copy at the CPU/GPU boundary, nothing when it is already
there). On CUDA that is the GPU; under TRITON_INTERPRET=1 it is the CPU standing in for one, which
runs the same launchers in Triton's interpreter (how the engine's GPU path is tested here).
"""

import numpy as np
import torch

from tierflow.cpu_kernels.torch_ops import attention_reference, swiglu_oai_reference, weighted_rows_reference
from tierflow.gpu_kernels import attention, matmul, ops
from tierflow.gpu_kernels.matmul import DeviceLinear


class TritonKernels:
    def __init__(self, device: torch.device):
        self.device = device

    def take(self, x: np.ndarray | torch.Tensor) -> torch.Tensor:
        return (torch.from_numpy(x) if isinstance(x, np.ndarray) else x).to(self.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        return ops.add_rms_norm(residual, x, weight, eps)

    def gated_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float
                       ) -> torch.Tensor:
        return ops.rms_norm(x, weight, eps) * torch.nn.functional.silu(gate)

    def swiglu(self, gate_up, x: torch.Tensor) -> torch.Tensor:
        """One pass over [gate; up] with the SwiGLU epilogue when it is one packed matrix."""
        if isinstance(gate_up, DeviceLinear) and gate_up.bias is None and not isinstance(gate_up.matrix,
                                                                                        torch.Tensor):
            return matmul.matmul_silu_mul(gate_up.matrix, x)
        return ops.silu_mul(gate_up(x))

    def linear_each(self, linears, xs) -> list[torch.Tensor]:
        return [linear(x) for linear, x in zip(linears, xs, strict=True)]

    def swiglu_each(self, gate_ups, xs) -> list[torch.Tensor]:
        return [self.swiglu(gate_up, x) for gate_up, x in zip(gate_ups, xs, strict=True)]

    def swiglu_oai_each(self, gate_ups, xs) -> list[torch.Tensor]:
        return [swiglu_oai_reference(gate_up(x)) for gate_up, x in zip(gate_ups, xs, strict=True)]

    def combine_experts(self, outputs, picks: np.ndarray, weights) -> torch.Tensor:
        rows = torch.cat([self.take(y) for y in outputs])
        return weighted_rows_reference(rows, self.take(picks), self.take(weights))

    def attention(self, qkv, keys, values, cos, sin, heads: int, start: int, neox: bool,
                  parents: np.ndarray | None, tree_start: int | None, window: int = 0,
                  scale: float | None = None, softcap: float = 0.0, held_from: int = 0,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The fused kernel; a token tree (a verify pass) takes the torch path, which masks it."""
        if parents is None:
            return attention.attention(qkv, keys, values, cos, sin, heads, start, neox, window=window,
                                       scale=scale, softcap=softcap, held_from=held_from, sinks=sinks)
        return attention_reference(qkv, keys, values, cos, sin, heads, start, neox, parents, tree_start,
                                   window, scale, softcap, held_from, sinks)
