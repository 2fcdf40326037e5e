"""The pack's layout, one walk for both the writer and the sizes the planner needs.

Each extent (the globals, a layer, an expert) holds its fields' arrays in the order of its
family's tensor map, each 64-byte aligned, the extent padded to 4 KiB. `ExtentLayout` walks the
fields once: given only the GGUF header it computes every array's offset and size (the planner's
byte counts, before anything is packed); given a `TensorDecoder` too, it also produces the bytes
(the writer), and each array it produces must have the size the walk computed. A field becomes:

    Vector   float32 [n]                                        [offset, nbytes]
    Matmul   one matrix when its parts agree on a format (float32, or one GroupLayout form: bits,
             group, codebook, width, zero code, mins and two-level scales), its rows the parts' rows
             in order, with the parts' biases (zeros where a part has none) concatenated; else a
             concatenation of one matrix per part:
                 {"kind": "dense", rows, cols, weight: [offset, nbytes], bias}
                 {"kind": "packed", rows, cols, bits, group, codebook, width, zero, data, high,
                  scales, mins, sub: null or {bits, offset, groups_per_super, with_mins, codes,
                  supers}, bias}
                 {"kind": "concat", parts: [...]}

Packed matrices are cpu_kernels/packed.py's layout (rows padded to tiles of 64; `packed_sizes`
gives each array's bytes): every type's bytes are the GGUF's own but TQ1_0's and MXFP4's. An
MXFP4 matrix with a block scale above 2^15 (a weight of magnitude 2^16 or more) has no codebook
form (quant_groups.py); the pack refuses it.

The bytes are produced in pieces: every array of a packed matrix leads with its row tiles, so a
range of whole tiles is one run of bytes in each, and a matrix is written as jobs of a range of
rows each (its GGUF rows are one run of bytes too). A job holds only its rows, about
`TensorDecoder.piece_bytes` in all (its output and temporaries: BYTES_PER_WEIGHT a weight, by how
it lays them out), whatever the tensor's size, so an embedding of 150k x 4k weights is never whole
in memory while it is laid out. The jobs write into a `Sink`: the extent's bytes in RAM (`fill`: the
load's own buffer, or the writer's for a small extent), or a file at the extent's offset (`write_to`:
the writer's large extents). Jobs of one extent run on a thread per core (`fill_threads`, held by a
load or a build for all its extents); a failed one's exception is raised once none is running.
"""

import errno
import functools
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np

from tierflow.cpu_kernels.dequant import dequantize
from tierflow.cpu_kernels.packed import (
    BLOCK_PACKED_TYPES,
    TILE_ROWS,
    PackedMatrix,
    UnpackableBlocks,
    block_array_shapes,
    field_bits,
    pack,
    sub_code_bytes,
    transcode_blocks,
)
from tierflow.cpu_kernels.quant_groups import (
    GROUPED_TYPES,
    GroupLayout,
    QuantGroups,
    group_layout,
    stack_rows,
    to_quant_groups,
)
from tierflow.errors import ModelFileError, TierflowError, UnsupportedModelError
from tierflow.offload.gguf.reader import GGUFFile
from tierflow.offload.io.disk import ALIGNMENT
from tierflow.runtime.models.tensor_map import Field, Matmul, Tensor, Vector, field_tensors

ARRAY_ALIGNMENT = 64
PIECE_BYTES = 8 << 20  # a job's RAM by default: 1024 rows of a 4096-wide matrix written from its blocks
# RAM a job takes per weight of its rows, by how it lays them out (output and temporaries): C's
# transcoding writes at most 9 bits a weight and reads the GGUF's bytes; numpy's packing of quant
# groups holds a byte of code per weight several times over (bit planes, tiles); a float32 matrix its
# output and the decoded rows.
BYTES_PER_WEIGHT = {"transcode": 2, "numpy": 12, "dense": 8}


@dataclass(frozen=True)
class LinearSize:
    nbytes: int
    bits: int | None  # None: a float32 matrix, computed by torch


