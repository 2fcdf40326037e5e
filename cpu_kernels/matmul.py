"""The Python face of the C kernels: `matmul` on packed matrices, and the thread and ISA knobs."""

from collections.abc import Sequence

import numpy as np

from tierflow.cpu_kernels import _kernels
from tierflow.cpu_kernels.packed import PackedMatrix

set_threads = _kernels.set_threads
threads = _kernels.threads
isa = _kernels.isa
set_isa = _kernels.set_isa
supported_isas = _kernels.supported_isas


def matmul_into(w: PackedMatrix, x: np.ndarray, out: np.ndarray) -> None:
    """out[M, N] = x [M, K] float32 @ W.T, every form of the packed layout passed to the C kernel."""
    _kernels.matmul(*_arguments(w, x, out))


def matmul_each(products: Sequence[tuple[PackedMatrix, np.ndarray, np.ndarray]]) -> None:
    """matmul_into(w, x, out) for each (w, x, out), in one pass of the kernels' threads: many small
    products (a MoE layer's experts) cost what their bytes do, not one wait for the threads each."""
    _kernels.matmul_many([(_arguments(*product), None) for product in products])


def _arguments(w: PackedMatrix, x: np.ndarray, out: np.ndarray) -> tuple:
    before, after = w.kernel_arguments
    return (*before, x, out, False, *after)


def matmul(w: PackedMatrix, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] float32 @ W.T -> [M, N] float32 (written into `out` when given)."""
    if out is None:
        out = np.empty((x.shape[0] if x.ndim == 2 else 0, w.rows), np.float32)
    matmul_into(w, x, out)
    return out
