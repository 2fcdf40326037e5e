"""A packed matrix as torch tensors: the bytes of `cpu_kernels.packed.PackedMatrix`, on any device.

The GPU kernels read exactly the layout the CPU kernels read (cpu_kernels/packed.py's docstring
defines every array), so a layer moves between tiers as bytes, never re-laid out or expanded: a
device holds the pack's bytes and no more. Legend: N rows, K columns, T = ceil(N / 64) tiles of
64 rows, G = K / group groups, b bits, f = field_bits(width, codebook), h = width - f high
bits, S' super blocks, B sub-code bytes.

    data    uint8 [T, K/8, b, 64]  bits 1..4: LUT bit planes of unsigned codes
            int8  [T, K/4, 64, 4]  bits 8, width 8: signed codes
            uint8 [T, K*f/32, 64, 4]  bits 8, width 2..6 or a codebook (int8 [16] on the device):
                                   f-bit fields, 8 / f column quads per byte
    high    uint8 [T, K*h/32, 64, 4]  widths 3, 5, 6: the codes' high bits
    scales  float16 [T, G, 64]     w = scale * q + min per (tile, group, row); None with sub
    mins    float16 [T, G, 64]     or None: the min is the zero code's (LUT), or zero
    sub     codes uint8 [T, S', B, 64] and supers float16 [T, S', 1 or 2, 64]: two-level scales
"""

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from tierflow.cpu_kernels.packed import (
    LUT_BITS,
    NARROW_WIDTHS,
    SUB_BITS,
    TILE_ROWS,
    PackedMatrix,
    field_bits,
    sub_code_bytes,
)
from tierflow.cpu_kernels.quant_groups import CODEBOOKS

MAX_ELEMENTS = 2**31 - 1  # the kernels index with int32

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # array name -> its dtype and shape
SubForm = tuple[int, int, int, bool]  # sub-scales' bits, offset, groups_per_super, with_mins


@dataclass(frozen=True)
class DeviceSubScales:
    """Two-level scales on the device: SubPacking's arrays as tensors (scale = d * (code - offset),
    min = -(dmin * min code))."""

    codes: torch.Tensor  # uint8 [T, S', B, 64]
    supers: torch.Tensor  # float16 [T, S', 1 or 2, 64]: d (and dmin) of each row
    bits: int  # 4, 6 or 8
    offset: int
    groups_per_super: int
    with_mins: bool

    @property
    def form(self) -> SubForm:
        return self.bits, self.offset, self.groups_per_super, self.with_mins


