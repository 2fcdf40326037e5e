"""The Python face of the C kernels: `matmul` on packed matrices, and the thread and ISA knobs."""

import numpy as np

from tierflow.cpu_kernels import _kernels
from tierflow.cpu_kernels.packed import PackedMatrix

set_threads = _kernels.set_threads
threads = _kernels.threads
isa = _kernels.isa
set_isa = _kernels.set_isa
supported_isas = _kernels.supported_isas


def matmul(w: PackedMatrix, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] float32 @ W.T -> [M, N] float32 (written into `out` when given)."""
    if out is None:
        out = np.empty((x.shape[0] if x.ndim == 2 else 0, w.rows), np.float32)
    _kernels.matmul(w.bits, w.group, w.rows, w.data, w.scales, w.mins, x, out, codebook=w.codebook_id)
    return out
