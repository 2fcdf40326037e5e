"""A packed matrix as a linear layer: y = x @ W.T (+ bias), computed by the C kernels."""

from collections.abc import Callable, Sequence

import numpy as np

from tierflow.cpu_kernels.matmul import matmul_each, matmul_into
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


def linear_each(linears: Sequence[Callable[[np.ndarray], np.ndarray]], xs: Sequence[np.ndarray]
                ) -> list[np.ndarray]:
    """[linear(x) for each linear and its x], the PackedLinears' products in one call of the kernels
    (the others one by one): the same numbers, with one wait for the threads instead of one each."""
    outs: list[np.ndarray | None] = [None] * len(linears)
    products = []
    for i, (linear, x) in enumerate(zip(linears, xs, strict=True)):
        if isinstance(linear, PackedLinear):
            outs[i] = np.empty((x.shape[0], linear.out_features), np.float32)
            products.append((linear.matrix, x, outs[i]))
        else:
            outs[i] = linear(x)
    if products:
        matmul_each(products)
    for linear, out in zip(linears, outs):
        if isinstance(linear, PackedLinear) and linear.bias is not None:
            out += linear.bias
    return outs
