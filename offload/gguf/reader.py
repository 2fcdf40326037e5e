"""A validating GGUF reader: header, metadata and tensor table parsed from a memory map.

The file is treated as hostile input. Every length, count and offset is checked against the file
size before it is used, so a malformed file fails fast with one `ModelFileError` naming the file
and the problem, never with a hang, a MemoryError or a RecursionError. The checks are at least
those of llama.cpp's own parser, including its tensor layout rule: tensor data is laid out in
table order, each tensor at the running total of the previous tensors' sizes padded to the
alignment, with no gaps or overlaps.

Tensor data is not read: `GGUFFile.tensor_data` returns read-only views of the map.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import numpy as np
from gguf import GGUFValueType

from tierflow import ggml_types
from tierflow.errors import ModelFileError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NAME_BYTES = 63  # ggml's GGML_MAX_NAME is 64 including the terminating NUL

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
# Smallest possible encodings, used to reject impossible counts before looping over them.
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, one-byte key, value type, one-byte value
_MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, one dim, type, offset

_T = GGUFValueType
_SCALARS = {
    _T.UINT8: struct.Struct("<B"), _T.INT8: struct.Struct("<b"),
    _T.UINT16: struct.Struct("<H"), _T.INT16: struct.Struct("<h"),
    _T.UINT32: _U32, _T.INT32: struct.Struct("<i"),
    _T.UINT64: _U64, _T.INT64: struct.Struct("<q"),
    _T.FLOAT32: struct.Struct("<f"), _T.FLOAT64: struct.Struct("<d"),
    _T.BOOL: struct.Struct("<B"),
}
_ARRAY_DTYPES = {vtype: np.dtype(fmt.format) for vtype, fmt in _SCALARS.items()}
# A tensor table entry as read: name, shape, ggml type, offset relative to the data section.
_Entry = tuple[str, tuple[int, ...], int, int]


class ValueType(NamedTuple):
    """A metadata value's GGUF type, and for an array its elements' type (what a copy needs)."""

    type: GGUFValueType
    element_type: GGUFValueType | None  # arrays only


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table, validated against the file."""

    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is ne0, the contiguous (innermost) dimension
    ggml_type: int  # a gguf.GGMLQuantizationType or tierflow.ggml_types.TierflowType value
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    part: int = 0  # the file of a split model that holds the data: 0 the first (or only), i the i+1-th

    @property
    def type_name(self) -> str:
        return ggml_types.type_name(self.ggml_type)

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    """Bounds-checked little-endian reads from the map; any overrun is a ModelFileError."""

    def __init__(self, buf: mmap.mmap, label: str) -> None:
        self.buf, self.size, self.label, self.pos = buf, len(buf), label, 0

    def fail(self, problem: str) -> NoReturn:
        raise ModelFileError(f"{self.label}: {problem}")

    def need(self, nbytes: int, what: str) -> None:
        left = self.size - self.pos
        if nbytes > left:
            self.fail(f"{what} at offset {self.pos} runs past the end of the file "
                      f"(needs {nbytes} bytes, {left} left)")

    def fields(self, fmt: struct.Struct, what: str) -> tuple[Any, ...]:
        self.need(fmt.size, what)
        values = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return values

    def unpack(self, fmt: struct.Struct, what: str) -> Any:
        return self.fields(fmt, what)[0]

    def take(self, nbytes: int, what: str) -> bytes:
        self.need(nbytes, what)
        self.pos += nbytes
        return self.buf[self.pos - nbytes:self.pos]

    def string(self, what: str) -> bytes:
        return self.take(self.unpack(_U64, f"length of {what}"), what)

    def name(self, what: str) -> str:
        """A key or tensor name: must be valid UTF-8, since code looks it up by value."""
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} {raw[:40]!r} is not valid UTF-8")


def _text(raw: bytes) -> str:
    # llama.cpp keeps values as raw bytes; a stray invalid byte in, say, one vocabulary entry
    # should not make the whole model unreadable, so it becomes U+FFFD instead of an error.
    return raw.decode("utf-8", errors="replace")