def packed_sizes(fmt: GroupLayout, rows: int, cols: int) -> dict[str, int]:
    """The bytes of each array of a packed matrix of this layout (packed.py's docstring), from the
    header alone: data, high, params (the float16 scales, and as many again for mins), sub_codes and
    supers (two-level scales)."""
    padded = -(-rows // TILE_ROWS) * TILE_ROWS
    field = fmt.bits if fmt.bits != 8 else field_bits(fmt.width, fmt.codebook is not None)
    data = padded * cols * field // 8
    high = padded * cols * (fmt.width - field) // 8 if fmt.bits == 8 and fmt.codebook is None else 0
    params = padded * (cols // fmt.group) * 2
    if fmt.sub is None:
        return {"data": data, "high": high, "params": params, "sub_codes": 0, "supers": 0}
    supers = padded * (cols // fmt.group // fmt.sub.groups_per_super)
    code_bytes = sub_code_bytes(fmt.sub.bits, fmt.sub.groups_per_super, fmt.sub.with_mins)
    return {"data": data, "high": high, "params": params, "sub_codes": supers * code_bytes,
            "supers": supers * 2 * (2 if fmt.sub.with_mins else 1)}


@dataclass(frozen=True)
class ExtentSize:
    nbytes: int  # padded to ALIGNMENT
    groups: tuple[tuple[str, int], ...]  # (plan group, bytes) in order, adding up to nbytes
    linears: tuple[LinearSize, ...]  # the matmuls a pass computes with it


class TensorDecoder:
    """A GGUF's tensors decoded for the pack: quant groups (the packed kernels' input) or float32,
    counting the source bytes decoded for a progress callback.

    piece_bytes bounds what one job holds (module docstring). release_bytes: once this many bytes of
    the GGUF were decoded since the last time, the file's mapped pages are dropped from the process's
    memory (GGUFFile.release_pages: they stay in the page cache), so that reading a large model does
    not make its RSS the file's size; None: never (the caller releases them)."""

    def __init__(self, gguf: GGUFFile, progress: Callable[[int], None] | None = None,
                 piece_bytes: int = PIECE_BYTES, release_bytes: int | None = None):
        self.gguf, self.progress = gguf, progress
        self.piece_bytes, self.release_bytes = piece_bytes, release_bytes
        self._counting = threading.Lock()  # extents are filled by several threads
        self._unreleased = 0

    def rows_per_job(self, cols: int, how: str) -> int:
        """Rows of a [rows, cols] matrix one job lays out (`how`: a BYTES_PER_WEIGHT key): whole
        tiles, as many as piece_bytes allows, at least one tile."""
        rows = self.piece_bytes // (BYTES_PER_WEIGHT[how] * max(cols, 1))
        return max(TILE_ROWS, rows // TILE_ROWS * TILE_ROWS)

    def rows(self, tensor: Tensor, first: int, end: int, grouped: bool) -> QuantGroups | np.ndarray:
        """Rows first .. end of the tensor (or of its expert slice) as a matrix [end - first, cols]:
        quant groups, or float32."""
        data, info = self._data(tensor, counted=False), self.gguf.tensors[tensor.name]
        rows, cols = tensor.matrix_shape
        row_bytes = data.nbytes // rows
        if row_bytes * rows != data.nbytes:
            raise AssertionError(f"tensor '{tensor.name}': {data.nbytes} bytes are not {rows} rows")
        part = data[first * row_bytes: end * row_bytes]
        self.count(part.nbytes)
        if grouped:
            return to_quant_groups(part, info.ggml_type, (cols, end - first))
        values = dequantize(part, info.ggml_type, (cols, end - first)).reshape(end - first, cols)
        return self._finite(tensor, values, first * cols)

    def matrix(self, tensor: Tensor, grouped: bool) -> QuantGroups | np.ndarray:
        """The tensor (or its expert slice) as a matrix [rows, cols]."""
        data, info = self._data(tensor), self.gguf.tensors[tensor.name]
        if grouped:
            return to_quant_groups(data, info.ggml_type, info.shape[:2])
        rows, cols = tensor.matrix_shape
        shape = info.shape[:2] if tensor.expert is not None else info.shape
        return self._finite(tensor, dequantize(data, info.ggml_type, shape).reshape(rows, cols))

    def blocks(self, tensor: Tensor) -> tuple[np.ndarray, tuple[int, int]]:
        """The tensor's (or its expert slice's) GGUF bytes and GGUF-order shape [cols, rows], not yet
        counted as decoded: the caller counts what it decodes of them."""
        return self._data(tensor, counted=False), self.gguf.tensors[tensor.name].shape[:2]

    def count(self, nbytes: int) -> None:
        """Reports `nbytes` more of the source decoded (from any thread), and drops the file's
        mapped pages every release_bytes."""
        with self._counting:
            if self.progress is not None:
                self.progress(nbytes)
            self._unreleased += nbytes
            if self.release_bytes is not None and self._unreleased >= self.release_bytes:
                self.gguf.release_pages()  # pages another job is reading are mapped again as it reads
                self._unreleased = 0

    def vector(self, tensor: Tensor) -> np.ndarray:
        """The tensor's values (an expert's: its slice of a stacked [rows, experts] bias)."""
        info = self.gguf.tensors[tensor.name]
        shape = info.shape[:-1] if tensor.expert is not None else info.shape
        return self._finite(tensor, dequantize(self._data(tensor), info.ggml_type, shape).reshape(-1))

    def _finite(self, tensor: Tensor, values: np.ndarray, first: int = 0) -> np.ndarray:
        """values (the tensor's from element `first` on), refused when one is NaN or infinite: such a
        weight makes every answer "" or garbage, so the file is refused at load, naming the tensor."""
        if not np.isfinite(values).all():
            where = int(np.flatnonzero(~np.isfinite(values.reshape(-1)))[0])
            raise ModelFileError(f"{self.gguf.path.name}: tensor '{tensor.name}' holds a value that is not "
                                 f"a finite number ({values.reshape(-1)[where]} at element {first + where}; "
                                 f"the file is damaged)")
        return values

    def _data(self, tensor: Tensor, counted: bool = True) -> np.ndarray:
        info, data = self.gguf.tensors[tensor.name], self.gguf.tensor_data(tensor.name)
        if tensor.expert is not None:  # the experts are the outermost dimension: each a run of bytes
            per_expert = info.nbytes // info.shape[-1]
            data = data[tensor.expert * per_expert: (tensor.expert + 1) * per_expert]
        if counted:
            self.count(len(data))
        return data


class ExtentLayout:
    """One extent's arrays, laid out field by field; with a decoder, their bytes too."""

    def __init__(self, gguf: GGUFFile, decoder: TensorDecoder | None = None):
        self.gguf, self.decoder = gguf, decoder
        self.size = 0
        self.spec: dict = {}  # field name -> its arrays (the manifest's "weights")
        self.jobs: list[Callable[[np.ndarray], None]] = []  # each writes some arrays into the extent
        self.linears: list[LinearSize] = []
        self._groups: list[tuple[str, int]] = []  # (group, offset where it starts)

    def add_fields(self, fields: list[Field]) -> "ExtentLayout":
        for field in fields:
            if not field_tensors(field, self.gguf.tensors):
                continue  # an optional field the file does not have
            if not self._groups or self._groups[-1][0] != field.group:
                self._groups.append((field.group, self._aligned()))
            if isinstance(field.kind, Vector):
                self.spec[field.name] = self._vector(field.kind.tensor)
            else:
                self.spec[field.name] = self._matmul(field.kind)
        return self

    def extent_size(self) -> ExtentSize:
        padded = -(-self.size // ALIGNMENT) * ALIGNMENT
        starts = [start for _, start in self._groups[1:]] + [padded]
        groups = tuple((name, end - (0 if i == 0 else start))
                       for i, ((name, start), end) in enumerate(zip(self._groups, starts)))
        return ExtentSize(padded, groups, tuple(self.linears))

    def bytes(self) -> np.ndarray:
        """The extent's bytes (uint8, padded), with every array filled in."""
        return self.fill(np.zeros(self.extent_size().nbytes, np.uint8))

    def fill(self, out: np.ndarray) -> np.ndarray:
        """Writes every array into `out` (uint8, at least the extent's size), in place, on a thread per
        core (the C transcoder and numpy's copies let go of the GIL); the padding between arrays is
        left as it is."""
        self._run_jobs(InPlace(out))
        return out

    def write_to(self, fd: int, offset: int) -> None:
        """Writes every array to the file `fd` at `offset` + its place, a job's piece at a time (the
        padding between arrays is not written: a new file reads zeros there)."""
        self._run_jobs(ToFile(fd, offset))

    def _run_jobs(self, sink: "Sink") -> None:
        """Runs the jobs, once: they refer back to the layout, which refers to the GGUF's map and
        metadata, so they go as they end rather than when the garbage collector finds the cycle."""
        jobs, self.jobs = self.jobs, []
        _run(jobs, sink)

    # -- the walk -----------------------------------------------------------------------------

    def _aligned(self) -> int:
        return -(-self.size // ARRAY_ALIGNMENT) * ARRAY_ALIGNMENT

    def _reserve(self, nbytes: int) -> list[int]:
        at = self._aligned()
        self.size = at + nbytes
        return [at, nbytes]

    def _array(self, nbytes: int, fill: Callable[[], np.ndarray]) -> list[int]:
        place = self._reserve(nbytes)
        if self.decoder is not None:
            self.jobs.append(lambda sink: _put(sink, place, fill()))
        return place

    def _vector(self, tensor: Tensor) -> list[int]:
        count = int(np.prod(tensor.shape))
        return self._array(4 * count, lambda: self.decoder.vector(tensor).astype(np.float32))

    def _matmul(self, kind: Matmul) -> dict:
        parts = [(weight, self._bias(kind, weight)) for weight in kind.weights]
        fmt = self._format(parts[0][0])
        if all(_same_form(self._format(weight), fmt) for weight, _ in parts):
            spec = self._matrix(parts, fmt)
        else:
            spec = {"kind": "concat", "parts": [self._matrix([part], self._format(part[0]))
                                                for part in parts]}
        return spec

    def _bias(self, kind: Matmul, weight: Tensor) -> Tensor | None:
        bias = kind.bias_tensor(weight)
        if kind.bias == "required" or kind.bias == "optional" and bias.name in self.gguf.tensors:
            return bias
        return None

    def _format(self, tensor: Tensor) -> GroupLayout | None:
        """The layout of a tensor the packed kernels compute; None: float32 (torch)."""
        ggml_type = self.gguf.tensors[tensor.name].ggml_type
        if ggml_type not in GROUPED_TYPES or len(tensor.shape) < 2:
            return None
        return group_layout(ggml_type)

    def _matrix(self, parts: list[tuple[Tensor, Tensor | None]], fmt: GroupLayout | None) -> dict:
        weights = [weight for weight, _ in parts]
        rows, cols = sum(w.matrix_shape[0] for w in weights), weights[0].matrix_shape[1]
        spec = {"rows": rows, "cols": cols, "bias": None}
        if any(bias is not None for _, bias in parts):
            spec["bias"] = self._array(4 * rows, lambda: self._biases(parts))
        if fmt is None:
            self.linears.append(LinearSize(4 * rows * cols, None))
            place = self._reserve(4 * rows * cols)
            if self.decoder is not None:
                step = self.decoder.rows_per_job(cols, "dense")
                self.jobs += [functools.partial(self._dense_rows, weights, place, first,
                                                min(first + step, rows)) for first in range(0, rows, step)]
            return spec | {"kind": "dense", "weight": place}
        sizes = packed_sizes(fmt, rows, cols)
        with_mins = fmt.sub is None and fmt.has_min
        places = {"data": self._reserve(sizes["data"])}  # in the pack's order of arrays
        if sizes["high"]:
            places["high"] = self._reserve(sizes["high"])
        if fmt.sub is None:
            places["scales"] = self._reserve(sizes["params"])
        if with_mins:
            places["mins"] = self._reserve(sizes["params"])
        if fmt.sub is not None:
            places["sub_codes"] = self._reserve(sizes["sub_codes"])
            places["supers"] = self._reserve(sizes["supers"])
        spec |= {"kind": "packed", "bits": fmt.bits, "group": fmt.group, "codebook": fmt.codebook,
                 "width": fmt.width if fmt.bits == 8 else 8, "zero": fmt.zero, "data": places["data"],
                 "high": places.get("high"), "scales": places.get("scales"), "mins": places.get("mins"),
                 "sub": None if fmt.sub is None else {
                     "bits": fmt.sub.bits, "offset": fmt.sub.offset,
                     "groups_per_super": fmt.sub.groups_per_super, "with_mins": fmt.sub.with_mins,
                     "codes": places["sub_codes"], "supers": places["supers"]}}
        self._packing_jobs(weights, rows, cols, with_mins, fmt.codebook, places)
        self.linears.append(LinearSize(sum(nbytes for _, nbytes in places.values()), fmt.bits))
        return spec

    def _packing_jobs(self, weights: list[Tensor], rows: int, cols: int, with_mins: bool,
                      codebook: str | None, places: dict[str, list[int]]) -> None:
        """The jobs that write a packed matrix's arrays, each a range of whole tiles of rows: written
        straight from the GGUF's blocks where every part is of one BLOCK_PACKED_TYPES type, else
        packed from their quant groups (numpy) and copied into place."""
        if self.decoder is None:
            return
        types = {self.gguf.tensors[w.name].ggml_type for w in weights}
        if len(types) == 1 and types <= BLOCK_PACKED_TYPES:
            ggml_type = types.pop()
            step = self.decoder.rows_per_job(cols, "transcode")
            self.jobs += [functools.partial(self._transcode, weights, ggml_type, places, cols, first,
                                            min(first + step, rows)) for first in range(0, rows, step)]
            return
        step = self.decoder.rows_per_job(cols, "numpy")
        self.jobs += [functools.partial(self._pack_rows, weights, with_mins, codebook, places, first,
                                        min(first + step, rows)) for first in range(0, rows, step)]

    def _transcode(self, weights: list[Tensor], ggml_type: int, places: dict[str, list[int]], cols: int,
                   first: int, end: int, sink: "Sink") -> None:
        """Rows first .. end (whole tiles from `first`) of the stacked parts, from their GGUF blocks."""
        arrays = {name: sink.array(_tile_at(places[name], first, shape, dtype), shape, dtype)
                  for name, (shape, dtype) in block_array_shapes(ggml_type, end - first, cols).items()}
        parts, indices = [], []
        for index, (weight, low, stop) in _row_parts(weights, first, end):
            raw, (part_cols, _) = self.decoder.blocks(weight)
            row_bytes = raw.nbytes // weight.matrix_shape[0]
            parts.append((raw[low * row_bytes: stop * row_bytes], (part_cols, stop - low)))
            indices.append(index)
        try:
            transcode_blocks(parts, ggml_type, arrays)
        except UnpackableBlocks as error:
            raise self._refusal(weights[indices[error.part]], ggml_type) from None
        for name, array in arrays.items():
            sink.done(_tile_at(places[name], first, array.shape, array.dtype), array)
        self.decoder.count(sum(raw.nbytes for raw, _ in parts))

    def _pack_rows(self, weights: list[Tensor], with_mins: bool, codebook: str | None,
                   places: dict[str, list[int]], first: int, end: int, sink: "Sink") -> None:
        """Rows first .. end of the stacked parts packed from their quant groups, copied into place."""
        parts = [(weight, self.decoder.rows(weight, low, stop, True))
                 for _, (weight, low, stop) in _row_parts(weights, first, end)]
        packed = self._packed([weight for weight, _ in parts], with_mins, codebook,
                              [groups for _, groups in parts])
        sub = packed.sub
        arrays = {"data": packed.data, "high": packed.high, "scales": packed.scales, "mins": packed.mins,
                  "sub_codes": sub and sub.codes, "supers": sub and sub.supers}
        for name, place in places.items():
            array = arrays[name]
            sink.put(_tile_at(place, first, array.shape, array.dtype), array)

    def _dense_rows(self, weights: list[Tensor], place: list[int], first: int, end: int,
                    sink: "Sink") -> None:
        """Rows first .. end of the stacked parts in float32."""
        cols = weights[0].matrix_shape[1]
        out = sink.array(place[0] + first * cols * 4, (end - first, cols), np.float32)
        done = 0
        for _, (weight, low, stop) in _row_parts(weights, first, end):
            out[done: done + stop - low] = self.decoder.rows(weight, low, stop, False)
            done += stop - low
        sink.done(place[0] + first * cols * 4, out)

    def _packed(self, weights: list[Tensor], with_mins: bool, codebook: str | None,
                groups: list[QuantGroups] | None = None) -> PackedMatrix:
        """The tensors (or `groups`: some of their rows) packed as one matrix. A scale or offset that
        is not a number means a damaged file; one too large for the packed layout's float16 (a Q4_0
        block of scale 65504 has an offset of -8 x 65504), or an MXFP4 scale without a codebook form,
        is a file tierflow cannot hold."""
        if groups is None:
            groups = [self.decoder.matrix(w, True) for w in weights]
        names = ", ".join(f"'{w.name}'" for w in weights)
        for weight, group in zip(weights, groups):
            if not (np.isfinite(group.scale).all() and np.isfinite(group.min).all()):
                raise self._damaged(weight)
        if any(group.codebook != codebook for group in groups):
            raise UnsupportedModelError(f"{self.gguf.path.name}: tensor {names}: MXFP4 block scales above "
                                        f"2^15 are not supported (tierflow packs MXFP4 as 4-bit codes with "
                                        f"float16 scales)")
        try:
            return pack(stack_rows(groups), with_mins)
        except ValueError as error:
            raise UnsupportedModelError(f"{self.gguf.path.name}: tensor {names}: {error} (tierflow's packed "
                                        f"layout keeps block scales and offsets in float16)") from None

    def _refusal(self, weight: Tensor, ggml_type: int) -> TierflowError:
        """The error for a tensor whose blocks the transcoder refused: the one packing its quant groups
        raises, which says which scale and why (not a number, or too large or small for float16)."""
        fmt = group_layout(ggml_type)
        try:
            self._packed([weight], fmt.sub is None and fmt.has_min, fmt.codebook)
        except TierflowError as error:
            return error
        raise AssertionError(f"the transcoder refused tensor '{weight.name}', which packs in numpy")

    def _damaged(self, weight: Tensor) -> ModelFileError:
        return ModelFileError(f"{self.gguf.path.name}: tensor '{weight.name}' has block scales that are not "
                              f"finite numbers (the file is damaged)")

    def _biases(self, parts: list[tuple[Tensor, Tensor | None]]) -> np.ndarray:
        return np.concatenate([np.zeros(weight.matrix_shape[0], np.float32) if bias is None
                               else self.decoder.vector(bias).astype(np.float32) for weight, bias in parts])


def _same_form(a: GroupLayout | None, b: GroupLayout | None) -> bool:
    """Whether two tensors' layouts stack into one packed matrix (or are both float32)."""
    return a is None and b is None or a is not None and b is not None and a.form == b.form


def _row_parts(weights: list[Tensor], first: int, end: int) -> Iterator[tuple[int, tuple[Tensor, int, int]]]:
    """(index, (part, low, stop)): the rows low .. stop of each part that rows first .. end of the
    parts stacked in order cover."""
    start = 0
    for index, weight in enumerate(weights):
        rows = weight.matrix_shape[0]
        low, stop = max(first, start), min(end, start + rows)
        if low < stop:
            yield index, (weight, low - start, stop - start)
        start += rows


def _tile_at(place: list[int], first: int, shape: tuple[int, ...], dtype) -> int:
    """Where, in an array at `place` whose first axis is row tiles, the tiles from row `first` of
    a piece of this shape start."""
    at, nbytes = place
    tile_bytes = math.prod(shape[1:]) * np.dtype(dtype).itemsize
    start = first // TILE_ROWS * tile_bytes
    if start + shape[0] * tile_bytes > nbytes:
        raise AssertionError(f"the pack's layout expected {nbytes} bytes, the writer writes past them")
    return at + start


class Sink:
    """Where jobs write an extent's arrays: `array` gives a job the array it fills in place of the
    bytes at `at` (the extent's offsets), `done` takes it once filled; `put` takes one the job made."""

    def array(self, at: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        raise NotImplementedError

    def done(self, at: int, array: np.ndarray) -> None:
        raise NotImplementedError

    def put(self, at: int, array: np.ndarray) -> None:
        out = self.array(at, array.shape, array.dtype)
        out[...] = array
        self.done(at, out)


class InPlace(Sink):
    """The extent's bytes in RAM: arrays are views of them."""

    def __init__(self, out: np.ndarray):
        self.out = out

    def array(self, at: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if at + nbytes > self.out.nbytes:
            raise AssertionError(f"the writer writes past the extent's {self.out.nbytes} bytes")
        return self.out[at: at + nbytes].view(dtype).reshape(shape)

    def done(self, at: int, array: np.ndarray) -> None:
        pass


class ToFile(Sink):
    """A file the extent is written to at `offset`: arrays are the job's own, written when done."""

    def __init__(self, fd: int, offset: int):
        self.fd, self.offset = fd, offset

    def array(self, at: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def done(self, at: int, array: np.ndarray) -> None:
        write_all(self.fd, np.ascontiguousarray(array).reshape(-1).view(np.uint8), self.offset + at)

    def put(self, at: int, array: np.ndarray) -> None:
        self.done(at, array)


def write_all(fd: int, data: np.ndarray | bytes | memoryview, offset: int) -> None:
    """os.pwrite until every byte is written (a regular file's writes stop short only when full)."""
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        count = os.pwrite(fd, view[done:], offset + done)
        if count == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += count


def _run(jobs: list[Callable[[Sink], None]], sink: Sink) -> None:
    """Runs the jobs on the fill threads; raises the first one's exception (in job order) once none is
    running any more (a job still writing after a failure could write into a file closed meanwhile)."""
    with fill_threads() as threads:
        futures = [threads.submit(job, sink) for job in jobs]
        error = None
        try:
            for future in futures:
                try:
                    future.result()
                except CancelledError:
                    pass
                except Exception as failure:
                    if error is None:
                        error = failure
                        for other in futures:
                            other.cancel()
        finally:
            for future in futures:
                future.cancel()
            wait(futures)
    if error is not None:
        raise error


class _FillThreads:
    """The threads extents are filled on, a thread per core, shared by whoever holds them: started by
    the first holder, stopped by the last. A load or a build holds them for all its extents (a MoE
    model has thousands of small ones, and threads of their own would cost each one their start), and
    no thread outlives it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._pool: ThreadPoolExecutor | None = None

    @contextmanager
    def held(self) -> Iterator[ThreadPoolExecutor]:
        with self._lock:
            if self._holders == 0:
                self._pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tierflow-pack")
            self._holders += 1
            pool = self._pool
        try:
            yield pool
        finally:
            with self._lock:
                self._holders -= 1
                last = self._holders == 0
                if last:
                    self._pool = None
            if last:
                pool.shutdown(wait=True)


_FILL_THREADS = _FillThreads()


def fill_threads() -> AbstractContextManager[ThreadPoolExecutor]:
    """The fill threads, held for the block: `with fill_threads():` around a load's or a build's
    extents keeps them running from the first extent to the last."""
    return _FILL_THREADS.held()


def _put(sink: Sink, place: list[int], array: np.ndarray) -> None:
    """Puts an array at its place [offset, nbytes] in the extent's bytes."""
    at, nbytes = place
    if array.nbytes != nbytes:
        raise AssertionError(f"the pack's layout expected {nbytes} bytes, the writer made {array.nbytes}")
    sink.put(at, np.ascontiguousarray(array).reshape(-1).view(np.uint8))
