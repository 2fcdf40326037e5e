"""Writes whole GGUF files tensor by tensor, and copies metadata entries verbatim.

The byte packing of single entries is gguf_bytes' (`pack_kv`, `pack_tensor_info`); this adds what
multi-GB model files need: a header laid out from tensor sizes alone, so a file's size is known
before any data exists, and tensor data streamed to disk one tensor at a time.

    write_gguf(path, [pack_kv("general.architecture", "llama")],
               [TensorEntry("w", (32, 2), F32)], [np.zeros((2, 32), np.float32)])
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES

from tests.support.gguf_bytes import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    TensorSpec,
    pack_kv,
    pack_tensor_info,
)
from tierflow.offload.gguf.reader import read_gguf

ALIGNMENT = 32  # the GGUF default; generated files keep it
_VERSION = 3
_SCALAR_BYTES = {UINT8: 1, INT8: 1, UINT16: 2, INT16: 2, UINT32: 4, INT32: 4, FLOAT32: 4, BOOL: 1,
                 UINT64: 8, INT64: 8, FLOAT64: 8}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class TensorEntry(NamedTuple):
    """A tensor as the header lists it."""

    name: str
    shape: tuple[int, ...]  # GGUF order: row length first
    ggml_type: int

    @property
    def nbytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block_size * type_size


def padded(num_bytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-num_bytes // alignment) * alignment


def header_bytes(kvs: Sequence[bytes], tensors: Sequence[TensorEntry],
                 alignment: int = ALIGNMENT) -> bytes:
    """Everything before the tensor data, padded to `alignment`. `kvs` are encoded entries
    (`pack_kv`); tensor data is laid out in list order, each tensor padded to `alignment`."""
    parts = [b"GGUF", struct.pack("<IQQ", _VERSION, len(tensors), len(kvs)), *kvs]
    offset = 0
    for tensor in tensors:
        parts.append(pack_tensor_info(TensorSpec(tensor.name, tensor.shape, tensor.ggml_type,
                                                 data=b""), offset))
        offset += padded(tensor.nbytes, alignment)
    header = b"".join(parts)
    return header + bytes(padded(len(header), alignment) - len(header))


def file_size(kvs: Sequence[bytes], tensors: Sequence[TensorEntry],
              alignment: int = ALIGNMENT) -> int:
    """The size of `write_gguf`'s file, without writing it."""
    return (len(header_bytes(kvs, tensors, alignment))
            + sum(padded(tensor.nbytes, alignment) for tensor in tensors))


def write_gguf(path: str | os.PathLike, kvs: Sequence[bytes], tensors: Sequence[TensorEntry],
               tensor_data: Iterable[np.ndarray], alignment: int = ALIGNMENT) -> Path:
    """Write a GGUF file whose i-th tensor holds the bytes of the i-th array of `tensor_data`
    (C-contiguous, any dtype). Arrays are drawn one at a time, so with a generator for
    `tensor_data` peak memory is about one tensor. A failed write deletes the file: a
    half-written model must not pass for a whole one."""
    path = Path(path)
    try:
        with open(path, "wb") as file:
            file.write(header_bytes(kvs, tensors, alignment))
            for tensor, data in zip(tensors, tensor_data, strict=True):
                if data.nbytes != tensor.nbytes:
                    raise ValueError(f"{tensor.name}: {data.nbytes} bytes of data for a "
                                     f"{tensor.nbytes}-byte tensor")
                file.write(np.ascontiguousarray(data).data)
                file.write(bytes(padded(tensor.nbytes, alignment) - tensor.nbytes))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


# Raw-byte access, kept because read_gguf gives decoded values only: it drops each entry's value
# type and byte range. A copy must keep the types exactly (llama.cpp refuses, say, an int32
# token id where it reads a uint32), and re-encoding SmolLM2's ~100k vocabulary strings would
# take longer than writing a small model.

def _value_end(buf: mmap.mmap, pos: int, vtype: int) -> int:
    """Where the value of type `vtype` that starts at `pos` ends."""
    if vtype in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[vtype]
    if vtype == STRING:
        return pos + 8 + _U64.unpack_from(buf, pos)[0]
    assert vtype == ARRAY, vtype
    element_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if element_type in _SCALAR_BYTES:
        return pos + count * _SCALAR_BYTES[element_type]
    for _ in range(count):
        pos = _value_end(buf, pos, element_type)
    return pos


def encoded_kvs(path: str | os.PathLike) -> dict[str, bytes]:
    """Every metadata entry of a GGUF file as encoded there (key, type id and value), in file
    order. No checks: for files that read_gguf has accepted."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        (num_kvs,) = _U64.unpack_from(buf, 16)  # after magic, version and tensor count
        pos, kvs = 24, {}
        for _ in range(num_kvs):
            key_end = pos + 8 + _U64.unpack_from(buf, pos)[0]
            end = _value_end(buf, key_end + 4, _U32.unpack_from(buf, key_end)[0])
            kvs[buf[pos + 8:key_end].decode("utf-8")] = buf[pos:end]
            pos = end
    return kvs


def rewrite_metadata(source: str | os.PathLike, dest: str | os.PathLike, changes: Mapping[str, Any],
                     tensors: bool = True) -> Path:
    """A copy of `source` with metadata entries replaced or added (a None value removes one),
    with its tensors or none."""
    kvs = encoded_kvs(source)
    for key, value in changes.items():
        kvs[key] = None if value is None else pack_kv(key, value)
    kvs = [kv for kv in kvs.values() if kv is not None]
    with read_gguf(source) as model:
        infos = list(model.tensors.values()) if tensors else []
        entries = [TensorEntry(info.name, info.shape, info.ggml_type) for info in infos]
        return write_gguf(dest, kvs, entries, (model.tensor_data(info.name) for info in infos),
                          model.alignment)