def _type_name(vtype: int) -> str:
    return _T(vtype).name.lower()


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype == _T.STRING:
        return _text(cur.string(f"string value of '{key}'"))
    if vtype == _T.ARRAY:
        return _read_array(cur, key)
    fmt = _SCALARS.get(vtype)
    if fmt is None:
        cur.fail(f"unknown value type {vtype} for key '{key}'")
    value = cur.unpack(fmt, f"value of '{key}'")
    if vtype == _T.BOOL:
        if value > 1:
            cur.fail(f"bool value of '{key}' is {value}, not 0 or 1")
        return bool(value)
    return value


def _read_array(cur: _Cursor, key: str) -> Any:
    etype = cur.unpack(_U32, f"array element type of '{key}'")
    if etype == _T.ARRAY:  # the spec's grammar allows them; llama.cpp's reader, and so every file, not
        cur.fail(f"array value of '{key}' holds arrays: nested arrays are not supported (llama.cpp "
                 f"cannot read them either)")
    count = cur.unpack(_U64, f"array length of '{key}'")
    if etype in _ARRAY_DTYPES:
        dtype = _ARRAY_DTYPES[etype]
        what = f"array '{key}' of {count} {_type_name(etype)} values"
        raw = cur.take(count * dtype.itemsize, what)
        values = np.frombuffer(raw, dtype)  # read-only, over a copy: close() need not wait for it
        if etype == _T.BOOL:
            if values.size and values.max() > 1:
                cur.fail(f"bool array of '{key}' holds values other than 0 and 1")
            values = values.view(np.bool_)
        return values
    if etype != _T.STRING:
        cur.fail(f"unknown value type {etype} in array '{key}'")
    cur.need(count * _U64.size, f"array '{key}' of {count} {_type_name(etype)} values")
    return _read_strings(cur, count, key)


def _read_strings(cur: _Cursor, count: int, key: str) -> list[str]:
    """A string array's items. Inlined because vocabularies hold ~10^5 strings per array."""
    buf, pos, size, unpack_length = cur.buf, cur.pos, cur.size, _U64.unpack_from
    strings = []
    for index in range(count):
        if size - pos >= 8:
            end = pos + 8 + unpack_length(buf, pos)[0]
            if end <= size:
                strings.append(_text(buf[pos + 8:end]))
                pos = end
                continue
        cur.pos = pos
        cur.string(f"string #{index} of '{key}'")  # raises the usual past-the-end error
    cur.pos = pos
    return strings


def _read_metadata(cur: _Cursor, num_kvs: int) -> tuple[dict[str, Any], dict[str, ValueType], int]:
    """The key-value section, each value's type, and the data alignment it sets."""
    metadata: dict[str, Any] = {}
    value_types: dict[str, ValueType] = {}
    alignment = DEFAULT_ALIGNMENT
    for index in range(num_kvs):
        key = cur.name(f"metadata key #{index}")
        if not key:
            cur.fail(f"metadata key #{index} is empty")
        if key in metadata:
            cur.fail(f"duplicate metadata key '{key}'")
        vtype = cur.unpack(_U32, f"value type of '{key}'")
        start = cur.pos
        metadata[key] = _read_value(cur, vtype, key)
        # An array's element type is its first field, read (and checked) by _read_value.
        element_type = _U32.unpack_from(cur.buf, start)[0] if vtype == _T.ARRAY else None
        value_types[key] = ValueType(_T(vtype), None if element_type is None else _T(element_type))
        if key == "general.alignment":
            alignment = metadata[key]
            if vtype != _T.UINT32:
                cur.fail(f"general.alignment must be uint32, not {_type_name(vtype)}")
            if alignment == 0 or alignment & (alignment - 1):
                cur.fail(f"general.alignment must be a power of two, got {alignment}")
    return metadata, value_types, alignment


