"""A packed matrix as torch tensors: the bytes of `cpu_kernels.packed.PackedMatrix`, on any device.

The GPU kernels read exactly the layout the CPU kernels read (see cpu_kernels/packed.py), so a
layer moves between tiers as bytes, never re-laid out. Legend: N rows, K columns, T = ceil(N / 64)
tiles of 64 rows, G = K / group groups, b bits.

    data    uint8 [T, K/8, b, 64]  bits 1..4: byte (t, o, p, r), bit j = bit p of the code of row
                                   64t + r, column 8o + j (unsigned codes)
            int8  [T, K/4, 64, 4]  bits 8: byte (t, c, r, j) = the code of row 64t + r, column 4c + j
            uint8 [T, K/8, 64, 4]  bits 8 with a codebook (int8 [16] on the device): byte (t, o, r, j)
                                   = the indices of row 64t + r, columns 8o + j (low nibble) and
                                   8o + 4 + j (high nibble) into the codebook
    scales  float16 [T, G, 64]     w = scale * q + min per (tile, group, row)
    mins    float16 [T, G, 64]     or None (int8 codes without an offset)
"""

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from tierflow.cpu_kernels.packed import LUT_BITS, TILE_ROWS, PackedMatrix
from tierflow.cpu_kernels.quant_groups import CODEBOOKS

MAX_ELEMENTS = 2**31 - 1  # the kernels index with int32


@dataclass(frozen=True)
class DeviceMatrix:
    rows: int  # N, before padding
    cols: int  # K
    bits: int  # 1..4 (LUT layout) or 8 (int8 layout)
    group: int
    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    codebook: torch.Tensor | None = None  # int8 [16]: data holds 4-bit indices into it (bits 8)

    def __post_init__(self) -> None:
        if self.bits not in (*LUT_BITS, 8) or (self.codebook is not None and self.bits != 8):
            raise ValueError(f"packed matrices have 1..4 or 8 bits (8 with a codebook), not {self.bits}")
        divisor = 4 if self.bits == 8 and self.codebook is None else 8
        if self.group <= 0 or self.group % divisor or self.cols % self.group:
            raise ValueError(f"{self.bits}-bit codes need a group that is a multiple of {divisor} and "
                             f"divides the {self.cols} columns, not {self.group}")
        tiles, groups = self.tiles, self.cols // self.group
        if self.codebook is not None:
            expected = (torch.uint8, (tiles, self.cols // 8, TILE_ROWS, 4))
        elif self.bits == 8:
            expected = (torch.int8, (tiles, self.cols // 4, TILE_ROWS, 4))
        else:
            expected = (torch.uint8, (tiles, self.cols // 8, self.bits, TILE_ROWS))
        params = (torch.float16, (tiles, groups, TILE_ROWS))
        arrays = {"data": (self.data, *expected), "scales": (self.scales, *params)}
        if self.mins is not None:
            arrays["mins"] = (self.mins, *params)
        if self.codebook is not None:
            arrays["codebook"] = (self.codebook, torch.int8, (16,))
        for name, (tensor, dtype, shape) in arrays.items():
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                got = (f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor)
                       else type(tensor).__name__)
                raise ValueError(f"{name} of a {self.rows} x {self.cols} {self.bits}-bit matrix must be "
                                 f"{dtype} {list(shape)}, got {got}")
            if not tensor.is_contiguous() or tensor.device != self.data.device:
                raise ValueError(f"{name} must be contiguous and on {self.data.device}")
            if tensor.numel() > MAX_ELEMENTS:
                raise ValueError(f"{name} has more than 2**31 elements")

    @property
    def tiles(self) -> int:
        return -(-self.rows // TILE_ROWS)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        params = self.scales.numel() * (1 if self.mins is None else 2)
        return self.data.numel() + 2 * params


def to_device(matrix: PackedMatrix, device: torch.device | str) -> DeviceMatrix:
    """A copy of `matrix`'s bytes on `device`."""
    def copy(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    mins = None if matrix.mins is None else copy(matrix.mins)
    codebook = None if matrix.codebook is None else codebook_table(matrix.codebook, torch.device(device))
    return DeviceMatrix(matrix.rows, matrix.cols, matrix.bits, matrix.group, copy(matrix.data),
                        copy(matrix.scales), mins, codebook)


def view_matrix(buffer: torch.Tensor, rows: int, cols: int, bits: int, group: int, data_at: int,
                scales_at: int, mins_at: int | None = None, codebook: str | None = None) -> DeviceMatrix:
    """The packed matrix whose arrays lie in `buffer` (uint8 [bytes], e.g. a layer's extent as
    offload.device.DeviceTier.upload returns it) at these byte offsets: views, not copies."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"buffer must be uint8 [bytes], not {buffer.dtype} {list(buffer.shape)}")
    tiles, groups = -(-rows // TILE_ROWS), cols // group

    def view(at: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        size = dtype.itemsize * int(np.prod(shape))
        if at < 0 or at + size > buffer.numel() or (buffer.data_ptr() + at) % dtype.itemsize:
            raise ValueError(f"an array of {size} bytes at {at} is outside the buffer of {buffer.numel()} "
                             f"bytes or not aligned to {dtype.itemsize}")
        return buffer[at: at + size].view(dtype).view(shape)

    if codebook is not None:
        data = view(data_at, torch.uint8, (tiles, cols // 8, TILE_ROWS, 4))
    elif bits == 8:
        data = view(data_at, torch.int8, (tiles, cols // 4, TILE_ROWS, 4))
    else:
        data = view(data_at, torch.uint8, (tiles, cols // 8, bits, TILE_ROWS))
    params = (tiles, groups, TILE_ROWS)
    mins = None if mins_at is None else view(mins_at, torch.float16, params)
    table = None if codebook is None else codebook_table(codebook, buffer.device)
    return DeviceMatrix(rows, cols, bits, group, data, view(scales_at, torch.float16, params), mins, table)


@cache
def codebook_table(name: str, device: torch.device) -> torch.Tensor:
    """The codebook's 16 int8 codes on `device`, one tensor per device shared by its matrices."""
    if name not in CODEBOOKS:
        raise ValueError(f"unknown codebook {name!r}; expected one of {sorted(CODEBOOKS)}")
    return torch.from_numpy(CODEBOOKS[name]).to(device)

