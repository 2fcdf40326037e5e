"""References of the C kernels: the quantized matmuls in numpy, the fused layer ops in torch.

`matmul_reference` reproduces every step of a kernel (how activations become int8 tables or
int8 codes, which integers are summed per group, or per super block on two-level scales) from the
packed bytes, in float64 for the final sums, so a kernel must match it to float32 rounding.
`matmul_exact` is the product with the dequantized weights and unquantized activations: the gap
between the two is the kernels' one approximation, the int8 quantization of activations (as in
ggml's Q8 and Q8_K dot products).
"""

import numpy as np

from tierflow.cpu_kernels.packed import PackedMatrix


def _group_scales(maxabs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inverse step, step) per group, float32 as the C code computes them."""
    maxabs = maxabs.astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(maxabs > 0, np.float32(127) / maxabs, np.float32(0)).astype(np.float32)
    return inverse, (maxabs / np.float32(127)).astype(np.float32)


def lut_tables(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] -> int8 tables [M, K/4, 16], steps [M, K/group], sums [M, K/group].

    Entry i of table t is the sum over j of (bit j of i - 1/2) * x[4t + j] (the subset sum less
    half the sum of all four), added in the C code's order and quantized with one step per group.
    """
    tokens, cols = x.shape
    fours = x.reshape(tokens, cols // 4, 4, 1).astype(np.float32)
    signs = (((np.arange(16)[None, :] >> np.arange(4)[:, None]) & 1) - np.float32(0.5)).astype(np.float32)
    terms = fours * signs  # [M, K/4, 4, 16], exact
    entries = ((terms[:, :, 0] + terms[:, :, 1]) + terms[:, :, 2]) + terms[:, :, 3]
    per_group = entries.reshape(tokens, cols // group, -1)
    inverse, steps = _group_scales(np.abs(per_group).max(axis=-1))
    codes = np.rint(per_group * inverse[..., None]).astype(np.int8).reshape(tokens, cols // 4, 16)
    return codes, steps, x.reshape(tokens, cols // group, group).sum(axis=-1, dtype=np.float64)


def int8_codes(x: np.ndarray, group: int, block: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] -> int8 codes [M, K], steps [M, K/block], sums [M, K/group]; one step per block
    columns (by default per group). A group's sum is its codes' sum times its step, as ggml's Q8_1
    keeps it (d * sum(q)): what a min multiplies, so the whole product is with the activations as
    the codes give them."""
    tokens, cols = x.shape
    blocks = x.reshape(tokens, cols // (block or group), -1).astype(np.float32)
    inverse, steps = _group_scales(np.abs(blocks).max(axis=-1))
    codes = np.rint(blocks * inverse[..., None]).astype(np.int8).reshape(tokens, cols)
    code_sums = codes.astype(np.int64).reshape(tokens, cols // group, group).sum(-1)
    group_steps = np.repeat(steps, (block or group) // group, axis=-1)  # [M, K/group]
    return codes, steps, code_sums * group_steps.astype(np.float64)


def _integer_sums(w: PackedMatrix, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token, row and group, the kernel's integer accumulator [M, N, G], plus steps and sums."""
    q = w.codes()
    if w.bits == 8:
        q = q.astype(np.int16) - w.centre
        codes, steps, sums = int8_codes(x, w.group)
        products = codes.astype(np.int64)[:, None, :] * q.astype(np.int64)[None, :, :]  # [M, N, K]
        return products.reshape(*products.shape[:2], -1, w.group).sum(-1), steps, sums
    tables, steps, sums = lut_tables(x, w.group)
    fours = q.reshape(w.rows, -1, 4).astype(np.int64)  # [N, K/4, 4]
    acc = np.zeros((x.shape[0], w.rows, w.cols // 4), np.int64)
    table_idx = np.arange(w.cols // 4)
    for p in range(w.bits):
        index = (((fours >> p) & 1) << np.arange(4)).sum(-1)  # [N, K/4] nibble of plane p
        acc += tables[:, table_idx[None, :], index].astype(np.int64) << p  # [M, N, K/4]
    return acc.reshape(*acc.shape[:2], -1, w.group // 4).sum(-1), steps, sums


def _two_level_reference(w: PackedMatrix, x: np.ndarray) -> np.ndarray:
    """The int8 kernel on two-level scales, as ggml's K-quant dot products: one activation step per
    super block; per super block, the integer sum over its groups of each group's dot product
    times the group's sub-scale, less the min codes times the groups' code sums, then d and dmin
    times the step in float32."""
    tokens, cols = x.shape
    gps = w.sub.groups_per_super
    codes, steps, _ = int8_codes(x, w.group, w.group * gps)  # steps [M, S]
    products = codes.astype(np.int64)[:, None, :] * w.codes().astype(np.int64)[None, :, :]  # [M, N, K]
    dots = products.reshape(tokens, w.rows, -1, w.group).sum(-1)  # [M, N, G]
    code_sums = codes.astype(np.int64).reshape(tokens, -1, w.group).sum(-1)  # [M, G]
    scale_codes, min_codes, d, dmin = w.sub_integers()
    per_super = lambda a: a.reshape(*a.shape[:-1], -1, gps).sum(-1)  # noqa: E731  [..., G] -> [..., S]
    total = per_super(dots * scale_codes[None]) * (d[None] * steps[:, None, :]).astype(np.float64)
    if min_codes is not None:
        mins = per_super(min_codes[None] * code_sums[:, None, :])
        total -= mins * (dmin[None] * steps[:, None, :]).astype(np.float64)
    return total.sum(-1)


def matmul_reference(w: PackedMatrix, x: np.ndarray) -> np.ndarray:
    """What the kernels compute for x [M, K] float32: [M, N] float64."""
    if w.bits == 8 and w.sub is not None:
        return _two_level_reference(w, x)
    acc, steps, sums = _integer_sums(w, x)
    scales, mins = w.group_params()
    if w.bits != 8:  # centred tables: each row's offset is its value at the centre code
        mins = mins + scales * np.float32(((1 << w.bits) - 1) / 2)
    else:  # centred codes, likewise
        mins = mins + scales * np.float32(w.centre)
    scaled = acc * (scales[None].astype(np.float64) * steps[:, None, :])
    return (scaled + mins[None].astype(np.float64) * sums[:, None, :]).sum(-1)


def matmul_exact(w: PackedMatrix, x: np.ndarray) -> np.ndarray:
    """x @ W.T with the packed weights and unquantized activations, float64."""
    return x.astype(np.float64) @ w.dequantize().astype(np.float64).T
