"""A packed matrix as torch tensors: the bytes of `cpu_kernels.packed.PackedMatrix`, on any device.

The GPU kernels read exactly the layout the CPU kernels read (see cpu_kernels/packed.py), so a
layer moves between tiers as bytes, never re-laid out. Legend: N rows, K columns, T = ceil(N / 64)
tiles of 64 rows, G = K / group groups, b bits.

    data    uint8 [T, K/8, b, 64]  bits 1..4: byte (t, o, p, r), bit j = bit p of the code of row
                                   64t + r, column 8o + j (unsigned codes)
            int8  [T, K/4, 64, 4]  bits 8: byte (t, c, r, j) = the code of row 64t + r, column 4c + j
    scales  float16 [T, G, 64]     w = scale * q + min per (tile, group, row)
    mins    float16 [T, G, 64]     or None (int8 codes without an offset)

The one exception: the CPU's codebook layout (IQ4_NL, IQ4_XS and MXFP4 as 4-bit indices) is
expanded to the int8 layout of the same codes as it reaches a device (`to_device`, `view_matrix`),
since the Triton kernels read int8 codes: such a matrix takes 8 bits a weight there, not 4, and a
viewed extent holds its nibbles besides, until the layer leaves the device.
"""

from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if self.bits not in (*LUT_BITS, 8):
            raise ValueError(f"packed matrices have 1..4 or 8 bits, not {self.bits}")
        divisor = 4 if self.bits == 8 else 8
        if self.group <= 0 or self.group % divisor or self.cols % self.group:
            raise ValueError(f"{self.bits}-bit codes need a group that is a multiple of {divisor} and "
                             f"divides the {self.cols} columns, not {self.group}")
        tiles, groups = self.tiles, self.cols // self.group
        if self.bits == 8:
            expected = (torch.int8, (tiles, self.cols // 4, TILE_ROWS, 4))
        else:
            expected = (torch.uint8, (tiles, self.cols // 8, self.bits, TILE_ROWS))
        params = (torch.float16, (tiles, groups, TILE_ROWS))
        arrays = {"data": (self.data, *expected), "scales": (self.scales, *params)}
        if self.mins is not None:
            arrays["mins"] = (self.mins, *params)
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
    """A copy of `matrix`'s bytes on `device` (a codebook's indices expanded to int8 codes)."""
    def copy(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    matrix = matrix.as_int8()
    mins = None if matrix.mins is None else copy(matrix.mins)
    return DeviceMatrix(matrix.rows, matrix.cols, matrix.bits, matrix.group, copy(matrix.data),
                        copy(matrix.scales), mins)


def view_matrix(buffer: torch.Tensor, rows: int, cols: int, bits: int, group: int, data_at: int,
                scales_at: int, mins_at: int | None = None, codebook: str | None = None) -> DeviceMatrix:
    """The packed matrix whose arrays lie in `buffer` (uint8 [bytes], e.g. a layer's extent as
    offload.device.DeviceTier.upload returns it) at these byte offsets: views, not copies, but for
    a codebook's indices, expanded to a new int8 array."""
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
        data = expand_codebook(view(data_at, torch.uint8, (tiles, cols // 8, TILE_ROWS, 4)), codebook)
    elif bits == 8:
        data = view(data_at, torch.int8, (tiles, cols // 4, TILE_ROWS, 4))
    else:
        data = view(data_at, torch.uint8, (tiles, cols // 8, bits, TILE_ROWS))
    params = (tiles, groups, TILE_ROWS)
    mins = None if mins_at is None else view(mins_at, torch.float16, params)
    return DeviceMatrix(rows, cols, bits, group, data, view(scales_at, torch.float16, params), mins)


def expand_codebook(nibbles: torch.Tensor, codebook: str) -> torch.Tensor:
    """Codebook indices uint8 [T, K/8, 64, 4] (cpu_kernels/packed.py) -> int8 codes [T, K/4, 64, 4].
    Each byte selects its two codes (low nibble, high nibble) from a 256-entry table at once; the
    int32 indices are a transient of 2 bytes a weight."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {sorted(CODEBOOKS)}")
    table = torch.from_numpy(CODEBOOKS[codebook]).to(nibbles.device)
    byte = torch.arange(256, device=nibbles.device)
    pairs = torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=1)  # [256, 2]: low, high code
    tiles, octets = nibbles.shape[:2]
    codes = pairs.index_select(0, nibbles.reshape(-1).int()).view(tiles, octets, TILE_ROWS, 4, 2)
    return codes.permute(0, 1, 4, 2, 3).reshape(tiles, 2 * octets, TILE_ROWS, 4)  # quads 2o, 2o + 1