@dataclass(frozen=True)
class DeviceMatrix:
    rows: int  # N, before padding
    cols: int  # K
    bits: int  # 1..4 (LUT layout) or 8 (int8 layout, or fields)
    group: int
    data: torch.Tensor
    scales: torch.Tensor | None  # None with sub
    mins: torch.Tensor | None
    codebook: torch.Tensor | None = None  # int8 [16]: data holds 4-bit indices into it (bits 8)
    width: int = 8  # bits 8: 2..6 for unsigned codes in fields (+ high), 8 for int8 codes
    zero: int = 0  # the code of a zero weight: int8 codes subtract it; LUT codes' min without mins
    high: torch.Tensor | None = None  # widths 3, 5, 6: the codes' high bits
    sub: DeviceSubScales | None = None  # two-level scales instead of scales and mins

    def __post_init__(self) -> None:
        sub_form = self.sub and self.sub.form
        check_form(self.cols, self.bits, self.group, self.codebook is not None, self.width, self.zero,
                   sub_form)
        arrays = {"data": self.data, "high": self.high, "scales": self.scales, "mins": self.mins,
                  "codebook": self.codebook}
        if self.sub is not None:
            arrays |= {"sub codes": self.sub.codes, "sub supers": self.sub.supers}
        expected = array_layout(self.rows, self.cols, self.bits, self.group, self.codebook is not None,
                                self.width, self.mins is not None, sub_form)
        if self.codebook is not None:
            expected["codebook"] = (torch.int8, (16,))
        what = f"a {self.rows} x {self.cols} {form_name(self.bits, self.width)} matrix"
        for name, tensor in arrays.items():  # data first: the others must be on its device
            if name in expected:
                _check_array(name, tensor, *expected[name], self.data, what)
            elif tensor is not None:
                raise ValueError(f"{what} has no {name}")

    @property
    def min_form(self) -> str:
        """Where each group's min comes from: "half" (mins), "sub" (the sub codes), "zero" (the zero
        code's, -zero * scale: LUT codes), or "none"."""
        if self.sub is not None and self.sub.with_mins:
            return "sub"
        if self.sub is None and self.mins is not None:
            return "half"
        return "zero" if self.bits != 8 and self.zero else "none"

    @property
    def tiles(self) -> int:
        return -(-self.rows // TILE_ROWS)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """The bytes of the matrix's own arrays (a codebook table is shared by every matrix)."""
        arrays = (self.data, self.high, self.scales, self.mins) + (
            () if self.sub is None else (self.sub.codes, self.sub.supers))
        return sum(a.numel() * a.element_size() for a in arrays if a is not None)


def form_name(bits: int, width: int) -> str:
    """The codes' form, as errors name it."""
    return f"{bits}-bit" if width == 8 else f"{width}-bit unsigned"


def check_form(cols: int, bits: int, group: int, codebook: bool, width: int, zero: int,
               sub_form: SubForm | None) -> None:
    """A ValueError unless the kernels can read a matrix of this form (its arrays aside)."""
    if bits not in (*LUT_BITS, 8) or (codebook and bits != 8):
        raise ValueError(f"packed matrices have 1..4 or 8 bits (8 with a codebook), not {bits}")
    if width not in (*NARROW_WIDTHS, 8):
        raise ValueError(f"codes are 2..6 or 8 bits wide, not {width}")
    if width != 8 and (bits != 8 or codebook):
        raise ValueError(f"{width}-bit wide codes are 8-bit codes without a codebook")
    # int8 codes and a codebook's are signed as they are; narrower ones and LUT codes are unsigned
    max_zero = (1 << min(bits, width)) - 1 if width < 8 or bits < 8 else 0
    if not 0 <= zero <= max_zero:
        raise ValueError(f"the zero code of {form_name(bits, width)} codes is 0..{max_zero}, not {zero}")
    field = field_bits(width, codebook)
    divisor = 8 if bits != 8 else 32 // field  # a LUT byte column's columns, or a block of fields'
    # a power of two: a block of columns holds whole groups, or lies in one (matmul_kernels._by_group)
    if group < divisor or group & (group - 1) or cols % group:
        raise ValueError(f"{form_name(bits, width)} codes need a group that is a power of two, a multiple of "
                         f"{divisor} that divides the {cols} columns, not {group}")
    h = width - field if width < 8 else 0
    if h and cols % (32 // h):
        raise ValueError(f"{width}-bit codes need a multiple of {32 // h} columns, not {cols}")
    if sub_form is not None:
        _check_sub_form(*sub_form, cols, group)


def _check_sub_form(bits: int, offset: int, groups_per_super: int, with_mins: bool, cols: int,
                    group: int) -> None:
    values = groups_per_super * (2 if with_mins else 1)
    if bits not in SUB_BITS or (bits != 8 and values % (2 if bits == 4 else 4)):
        raise ValueError(f"sub-scale codes are 4, 6 or 8 bits, a whole number of bytes per super block: "
                         f"not {values} of {bits} bits")
    if groups_per_super <= 0 or cols % (group * groups_per_super):
        raise ValueError(f"super blocks of {groups_per_super} groups of {group} do not divide the "
                         f"{cols} columns")
    if not 0 <= offset < 1 << bits:
        raise ValueError(f"a sub-scale offset of {offset} is not a {bits}-bit code")


def array_layout(rows: int, cols: int, bits: int, group: int, codebook: bool, width: int, mins: bool,
                 sub_form: SubForm | None) -> Layout:
    """The dtype and shape of each array a matrix of this form holds (see the module docstring)."""
    tiles = -(-rows // TILE_ROWS)
    if bits != 8:
        layout = {"data": (torch.uint8, (tiles, cols // 8, bits, TILE_ROWS))}
    elif codebook or width < 8:
        field = field_bits(width, codebook)
        layout = {"data": (torch.uint8, (tiles, cols * field // 32, TILE_ROWS, 4))}
        if not codebook and width > field:
            layout["high"] = (torch.uint8, (tiles, cols * (width - field) // 32, TILE_ROWS, 4))
    else:
        layout = {"data": (torch.int8, (tiles, cols // 4, TILE_ROWS, 4))}
    if sub_form is None:
        params = (torch.float16, (tiles, cols // group, TILE_ROWS))
        return layout | {"scales": params} | ({"mins": params} if mins else {})
    sub_bits, _, gps, with_mins = sub_form
    supers = cols // (group * gps)
    return layout | {"sub codes": (torch.uint8, (tiles, supers, sub_code_bytes(sub_bits, gps, with_mins),
                                                 TILE_ROWS)),
                     "sub supers": (torch.float16, (tiles, supers, 2 if with_mins else 1, TILE_ROWS))}


def _check_array(name: str, tensor: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...],
                 data: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != shape:
        got = (f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor)
               else type(tensor).__name__)
        raise ValueError(f"{name} of {what} must be {dtype} {list(shape)}, got {got}")
    if not tensor.is_contiguous() or tensor.device != data.device:
        raise ValueError(f"{name} must be contiguous and on {data.device}")
    if tensor.numel() > MAX_ELEMENTS:
        raise ValueError(f"{name} has more than 2**31 elements")


def to_device(matrix: PackedMatrix, device: torch.device | str) -> DeviceMatrix:
    """A copy of `matrix`'s bytes on `device`: every array as it is, none expanded."""
    def copy(array: np.ndarray | None) -> torch.Tensor | None:
        return None if array is None else torch.from_numpy(np.ascontiguousarray(array)).to(device)

    sub = matrix.sub
    device_sub = sub and DeviceSubScales(copy(sub.codes), copy(sub.supers), sub.bits, sub.offset,
                                         sub.groups_per_super, sub.with_mins)
    codebook = None if matrix.codebook is None else codebook_table(matrix.codebook, torch.device(device))
    return DeviceMatrix(matrix.rows, matrix.cols, matrix.bits, matrix.group, copy(matrix.data),
                        copy(matrix.scales), copy(matrix.mins), codebook, matrix.width, matrix.zero,
                        copy(matrix.high), device_sub)


def view_matrix(buffer: torch.Tensor, spec: dict) -> DeviceMatrix:
    """The packed matrix whose arrays lie in `buffer` (uint8 [bytes], e.g. a layer's extent as
    offload.device.DeviceTier.upload returns it), as the pack's manifest entry `spec` places them
    ({"rows", "cols", "bits", "group", "codebook", "width", "zero", "data", "high", "scales", "mins",
    "sub"}, each array [offset, nbytes] or None; sub None or {"bits", "offset", "groups_per_super",
    "with_mins", "codes", "supers"}): views, not copies."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"buffer must be uint8 [bytes], not {buffer.dtype} {list(buffer.shape)}")
    rows, cols, bits, group, sub = spec["rows"], spec["cols"], spec["bits"], spec["group"], spec["sub"]
    sub_form = sub and (sub["bits"], sub["offset"], sub["groups_per_super"], sub["with_mins"])
    form = (bits, group, spec["codebook"] is not None, spec["width"])
    check_form(cols, *form, spec["zero"], sub_form)
    layout = array_layout(rows, cols, *form, spec["mins"] is not None, sub_form)
    places = {"data": spec["data"], "high": spec["high"], "scales": spec["scales"], "mins": spec["mins"]}
    if sub is not None:
        places |= {"sub codes": sub["codes"], "sub supers": sub["supers"]}
    # an array the form has no room for stays as given, for DeviceMatrix to refuse
    arrays = {name: _view(buffer, name, place, *layout[name]) if name in layout and place else place
              for name, place in places.items()}
    device_sub = sub and DeviceSubScales(
        arrays["sub codes"], arrays["sub supers"], sub["bits"], sub["offset"], sub["groups_per_super"],
        sub["with_mins"])
    table = None if spec["codebook"] is None else codebook_table(spec["codebook"], buffer.device)
    return DeviceMatrix(rows, cols, bits, group, arrays["data"], arrays["scales"], arrays["mins"], table,
                        spec["width"], spec["zero"], arrays["high"], device_sub)


def _view(buffer: torch.Tensor, name: str, place: list[int], dtype: torch.dtype,
          shape: tuple[int, ...]) -> torch.Tensor:
    """The array `name` at place = [offset, nbytes] of buffer, which must be the shape's size."""
    at, nbytes = place
    size = dtype.itemsize * int(np.prod(shape))
    if nbytes != size:
        raise ValueError(f"{name} is {dtype} {list(shape)}, {size} bytes, but the pack gives it {nbytes}")
    if at < 0 or at + size > buffer.numel() or (buffer.data_ptr() + at) % dtype.itemsize:
        raise ValueError(f"{name}, {size} bytes at {at}, is outside the buffer of {buffer.numel()} bytes or "
                         f"not aligned to {dtype.itemsize}")
    return buffer[at: at + size].view(dtype).view(shape)


@cache
def codebook_table(name: str, device: torch.device) -> torch.Tensor:
    """The codebook's 16 int8 codes on `device`, one tensor per device shared by its matrices."""
    if name not in CODEBOOKS:
        raise ValueError(f"unknown codebook {name!r}; expected one of {sorted(CODEBOOKS)}")
    return torch.from_numpy(CODEBOOKS[name]).to(device)
