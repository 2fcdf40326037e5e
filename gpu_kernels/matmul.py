"""Launchers of the dequantize-and-multiply kernels: `matmul`, `matmul_silu_mul` and `DeviceLinear`.

Legend: M tokens, N rows of W, K columns, F = N / 2 (gate and up rows). Decode (M <= 4) runs the
matrix-vector kernel, split over K when the rows alone leave most of the GPU idle; longer inputs
run the tensor-core kernel (see matmul_kernels.py). Every layout and shape rule is checked here,
before a launch, so a bad call is a Python error naming the problem, never a fault in a kernel.
"""

import torch

from tierflow.gpu_kernels.launch import (
    ACTIVATION_DTYPES,
    cdiv,
    check_device,
    check_tensor,
    load_kernels,
    num_sms,
    power_of_two,
)
from tierflow.gpu_kernels.packed import DeviceMatrix

DECODE_MAX_TOKENS = 4  # up to this many tokens, one matrix-vector program per token and row block
ROWS_PER_PROGRAM = 64  # a typical BLOCK_N, to size the split
MIN_SPLIT_COLUMNS = 512  # a split shorter than this spends more on its partial sums than it saves


def matmul(w: DeviceMatrix, x: torch.Tensor, out: torch.Tensor | None = None,
           split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype (written into `out` when given).

    split_k (decode only) fixes the number of K splits; by default it is chosen to fill the GPU.
    """
    return _launch(w, x, out, split_k, silu_mul=False)


def matmul_silu_mul(w: DeviceMatrix, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) -> [M, F] for W = [gate; up] [2F, K], in one pass over W."""
    if w.rows % 2:
        raise ValueError(f"a gate and up matrix has an even number of rows, not {w.rows}")
    return _launch(w, x, out, 1, silu_mul=True)


class DeviceLinear:
    """A weight on the device (and a bias) as a layer: y = x @ W.T + bias. W is a packed matrix,
    multiplied by the kernels here, or a float32 tensor [N, K] (a model stored unquantized),
    multiplied by torch."""

    def __init__(self, matrix: DeviceMatrix | torch.Tensor, bias: torch.Tensor | None = None):
        if isinstance(matrix, torch.Tensor):
            check_tensor("weight", matrix, (torch.float32,), (None, None))
            (self.out_features, self.in_features), nbytes = matrix.shape, 4 * matrix.numel()
        else:
            self.out_features, self.in_features, nbytes = matrix.rows, matrix.cols, matrix.nbytes
        if bias is not None:
            check_tensor("bias", bias, (torch.float32,), (self.out_features,))
        self.matrix, self.bias = matrix, bias
        self.nbytes = nbytes + (0 if bias is None else 4 * bias.numel())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N]."""
        if isinstance(self.matrix, torch.Tensor):
            out = x @ self.matrix.T.to(x.dtype)
        else:
            out = matmul(self.matrix, x)
        return out if self.bias is None else out.add_(self.bias.to(out.dtype))


def _launch(w: DeviceMatrix, x: torch.Tensor, out: torch.Tensor | None, split_k: int | None,
            silu_mul: bool) -> torch.Tensor:
    kernels = load_kernels("matmul_kernels")
    if not isinstance(w, DeviceMatrix):
        raise TypeError(f"w must be a DeviceMatrix (gpu_kernels.packed.to_device), not {type(w).__name__}")
    check_tensor("x", x, ACTIVATION_DTYPES, (None, w.cols))
    shape = (x.shape[0], w.rows // 2 if silu_mul else w.rows)  # [M, N or F]
    out = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    check_tensor("out", out, (x.dtype,), shape)
    check_device(kernels, w=w.data, x=x, out=out)
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be at least 1, not {split_k}")
    if x.shape[0] > DECODE_MAX_TOKENS:
        _prefill(kernels, w, x, out, silu_mul)
    elif x.shape[0]:
        _decode(kernels, w, x, out, split_k, silu_mul)
    return out


def _layout(w: DeviceMatrix, silu_mul: bool) -> tuple[tuple, dict]:
    """The weight pointers (data, high, scales, mins, codebook, sub codes, sub supers: data's where
    absent, never read) and the constexpr flags of a kernel."""
    sub = w.sub
    arrays = (w.data, w.high, w.scales, w.mins, w.codebook, sub and sub.codes, sub and sub.supers)
    pointers = tuple(w.data if array is None else array for array in arrays)
    sub_flags = (dict(SUB_BITS=0, SUB_OFFSET=0, SUB_GPS=1) if sub is None
                 else dict(SUB_BITS=sub.bits, SUB_OFFSET=sub.offset, SUB_GPS=sub.groups_per_super))
    return pointers, dict(GROUP=w.group, BITS=w.bits, WIDTH=w.width, ZERO=w.zero,
                          CODEBOOK=w.codebook is not None, MINS=w.min_form, SILU_MUL=silu_mul, **sub_flags)


def _prefill(kernels, w: DeviceMatrix, x: torch.Tensor, out: torch.Tensor, silu_mul: bool) -> None:
    (tokens, n_out), (pointers, flags) = out.shape, _layout(w, silu_mul)
    grid = lambda meta: (cdiv(tokens, meta["BLOCK_M"]), cdiv(n_out, meta["BLOCK_N"]))  # noqa: E731
    kernels.matmul_kernel[grid](x, *pointers, out, tokens, w.rows, n_out, w.cols, x.stride(0),
                                power_of_two(tokens), F32=x.dtype == torch.float32, **flags)


def _decode(kernels, w: DeviceMatrix, x: torch.Tensor, out: torch.Tensor, split_k: int | None,
            silu_mul: bool) -> None:
    (tokens, n_out), (pointers, flags) = out.shape, _layout(w, silu_mul)
    splits = split_k or _decode_splits(w.cols, n_out, tokens, num_sms(x.device))
    per_split = cdiv(cdiv(w.cols, splits), kernels.SPLIT_ALIGN) * kernels.SPLIT_ALIGN
    splits = cdiv(w.cols, per_split)  # none empty
    partial = out if splits == 1 else torch.empty(splits, tokens, n_out, dtype=torch.float32, device=x.device)
    grid = lambda meta: (cdiv(n_out, meta["BLOCK_N"]), splits, tokens)  # noqa: E731
    kernels.matvec_kernel[grid](x, *pointers, partial, tokens, w.rows, n_out, w.cols, x.stride(0), per_split,
                                SPLIT_K=splits, **flags)
    if splits > 1:
        out.copy_(partial.sum(dim=0))  # in a fixed order: the same bits every run


def _decode_splits(cols: int, rows: int, tokens: int, sms: int) -> int:
    """K splits that give about two programs per streaming multiprocessor, each >= 512 columns."""
    programs = cdiv(rows, ROWS_PER_PROGRAM) * tokens
    return max(1, min(cdiv(2 * sms, programs), cols // MIN_SPLIT_COLUMNS))
