"""A packed matrix as a torch linear layer: y = x @ W.T (+ bias), computed by the C kernels."""

import torch

from tierflow.cpu_kernels import _kernels
from tierflow.cpu_kernels.packed import PackedMatrix


class PackedLinear:
    def __init__(self, matrix: PackedMatrix, bias: torch.Tensor | None = None):
        self.matrix = matrix
        self.bias = bias
        self.out_features, self.in_features = matrix.rows, matrix.cols
        self.nbytes = matrix.nbytes + (0 if bias is None else bias.numel() * bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] float32 -> [..., N]."""
        rows = x.detach().reshape(-1, self.in_features)
        if not rows.is_contiguous() or rows.dtype != torch.float32:
            rows = rows.contiguous().float()
        out = torch.empty(rows.shape[0], self.out_features)
        m = self.matrix
        _kernels.matmul(m.bits, m.group, m.rows, m.data, m.scales, m.mins, rows.numpy(), out.numpy())
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)
