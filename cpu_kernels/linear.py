"""A packed matrix as a linear layer: y = x @ W.T (+ bias), computed by the C kernels."""

import numpy as np

from tierflow.cpu_kernels.matmul import matmul_into
from tierflow.cpu_kernels.packed import PackedMatrix


class PackedLinear:
    def __init__(self, matrix: PackedMatrix, bias: np.ndarray | None = None):
        self.matrix = matrix
        self.bias = bias
        self.out_features, self.in_features = matrix.rows, matrix.cols
        self.nbytes = matrix.nbytes + (0 if bias is None else bias.nbytes)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [T, K] float32, C-contiguous -> [T, N]."""
        out = np.empty((x.shape[0], self.out_features), np.float32)
        matmul_into(self.matrix, x, out)
        if self.bias is not None:
            out += self.bias
        return out