def _read_tensor_info(cur: _Cursor, index: int) -> _Entry:
    """One tensor table entry, checked on its own; the layout is checked by `_place_tensors`."""
    name = cur.name(f"name of tensor #{index}")
    if not name:
        cur.fail(f"tensor #{index} has an empty name")
    name_bytes = len(name.encode("utf-8"))
    if name_bytes > MAX_NAME_BYTES:
        cur.fail(f"tensor name '{name[:40]}...' is {name_bytes} bytes long (max {MAX_NAME_BYTES})")
    num_dims = cur.unpack(_U32, f"dimension count of tensor '{name}'")
    if num_dims == 0:
        cur.fail(f"tensor '{name}' has no dimensions")
    if num_dims > MAX_DIMS:
        cur.fail(f"tensor '{name}' has {num_dims} dimensions (max {MAX_DIMS})")
    shape = cur.fields(struct.Struct(f"<{num_dims}q"), f"shape of tensor '{name}'")
    ggml_type = cur.unpack(_U32, f"type of tensor '{name}'")
    offset = cur.unpack(_U64, f"data offset of tensor '{name}'")
    if min(shape) <= 0:
        cur.fail(f"tensor '{name}' has a zero or negative dimension in shape {shape}")
    if math.prod(shape) > 2**63 - 1:
        cur.fail(f"tensor '{name}' shape {shape} overflows int64 in its element count")
    if ggml_type not in ggml_types.QUANT_SIZES:
        cur.fail(f"tensor '{name}' has unknown tensor type {ggml_type}")
    block_size = ggml_types.QUANT_SIZES[ggml_type][0]
    if shape[0] % block_size:
        cur.fail(f"tensor '{name}' of type {ggml_types.type_name(ggml_type)} has "
                 f"ne0={shape[0]}, not a multiple of its block size {block_size}")
    return name, shape, ggml_type, offset


def _read_tensor_table(cur: _Cursor, num_tensors: int) -> list[_Entry]:
    entries, names = [], set()
    for index in range(num_tensors):
        entries.append(_read_tensor_info(cur, index))
        if entries[-1][0] in names:
            cur.fail(f"duplicate tensor name '{entries[-1][0]}'")
        names.add(entries[-1][0])
    return entries


def _place_tensors(cur: _Cursor, entries: list[_Entry], data_offset: int,
                   alignment: int) -> dict[str, TensorInfo]:
    """Check the data layout (llama.cpp's rule) and resolve absolute offsets."""
    tensors: dict[str, TensorInfo] = {}
    expected = 0  # each tensor starts where the previous one's padded data ends
    for name, shape, ggml_type, offset in entries:
        if offset % alignment:
            cur.fail(f"tensor '{name}' data offset {offset} is not aligned to {alignment} bytes")
        if offset != expected:
            problem = "overlaps the previous tensor" if offset < expected else "leaves a gap"
            cur.fail(f"tensor '{name}' at data offset {offset} {problem} (expected {expected})")
        block_size, block_bytes = ggml_types.QUANT_SIZES[ggml_type]
        nbytes = math.prod(shape) // block_size * block_bytes
        start = data_offset + offset
        if start + nbytes > cur.size:
            cur.fail(f"tensor '{name}' data (bytes {start}..{start + nbytes}) runs past the end "
                     f"of the file ({cur.size} bytes)")
        tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
        expected += -nbytes % alignment + nbytes
    return tensors


