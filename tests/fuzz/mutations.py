"""Mutations: each one edit of a model file, stated in full, so a case prints as its reproducer.

Structured mutations edit a seed's parts (metadata entries, the tensor table, tensor data) before
build_gguf writes the file; byte mutations edit the written bytes. Array edits start from the
seed's decoded value, so they compose with other edits of the same key only as "the last wins".
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tests.fuzz.seeds import ModelParts, Seed, Value
from tests.fuzz.values import shown
from tests.support.gguf_bytes import ARRAY, STRING, TensorSpec, Typed
from tierflow.ggml_types import QUANT_SIZES, type_name

MAX_FITTED_BYTES = 64 << 20  # a tensor's data is refitted to a new shape or type only up to this


# ---------------------------------------------------------------------------------------------
# Metadata


@dataclass(frozen=True)
class SetValue:
    key: str | bytes
    value: Value

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        parts.set_value(self.key, self.value)

    def __str__(self) -> str:
        return f"set {self.key!r} = {shown(self.value)}"


@dataclass(frozen=True)
class DeleteKey:
    key: str

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        parts.kvs = [kv for kv in parts.kvs if kv[0] != self.key]

    def __str__(self) -> str:
        return f"delete {self.key!r}"


@dataclass(frozen=True)
class DuplicateKey:
    key: str

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        parts.kvs = [copy for kv in parts.kvs for copy in ([kv, kv] if kv[0] == self.key else [kv])]

    def __str__(self) -> str:
        return f"duplicate {self.key!r}"


def _array_value(seed: Seed, key: str, items: list | np.ndarray) -> Typed:
    return Typed(ARRAY, items, seed.value_types[key].element_type)


def _items(seed: Seed, key: str) -> list | np.ndarray:
    """A copy of the seed's array, to edit."""
    value = seed.metadata[key]
    return value.copy() if isinstance(value, np.ndarray) else list(value)


@dataclass(frozen=True)
class SetArrayItem:
    key: str
    index: int
    item: Any

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        items = _items(seed, self.key)
        items[self.index] = self.item
        parts.set_value(self.key, _array_value(seed, self.key, items))

    def __str__(self) -> str:
        return f"set {self.key!r}[{self.index}] = {shown(self.item)}"


@dataclass(frozen=True)
class CopyArrayItem:
    key: str
    dest: int
    source: int

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        items = _items(seed, self.key)
        items[self.dest] = items[self.source]
        parts.set_value(self.key, _array_value(seed, self.key, items))

    def __str__(self) -> str:
        return f"set {self.key!r}[{self.dest}] = {self.key!r}[{self.source}]"


