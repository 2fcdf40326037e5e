"""Reading a pack: its manifest, and weights that view its extents' bytes (in RAM or on a device).

The layout is offload/pack/layout.py's, the file format writer.py's. A reader builds `Weights`
field by field from the manifest, whatever the family: a vector is a float32 array, a matmul a
linear the kernels of its device compute (PackedLinear or DenseLinear on the CPU, DeviceLinear on
a GPU), so a field the tensor map declares is never dropped on any tier.
"""

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tierflow.cpu_kernels.checksum import crc32
from tierflow.cpu_kernels.linear import PackedLinear
from tierflow.cpu_kernels.packed import TILE_ROWS, PackedMatrix, SubPacking, field_bits
from tierflow.errors import ModelFileError
from tierflow.gpu_kernels.matmul import DeviceLinear
from tierflow.gpu_kernels.packed import view_matrix
from tierflow.runtime.compute.cpu import DenseLinear
from tierflow.runtime.compute.interfaces import ConcatLinear, Experts, Kernels, Linear, Weights

PACK_VERSION = 7  # 4: the source identified by device, inode and sampled content; 5: codebook nibbles;
# 6: every type in the GGUF's own bytes (nibble codes with high planes, zero codes, two-level scales);
# 7: Q2_K and Q3_K as the int8 kernel's 2-bit fields (and high plane), not LUT bit planes
MAGIC = b"TFPACK01"
TRAILER = struct.Struct("<8sQQI")  # magic, manifest offset, manifest size, manifest CRC-32


@dataclass(frozen=True)
class Extent:
    offset: int
    nbytes: int
    crc32: int
    weights: dict  # field name -> its arrays (see layout.py)


class PackedFile:
    """A pack's manifest; the extents' bytes are read by the caller (see offload/io/disk.py), or, for
    a pack built in RAM (built.BuiltPack: path None), built by it."""

    def __init__(self, path: Path | None, manifest: dict | None = None):
        self.path = None if path is None else Path(path)
        manifest = _read_manifest(self.path) if manifest is None else manifest
        self.source = manifest["source"]
        self.globals = Extent(**manifest["globals"])
        self.layers = [Extent(**extent) for extent in manifest["layers"]]
        self.experts = [[Extent(**extent) for extent in layer] for layer in manifest["experts"]]
        # the offsets of extents whose bytes matched, read while the file's ctime was the one given
        self._checked: tuple[int | None, set[int]] = (None, set())

    @property
    def largest_layer_bytes(self) -> int:
        return max((extent.nbytes for extent in self.layers), default=0)

    def check(self, extent: Extent, data: memoryview, fd: int | None = None, changed: int | None = None
              ) -> None:
        """Raises ModelFileError unless `data` holds the extent's bytes (its CRC-32: cpu_kernels/
        checksum.py). The damaged pack is then deleted, if the file at its path is still the one
        read through `fd`, so that the next load rebuilds it.

        `changed`: the file's ctime taken before `data` was read (DiskFile.changed). The extent is
        then hashed only if its bytes have not matched at a read since the ctime last moved: any
        change after that earlier read moves the ctime past the one it was read under. Hashing
        every read of a streamed MoE model's experts (1 ms of a core per 14 MiB expert) took
        15-20% of a token from the kernels on two cores. Where ctimes are kept to a clock tick
        (kernels before multigrain timestamps), two changes within one tick and a read between
        them could share a ctime."""
        checked_at, checked = self._checked
        if changed is not None and changed != checked_at:
            checked = set()
            self._checked = changed, checked  # one assignment: readers on other threads see both or neither
        if changed is not None and extent.offset in checked:
            return
        if crc32(data) != extent.crc32:
            if fd is not None:
                _discard_if_open(self.path, fd)
            raise ModelFileError(f"{self.path.name}: the packed weights at byte {extent.offset} are "
                                 f"damaged (checksum mismatch); it is rebuilt on the next load")
        if changed is not None:
            checked.add(extent.offset)

    def layer_weights(self, index: int, data: memoryview, experts: Experts | None = None) -> Weights:
        """Layer `index`'s weights viewing its extent's bytes (held by the caller); a MoE layer's
        experts come from `experts`, which the caller places."""
        return Weights(extent_fields(self.layers[index].weights, data), experts=experts)

    def expert_weights(self, index: int, expert: int, data: memoryview) -> Weights:
        return Weights(extent_fields(self.experts[index][expert].weights, data))

    def device_layer_weights(self, index: int, buffer: torch.Tensor, kernels: Kernels,
                             experts: Experts | None = None) -> Weights:
        """Layer `index`'s weights viewing its extent as uploaded to a device (uint8 [bytes]),
        computed there by `kernels` (gpu_kernels.layer_kernels.TritonKernels): no re-layout."""
        return Weights(_device_fields(self.layers[index].weights, buffer), kernels, experts)

    def device_expert_weights(self, index: int, expert: int, buffer: torch.Tensor,
                              kernels: Kernels) -> Weights:
        return Weights(_device_fields(self.experts[index][expert].weights, buffer), kernels)

    def global_weights(self, data: memoryview) -> dict:
        """embedding (PackedMatrix or float32 [V, E]), output_norm, output (Linear: the embedding's
        when tied), rope_freqs (None when the file has none)."""
        spec = self.globals.weights
        embedding = _matrix(data, spec["token_embd"])
        output = _linear(data, spec["output"]) if "output" in spec else _as_linear(embedding, None)
        rope = spec.get("rope_freqs")
        return {"embedding": embedding, "output_norm": _array(data, spec["output_norm"], np.float32),
                "output": output,
                "rope_freqs": None if rope is None else torch.from_numpy(_array(data, rope, np.float32))}


