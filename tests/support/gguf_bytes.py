"""Writes GGUF files byte by byte, valid or deliberately broken, for reader tests.

Independent of the `gguf` package's writer, so the reader is checked against the spec as read
here rather than against another implementation's habits. Every field the reader validates has a
knob: header fields are arguments of `build_gguf`, a `Raw` value writes any type id and payload,
and a `TensorSpec` can carry any name, shape, type id and data offset.

    data = build_gguf({"general.architecture": "llama"}, [TensorSpec("w", (4,), F32, bytes(16))])
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = (
    range(13))
# ggml tensor types used by the tests.
F32, F16, Q4_0, Q8_0 = 0, 1, 2, 8

_SCALAR_FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I",
                   INT32: "<i", FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q",
                   FLOAT64: "<d"}
_DTYPE_TYPES = {np.dtype(np.uint8): UINT8, np.dtype(np.int8): INT8, np.dtype(np.uint16): UINT16,
                np.dtype(np.int16): INT16, np.dtype(np.uint32): UINT32, np.dtype(np.int32): INT32,
                np.dtype(np.float32): FLOAT32, np.dtype(np.bool_): BOOL,
                np.dtype(np.uint64): UINT64, np.dtype(np.int64): INT64,
                np.dtype(np.float64): FLOAT64}


@dataclass(frozen=True)
class Typed:
    """A value with an explicit GGUF type; an ARRAY also names its element type."""

    vtype: int
    value: Any
    element_type: int | None = None


@dataclass(frozen=True)
class Raw:
    """A value type id followed by payload bytes, written verbatim (for corrupt values)."""

    vtype: int
    payload: bytes


@dataclass(frozen=True)
class TensorSpec:
    """A tensor table entry and its data; offset None means the correct (running, aligned) one."""

    name: str | bytes
    shape: tuple[int, ...]
    ggml_type: int
    data: bytes
    offset: int | None = None


def pack_string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _infer(value: Any) -> Typed:
    """Default types: bool, int -> int32 (uint64 if large), float -> float32, str, arrays."""
    if isinstance(value, (Typed, Raw)):
        return value
    if isinstance(value, bool):
        return Typed(BOOL, value)
    if isinstance(value, int):
        return Typed(INT32 if -2**31 <= value < 2**31 else UINT64, value)
    if isinstance(value, float):
        return Typed(FLOAT32, value)
    if isinstance(value, (str, bytes)):
        return Typed(STRING, value)
    if isinstance(value, np.ndarray):
        return Typed(ARRAY, value, _DTYPE_TYPES[value.dtype])
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return Typed(ARRAY, value, STRING)
    raise TypeError(f"give an explicit Typed(...) for {value!r}")


def pack_payload(vtype: int, value: Any, element_type: int | None = None) -> bytes:
    """A value's bytes without its type id (arrays: element type, count, elements)."""
    if vtype == STRING:
        return pack_string(value)
    if vtype == ARRAY:
        if isinstance(value, np.ndarray):
            body = value.astype(value.dtype.newbyteorder("<")).tobytes()
        else:
            body = b"".join(pack_payload(element_type, *_unwrap(item)) for item in value)
        return struct.pack("<IQ", element_type, len(value)) + body
    return struct.pack(_SCALAR_FORMATS[vtype], value)


def _unwrap(item: Any) -> tuple[Any, int | None]:
    # Array elements are plain values, except nested arrays, given as Typed(ARRAY, [...], type).
    return (item.value, item.element_type) if isinstance(item, Typed) else (item, None)


def pack_kv(key: str | bytes, value: Any) -> bytes:
    typed = _infer(value)
    if isinstance(typed, Raw):
        return pack_string(key) + struct.pack("<I", typed.vtype) + typed.payload
    return (pack_string(key) + struct.pack("<I", typed.vtype)
            + pack_payload(typed.vtype, typed.value, typed.element_type))


def pack_tensor_info(spec: TensorSpec, offset: int) -> bytes:
    return (pack_string(spec.name) + struct.pack("<I", len(spec.shape))
            + struct.pack(f"<{len(spec.shape)}q", *spec.shape)
            + struct.pack("<IQ", spec.ggml_type, offset))


def _pad(nbytes: int, alignment: int) -> int:
    return -nbytes % alignment


def build_gguf(kvs: Mapping[str, Any] | Iterable[tuple[str | bytes, Any]],
               tensors: Iterable[TensorSpec] = (), *, version: int = 3, alignment: int = 32,
               magic: bytes = b"GGUF", num_tensors: int | None = None,
               num_kvs: int | None = None) -> bytes:
    """A whole GGUF file. `alignment` lays out the data; unless 32 or already among `kvs`, it is
    also written as a uint32 `general.alignment`. Counts default to the real ones; a list of
    pairs may repeat keys. Each tensor's data is padded to the alignment, as writers do."""
    items = list(kvs.items() if isinstance(kvs, Mapping) else kvs)
    if alignment != 32 and "general.alignment" not in [key for key, _ in items]:
        items.append(("general.alignment", Typed(UINT32, alignment)))
    tensors = list(tensors)
    infos, data, running = [], [], 0
    for spec in tensors:
        infos.append(pack_tensor_info(spec, running if spec.offset is None else spec.offset))
        data.append(spec.data + bytes(_pad(len(spec.data), alignment)))
        running += len(data[-1])
    header = magic + struct.pack("<IQQ", version,
                                 len(tensors) if num_tensors is None else num_tensors,
                                 len(items) if num_kvs is None else num_kvs)
    head = header + b"".join(pack_kv(key, value) for key, value in items) + b"".join(infos)
    return head + bytes(_pad(len(head), alignment)) + b"".join(data)


def tiny_kvs() -> list[tuple[str, Any]]:
    """Metadata of the tiny valid file: scalars of several types and a string array."""
    return [
        ("general.architecture", "llama"),
        ("general.name", "tiny"),
        ("llama.block_count", Typed(UINT32, 1)),
        ("llama.rope.freq_base", 10000.0),
        ("tokenizer.ggml.tokens", ["<s>", "</s>", "hello", "wörld"]),
        ("tokenizer.ggml.scores", np.array([0.0, -1.0, -2.5, -3.0], np.float32)),
        ("tokenizer.ggml.add_bos_token", True),
    ]


def tiny_tensors() -> list[TensorSpec]:
    """One F32 tensor [2, 8] (64 bytes) and one Q8_0 tensor [2, 32] (2 blocks of 34 bytes)."""
    weights = np.arange(16, dtype=np.float32).tobytes()
    block = struct.pack("<e", 0.5) + np.arange(-16, 16, dtype=np.int8).tobytes()
    return [TensorSpec("token_embd.weight", (8, 2), F32, weights),
            TensorSpec("blk.0.attn_q.weight", (32, 2), Q8_0, block * 2)]


def build_tiny_gguf(**knobs: Any) -> bytes:
    """The tiny valid file; `build_gguf` knobs (version=..., num_kvs=...) corrupt its header."""
    return build_gguf(tiny_kvs(), tiny_tensors(), **knobs)
