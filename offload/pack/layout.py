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
"""

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
TRANSCODED_ROWS = 16 * TILE_ROWS  # rows per job of a matrix written from its GGUF blocks


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
    counting the source bytes decoded for a progress callback."""

    def __init__(self, gguf: GGUFFile, progress: Callable[[int], None] | None = None):
        self.gguf, self.progress = gguf, progress
        self._counting = threading.Lock()  # extents are filled by several threads

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
        """Reports `nbytes` more of the source decoded (from any thread)."""
        if self.progress is not None:
            with self._counting:
                self.progress(nbytes)

    def vector(self, tensor: Tensor) -> np.ndarray:
        """The tensor's values (an expert's: its slice of a stacked [rows, experts] bias)."""
        info = self.gguf.tensors[tensor.name]
        shape = info.shape[:-1] if tensor.expert is not None else info.shape
        return self._finite(tensor, dequantize(self._data(tensor), info.ggml_type, shape).reshape(-1))

    def _finite(self, tensor: Tensor, values: np.ndarray) -> np.ndarray:
        """values, refused when one is NaN or infinite: such a weight makes every answer "" or
        garbage, so the file is refused at load, naming the tensor."""
        if not np.isfinite(values).all():
            where = int(np.flatnonzero(~np.isfinite(values.reshape(-1)))[0])
            raise ModelFileError(f"{self.gguf.path.name}: tensor '{tensor.name}' holds a value that is not "
                                 f"a finite number ({values.reshape(-1)[where]} at element {where}; the file "
                                 f"is damaged)")
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
        """The extent's bytes (uint8, padded), with every array filled in: the writer's."""
        return self.fill(np.zeros(self.extent_size().nbytes, np.uint8))

    def fill(self, out: np.ndarray) -> np.ndarray:
        """Writes every array into `out` (uint8, at least the extent's size), in place, on a thread per
        core (the C transcoder and numpy's copies let go of the GIL); the padding between arrays is
        left as it is."""
        for _ in _fill_threads().map(lambda job: job(out), self.jobs):
            pass  # each job's exception, if any, is raised here
        return out

    # -- the walk -----------------------------------------------------------------------------

    def _aligned(self) -> int:
        return -(-self.size // ARRAY_ALIGNMENT) * ARRAY_ALIGNMENT

    def _reserve(self, nbytes: int) -> list[int]:
        at = self._aligned()
        self.size = at + nbytes
        return [at, nbytes]

    def _array(self, nbytes: int, fill: Callable[[], np.ndarray]) -> list[int]:
        place = self._reserve(nbytes)
        self.jobs.append(lambda out: _put(out, place, fill()))
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
            return spec | {"kind": "dense", "weight": self._array(
                4 * rows * cols, lambda: np.concatenate([self.decoder.matrix(w, False) for w in weights]))}
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
        """The jobs that write a packed matrix's arrays: ranges of TRANSCODED_ROWS rows written
        straight from the GGUF's blocks where every part is of one BLOCK_PACKED_TYPES type, else one
        job that packs the whole matrix (quant groups, numpy) and copies its arrays into place."""
        types = {self.gguf.tensors[w.name].ggml_type for w in weights}
        if len(types) == 1 and types <= BLOCK_PACKED_TYPES:
            ggml_type = types.pop()
            shapes = block_array_shapes(ggml_type, rows, cols)
            for first in range(0, rows, TRANSCODED_ROWS):
                self.jobs.append(functools.partial(self._transcode, weights, ggml_type, places, shapes,
                                                   first, min(first + TRANSCODED_ROWS, rows)))
            return

        def pack_and_copy(out: np.ndarray) -> None:
            packed = self._packed(weights, with_mins, codebook)
            sub = packed.sub
            arrays = {"data": packed.data, "high": packed.high, "scales": packed.scales, "mins": packed.mins,
                      "sub_codes": sub and sub.codes, "supers": sub and sub.supers}
            for name, place in places.items():
                _put(out, place, arrays[name])
        self.jobs.append(pack_and_copy)

    def _transcode(self, weights: list[Tensor], ggml_type: int, places: dict[str, list[int]],
                   shapes: dict[str, tuple[tuple[int, ...], type]], first: int, end: int,
                   out: np.ndarray) -> None:
        arrays = {name: _view(out, places[name], shape, dtype) for name, (shape, dtype) in shapes.items()}
        parts = [self.decoder.blocks(w) for w in weights]
        try:
            transcode_blocks(parts, ggml_type, arrays, first, end)
        except UnpackableBlocks as error:
            raise self._refusal(weights[error.part], ggml_type) from None
        raw, (_, part_rows) = parts[0]
        self.decoder.count((end - first) * (raw.nbytes // part_rows))

    def _packed(self, weights: list[Tensor], with_mins: bool, codebook: str | None) -> PackedMatrix:
        """The tensors packed as one matrix. A scale or offset that is not a number means a damaged
        file; one too large for the packed layout's float16 (a Q4_0 block of scale 65504 has an
        offset of -8 x 65504), or an MXFP4 scale without a codebook form, is a file tierflow cannot
        hold."""
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


@functools.cache
def _fill_threads() -> ThreadPoolExecutor:
    """The threads extents are filled on, a thread per core, started once: a MoE model has thousands of
    small extents (its experts), and a pool of their own would cost each one its threads' start."""
    return ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tierflow-pack")


def _put(out: np.ndarray, place: list[int], array: np.ndarray) -> None:
    """Copies an array to its place [offset, nbytes] in the extent's bytes."""
    at, nbytes = place
    if array.nbytes != nbytes:
        raise AssertionError(f"the pack's layout expected {nbytes} bytes, the writer made {array.nbytes}")
    out[at: at + nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _view(out: np.ndarray, place: list[int], shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """The array of this shape and dtype at its place in the extent's bytes."""
    at, nbytes = place
    view = out[at: at + nbytes].view(dtype)
    if view.size != int(np.prod(shape)):
        raise AssertionError(f"the pack's layout expected {nbytes} bytes, the transcoder writes "
                             f"{int(np.prod(shape)) * view.itemsize}")
    return view.reshape(shape)
