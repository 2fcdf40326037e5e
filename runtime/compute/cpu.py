"""The CPU's kernels as the decoder calls them: the C extension's fused operations, and a float32
matmul for the few tokens of a step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from tierflow.cpu_kernels import ops
from tierflow.cpu_kernels.linear import linear_each

if TYPE_CHECKING:
    from tierflow.runtime.compute.interfaces import Activations, Linear


class CpuKernels:
    """The C extension's fused operations, on float32 numpy arrays."""

    def take(self, x: Activations) -> np.ndarray:
        return x if isinstance(x, np.ndarray) else x.cpu().numpy()

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        residual += x
        return ops.rms_norm(residual, weight, eps)

    def gated_rms_norm(self, x: np.ndarray, weight: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
        return ops.gated_rms_norm(np.ascontiguousarray(x), weight, np.ascontiguousarray(gate), eps)

    def swiglu(self, gate_up: Linear, x: np.ndarray) -> np.ndarray:
        return ops.silu_mul(gate_up(x))

    def linear_each(self, linears: Sequence[Linear], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        return linear_each(linears, xs)

    def swiglu_each(self, gate_ups: Sequence[Linear], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [ops.silu_mul(h) for h in linear_each(gate_ups, xs)]

    def swiglu_oai_each(self, gate_ups: Sequence[Linear], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [ops.swiglu_oai(h) for h in linear_each(gate_ups, xs)]

    def combine_experts(self, outputs: Sequence[Activations], picks: np.ndarray, weights: Activations
                        ) -> np.ndarray:
        rows = self.take(outputs[0]) if len(outputs) == 1 else np.concatenate([self.take(y) for y in outputs])
        return ops.weighted_rows(rows, picks, np.ascontiguousarray(self.take(weights), np.float32))

    def attention(self, qkv, keys, values, cos, sin, heads, start, neox, parents, tree_start, window=0,
                  scale=None, softcap=0.0, held_from=0, sinks=None) -> np.ndarray:
        return ops.attention(qkv, keys, values, cos, sin, heads, start, neox, parents, tree_start, window,
                             scale, softcap, held_from, sinks)


CPU_KERNELS = CpuKernels()


DENSE_KERNEL_TOKENS = 16  # DenseLinear computes up to this many rows in the C kernels, more in torch


class DenseLinear:
    """A float32 weight [out, in] (and bias) as a Linear: a few tokens (decode steps, small verify
    passes) by the C kernels' dense_matmul, on their threads and with the bits of one token at a time,
    larger batches by torch's GEMM."""

    def __init__(self, weight: torch.Tensor, bias: np.ndarray | None = None):
        self.weight = weight
        self.bias = bias
        self.nbytes = 4 * (weight.numel() + (0 if bias is None else bias.size))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] <= DENSE_KERNEL_TOKENS:
            return ops.dense_matmul(np.ascontiguousarray(x), self.weight.numpy(), self.bias)
        bias = None if self.bias is None else torch.from_numpy(self.bias)
        return F.linear(torch.from_numpy(x), self.weight, bias).numpy()