class GGUFFile:
    """A parsed GGUF file whose tensor data stays in a read-only memory map until `close()`."""

    def __init__(self, path: Path, buf: mmap.mmap, version: int, alignment: int,
                 data_offset: int, metadata: dict[str, Any], tensors: dict[str, TensorInfo],
                 value_types: dict[str, ValueType] | None = None,
                 metadata_span: tuple[int, int] = (0, 0)):
        self.path, self._buf, self.version, self.alignment = path, buf, version, alignment
        self.data_offset, self.metadata, self.tensors = data_offset, metadata, tensors
        self.value_types = value_types or {}  # metadata key -> its GGUF value type
        self.metadata_span = metadata_span  # byte range of the encoded key-value section
        self.parts: tuple[GGUFFile, ...] = ()  # a split model's later files, in order

    def join_parts(self, parts: list[GGUFFile]) -> GGUFFile:
        """This file, a split model's first part, made the whole model: the later parts' tensors join
        the table (each knowing its part), and the parts are closed with it. The metadata stays the
        first part's, split.* keys included (metadata_bytes must match it)."""
        tensors = dict(self.tensors)
        for index, part in enumerate(parts, start=1):
            for name, info in part.tensors.items():
                if name in tensors:
                    raise ModelFileError(f"{part.path.name}: tensor '{name}' is in an earlier part too")
                tensors[name] = replace(info, part=index)
        self.tensors, self.parts = tensors, tuple(parts)
        return self

    def metadata_bytes(self) -> bytes:
        """The key-value section exactly as encoded in the file (a copy)."""
        if self._buf is None:
            raise ValueError(f"{self.path}: metadata read after close()")
        start, end = self.metadata_span
        return self._buf[start:end]

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a 1-D uint8 view of the map (no copy, read-only)."""
        if self._buf is None:
            raise ValueError(f"{self.path}: tensor data read after close()")
        info = self.tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: no tensor named '{name}'")
        if info.part:
            return self.parts[info.part - 1].tensor_data(name)
        return np.frombuffer(self._buf, np.uint8, count=info.nbytes, offset=info.offset)

    def release_pages(self) -> None:
        """Drops the map's pages from this process's memory (its RSS), not from the page cache: a
        later read maps them again. A load calls it once it has built what it needs from the
        tensors read so far, so that the file does not count twice in its memory."""
        for part in self.parts:
            part.release_pages()
        if self._buf is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._buf.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Release the map now, or when the last view from `tensor_data` is dropped."""
        for part in self.parts:
            part.close()
        if self._buf is not None:
            try:
                self._buf.close()
            except BufferError:
                pass  # views are still alive and keep the map; it is unmapped with the last one
            self._buf = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.path)!r}, version={self.version}, "
                f"{len(self.metadata)} keys, {len(self.tensors)} tensors)")


def _map_file(path: Path) -> mmap.mmap:
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size == 0:
                raise ModelFileError(f"{path}: empty file, not a GGUF file")
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except OSError as error:
        raise ModelFileError(f"{path}: cannot read: {error.strerror or error}") from None


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    """The version and the tensor and metadata counts, each checked before anything is read."""
    magic, version, num_tensors, num_kvs = cur.fields(_HEADER, "header")
    if magic != MAGIC:
        cur.fail(f"not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    if version not in SUPPORTED_VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            cur.fail(f"GGUF version {version} is byte-swapped: big-endian files are not supported")
        cur.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
    left = cur.size - cur.pos
    if num_kvs > left // _MIN_KV_BYTES:
        cur.fail(f"header claims {num_kvs} metadata entries, more than {left} bytes can hold")
    if num_tensors > left // _MIN_TENSOR_BYTES:
        cur.fail(f"header claims {num_tensors} tensors, more than {left} bytes can hold")
    return version, num_tensors, num_kvs


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate a GGUF file's header; tensor data is mapped, not read."""
    path = Path(path)
    buf = _map_file(path)
    try:
        cur = _Cursor(buf, str(path))
        version, num_tensors, num_kvs = _read_header(cur)
        metadata_start = cur.pos
        metadata, value_types, alignment = _read_metadata(cur, num_kvs)
        metadata_span = (metadata_start, cur.pos)
        entries = _read_tensor_table(cur, num_tensors)
        data_offset = -cur.pos % alignment + cur.pos
        tensors = _place_tensors(cur, entries, data_offset, alignment)
    except BaseException:
        buf.close()  # parsing exports no buffers, so the map can always be released here
        raise
    return GGUFFile(path, buf, version, alignment, data_offset, metadata, tensors, value_types,
                    metadata_span)