@dataclass(frozen=True)
class FlipItemBit:
    """Flip one bit of a string item's UTF-8 bytes (it may no longer decode)."""

    key: str
    index: int
    bit: int

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        items = _items(seed, self.key)
        raw = bytearray(items[self.index].encode("utf-8"))
        raw[self.bit // 8 % len(raw)] ^= 1 << self.bit % 8
        items[self.index] = bytes(raw)
        parts.set_value(self.key, _array_value(seed, self.key, items))

    def __str__(self) -> str:
        return f"flip bit {self.bit} of {self.key!r}[{self.index}]"


@dataclass(frozen=True)
class ResizeArray:
    """Cut the array to `length` items, or extend it with new distinct ones."""

    key: str
    length: int

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        items = _items(seed, self.key)
        if isinstance(items, np.ndarray):
            items = np.resize(items, self.length)
        else:
            items = (items + [f"<fuzz_{i}>" for i in range(self.length - len(items))])[:self.length]
        parts.set_value(self.key, _array_value(seed, self.key, items))

    def __str__(self) -> str:
        return f"resize {self.key!r} to {self.length} items"


@dataclass(frozen=True)
class SetArchitecture:
    """Name another architecture, and with rename_keys move the old one's keys to it."""

    name: str
    rename_keys: bool

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        old = f"{seed.arch}."
        if self.rename_keys:
            parts.kvs = [(f"{self.name}.{key[len(old):]}" if key.startswith(old) else key, value)
                         for key, value in parts.kvs]
        parts.set_value("general.architecture", Typed(STRING, self.name))

    def __str__(self) -> str:
        moved = " and move its keys" if self.rename_keys else ""
        return f"set architecture {self.name!r}{moved}"


@dataclass(frozen=True)
class SetVersion:
    version: int

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        parts.version = self.version

    def __str__(self) -> str:
        return f"set the GGUF version to {self.version}"


@dataclass(frozen=True)
class SetAlignment:
    """Lay the tensor data out at another alignment, and say so in general.alignment."""

    alignment: int

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        parts.alignment = self.alignment

    def __str__(self) -> str:
        return f"lay out the tensor data at alignment {self.alignment}"


# ---------------------------------------------------------------------------------------------
# Tensor table and data


def _patched(data: bytes, start: int, raw: bytes) -> bytes:
    """`data` with the bytes from `start` on overwritten by `raw`."""
    return data[:start] + raw + data[start + len(raw):]


def _edit_tensor(parts: ModelParts, name: str, change: Callable[[TensorSpec], TensorSpec]) -> None:
    """Replace tensor `name` by change(tensor); nothing when an earlier edit dropped or renamed it."""
    for index, spec in enumerate(parts.tensors):
        if spec.name == name:
            parts.tensors[index] = change(spec)
            return


def _fitted(data: bytes, shape: tuple[int, ...], ggml_type: int) -> bytes:
    """`data` repeated or cut to what `shape` of `ggml_type` holds; unchanged where that size is
    undefined (unknown type, a row not a whole number of blocks) or too large to build."""
    block_size, block_bytes = QUANT_SIZES.get(ggml_type, (0, 0))
    if not block_size or not shape or shape[0] % block_size or min(shape) <= 0:
        return data
    nbytes = math.prod(shape) // block_size * block_bytes
    if nbytes > MAX_FITTED_BYTES or not data:
        return data
    return (data * -(-nbytes // len(data)))[:nbytes]


@dataclass(frozen=True)
class SetShape:
    tensor: str
    shape: tuple[int, ...]
    fit_data: bool

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        def change(spec: TensorSpec) -> TensorSpec:
            data = _fitted(spec.data, self.shape, spec.ggml_type) if self.fit_data else spec.data
            return replace(spec, shape=self.shape, data=data)

        _edit_tensor(parts, self.tensor, change)

    def __str__(self) -> str:
        fitted = ", data refitted" if self.fit_data else ""
        return f"set shape of {self.tensor!r} to {list(self.shape)}{fitted}"


@dataclass(frozen=True)
class SetType:
    tensor: str
    ggml_type: int
    fit_data: bool

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        def change(spec: TensorSpec) -> TensorSpec:
            data = _fitted(spec.data, spec.shape, self.ggml_type) if self.fit_data else spec.data
            return replace(spec, ggml_type=self.ggml_type, data=data)

        _edit_tensor(parts, self.tensor, change)

    def __str__(self) -> str:
        fitted = ", data refitted" if self.fit_data else ""
        return f"set type of {self.tensor!r} to {type_name(self.ggml_type)}{fitted}"


@dataclass(frozen=True)
class SetOffset:
    tensor: str
    offset: int

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        _edit_tensor(parts, self.tensor, lambda spec: replace(spec, offset=self.offset))

    def __str__(self) -> str:
        return f"set data offset of {self.tensor!r} to {self.offset}"


@dataclass(frozen=True)
class RenameTensor:
    tensor: str
    new_name: str | bytes

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        _edit_tensor(parts, self.tensor, lambda spec: replace(spec, name=self.new_name))

    def __str__(self) -> str:
        return f"rename tensor {self.tensor!r} to {shown(self.new_name)}"


@dataclass(frozen=True)
class DropTensor:
    tensor: str

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        parts.tensors = [spec for spec in parts.tensors if spec.name != self.tensor]

    def __str__(self) -> str:
        return f"drop tensor {self.tensor!r}"


@dataclass(frozen=True)
class DuplicateTensor:
    tensor: str

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        parts.tensors = [copy for spec in parts.tensors
                         for copy in ([spec, spec] if spec.name == self.tensor else [spec])]

    def __str__(self) -> str:
        return f"duplicate tensor {self.tensor!r}"


@dataclass(frozen=True)
class SetBlockScale:
    """Set the float16 scale d of one quant block; every type the seeds quantize to (Q8_0, Q4_0)
    starts its blocks with it."""

    tensor: str
    block: int
    half_bits: int  # the float16's bits: 0x7c00 inf, 0x7e00 NaN, 0x8000 -0, 0x7bff the largest

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        def change(spec: TensorSpec) -> TensorSpec:
            start = self.block * QUANT_SIZES[spec.ggml_type][1]
            return replace(spec, data=_patched(spec.data, start, struct.pack("<H", self.half_bits)))

        _edit_tensor(parts, self.tensor, change)

    def __str__(self) -> str:
        return f"set the scale of block {self.block} of {self.tensor!r} to float16 0x{self.half_bits:04x}"


@dataclass(frozen=True)
class SetElement:
    """Set one weight of an F32 tensor."""

    tensor: str
    element: int
    value: float

    def apply(self, parts: ModelParts, seed: Seed) -> None:
        def change(spec: TensorSpec) -> TensorSpec:
            return replace(spec, data=_patched(spec.data, self.element * 4, struct.pack("<f", self.value)))

        _edit_tensor(parts, self.tensor, change)

    def __str__(self) -> str:
        return f"set element {self.element} of {self.tensor!r} to {self.value}"


# ---------------------------------------------------------------------------------------------
# Bytes of the written file


@dataclass(frozen=True)
class FlipBit:
    position: int
    bit: int

    def apply(self, data: bytes, seeds: dict[str, Seed]) -> bytes:
        position = self.position % len(data)
        return _patched(data, position, bytes([data[position] ^ 1 << self.bit]))

    def __str__(self) -> str:
        return f"flip bit {self.bit} of byte {self.position}"


@dataclass(frozen=True)
class WriteInt:
    """Overwrite bytes with a little-endian integer (a count, length or offset, if it lands on one)."""

    position: int
    value: int
    size: int  # 4 or 8

    def apply(self, data: bytes, seeds: dict[str, Seed]) -> bytes:
        raw = (self.value % 2 ** (8 * self.size)).to_bytes(self.size, "little")  # two's complement
        return _patched(data, self.position, raw)

    def __str__(self) -> str:
        return f"write the {self.size}-byte integer {self.value} at byte {self.position}"


@dataclass(frozen=True)
class InsertBytes:
    position: int
    inserted: bytes

    def apply(self, data: bytes, seeds: dict[str, Seed]) -> bytes:
        return data[:self.position] + self.inserted + data[self.position:]

    def __str__(self) -> str:
        return f"insert {self.inserted[:16].hex()} ({len(self.inserted)} bytes) at byte {self.position}"


@dataclass(frozen=True)
class DeleteBytes:
    position: int
    count: int

    def apply(self, data: bytes, seeds: dict[str, Seed]) -> bytes:
        return data[:self.position] + data[self.position + self.count:]

    def __str__(self) -> str:
        return f"delete {self.count} bytes at byte {self.position}"


@dataclass(frozen=True)
class Truncate:
    size: int

    def apply(self, data: bytes, seeds: dict[str, Seed]) -> bytes:
        return data[:self.size]

    def __str__(self) -> str:
        return f"truncate to {self.size} bytes"


@dataclass(frozen=True)
class Splice:
    """The file up to `position`, then seed `other`'s bytes from `other_position` on."""

    position: int
    other: str
    other_position: int

    def apply(self, data: bytes, seeds: dict[str, Seed]) -> bytes:
        return data[:self.position] + seeds[self.other].data[self.other_position:]

    def __str__(self) -> str:
        return f"splice seed {self.other!r} from its byte {self.other_position} in at byte {self.position}"