def _discard_if_open(path: Path, fd: int) -> None:
    """Deletes a damaged pack, unless another process has already put a new one at its path (the
    reader keeps reading its open file either way)."""
    try:
        opened, current = os.fstat(fd), os.stat(path)
    except OSError:
        return
    if (opened.st_dev, opened.st_ino) == (current.st_dev, current.st_ino):
        path.unlink(missing_ok=True)


def _read_manifest(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < TRAILER.size:
                raise ValueError("too short")
            f.seek(size - TRAILER.size)
            magic, offset, length, crc = TRAILER.unpack(f.read(TRAILER.size))
            if magic != MAGIC or offset + length + TRAILER.size != size:
                raise ValueError("bad trailer")
            f.seek(offset)
            raw = f.read(length)
        if crc32(raw) != crc:
            raise ValueError("manifest checksum mismatch")
        manifest = json.loads(raw)
        if manifest.get("version") != PACK_VERSION:
            raise ValueError(f"format version {manifest.get('version')}")
        return manifest
    except (OSError, ValueError, KeyError) as error:
        raise ModelFileError(f"{path.name}: not a valid tierflow pack ({error})") from error


def extent_fields(spec: dict, data: memoryview) -> dict:
    """An extent's fields (a Weights' dict) viewing its bytes, laid out as its spec (the manifest's
    "weights") says."""
    return {name: _array(data, arrays, np.float32) if isinstance(arrays, list) else _linear(data, arrays)
            for name, arrays in spec.items()}


def _device_fields(spec: dict, buffer: torch.Tensor) -> dict:
    return {name: _device_array(buffer, arrays, torch.float32) if isinstance(arrays, list)
            else _device_linear(buffer, arrays) for name, arrays in spec.items()}


def _array(data: memoryview, spec: list, dtype) -> np.ndarray:
    at, nbytes = spec
    return np.frombuffer(data, dtype, nbytes // np.dtype(dtype).itemsize, at)


def _matrix(data: memoryview, spec: dict) -> PackedMatrix | torch.Tensor:
    rows, cols = spec["rows"], spec["cols"]
    if spec["kind"] == "dense":
        return torch.from_numpy(_array(data, spec["weight"], np.float32).reshape(rows, cols))
    bits, group, codebook, width = spec["bits"], spec["group"], spec["codebook"], spec["width"]
    tiles = -(-rows // TILE_ROWS)
    if bits != 8:
        codes = _array(data, spec["data"], np.uint8).reshape(tiles, cols // 8, bits, TILE_ROWS)
    elif codebook is not None or width < 8:
        field = field_bits(width, codebook is not None)
        codes = _array(data, spec["data"], np.uint8).reshape(tiles, cols * field // 32, TILE_ROWS, 4)
    else:
        codes = _array(data, spec["data"], np.int8).reshape(tiles, cols // 4, TILE_ROWS, 4)
    high = spec["high"] and _array(data, spec["high"], np.uint8).reshape(tiles, -1, TILE_ROWS, 4)
    params = (tiles, cols // group, TILE_ROWS)
    scales, mins = (None if spec[name] is None else _array(data, spec[name], np.float16).reshape(params)
                    for name in ("scales", "mins"))
    sub = spec["sub"]
    if sub is not None:
        shape = (tiles, cols // group // sub["groups_per_super"], -1, TILE_ROWS)
        sub = SubPacking(_array(data, sub["codes"], np.uint8).reshape(shape),
                         _array(data, sub["supers"], np.float16).reshape(shape), sub["bits"], sub["offset"],
                         sub["groups_per_super"], sub["with_mins"])
    return PackedMatrix(rows, cols, bits, group, codes, scales, mins, codebook, width, spec["zero"], high,
                        sub)


def _as_linear(matrix: PackedMatrix | torch.Tensor, bias: np.ndarray | None) -> Linear:
    if isinstance(matrix, torch.Tensor):
        return DenseLinear(matrix, bias)
    return PackedLinear(matrix, bias)


def _linear(data: memoryview, spec: dict) -> Linear:
    if spec["kind"] == "concat":
        return ConcatLinear([_linear(data, part) for part in spec["parts"]])
    bias = None if spec["bias"] is None else _array(data, spec["bias"], np.float32)
    return _as_linear(_matrix(data, spec), bias)


def _device_array(buffer: torch.Tensor, spec: list, dtype: torch.dtype) -> torch.Tensor:
    at, nbytes = spec
    return buffer[at: at + nbytes].view(dtype)


def _device_linear(buffer: torch.Tensor, spec: dict) -> Linear:
    if spec["kind"] == "concat":
        return ConcatLinear([_device_linear(buffer, part) for part in spec["parts"]])
    bias = None if spec["bias"] is None else _device_array(buffer, spec["bias"], torch.float32)
    if spec["kind"] == "dense":
        weight = _device_array(buffer, spec["weight"], torch.float32).view(spec["rows"], spec["cols"])
        return DeviceLinear(weight, bias)
    return DeviceLinear(view_matrix(buffer, spec), bias)
