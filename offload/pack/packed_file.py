"""The packed model file: a GGUF's weights in the kernels' layout, layer-major, built once.

Loading a GGUF means decoding every tensor into the kernels' packed layout (cpu_kernels/packed.py),
which takes seconds; streaming a layer from disk must be one sequential read of exactly the bytes
the kernels use. So the first load of a model writes those bytes to a file in the user's cache
directory, and every later load (and every streamed read) uses it.

Layout (all offsets in bytes, every extent 4 KiB-aligned and padded to 4 KiB, so O_DIRECT can
read it):

    extent "globals"   the token embeddings, the output norm, the output head, rope factors
    extent layer 0     its norms and its four linears (QKV, output, gate+up, down), packed; in a
                       MoE layer, its router and shared expert instead of gate+up and down
    extents experts    of a MoE layer: one extent per expert (gate+up, down), the unit that
                       streams and is cached
    ...
    extent layer L-1 (and its experts)
    manifest           JSON: the source's identity, and per extent its offset, size, CRC-32
                       and the arrays in it (offset within the extent, size) with how they
                       form each weight (packed: rows, cols, bits, group, data, scales, mins,
                       bias; dense float32: weight, bias; or a concatenation of either)
    trailer            MAGIC, manifest offset, manifest size, manifest CRC-32 (28 bytes)

The file is written under a temporary name, synced, then renamed: a pack either exists whole or
not at all. It is keyed by the source's absolute path; its manifest records the source's size and
modification time and the format version, and a pack that disagrees (stale) or whose trailer,
manifest or size is wrong (damaged) is rebuilt. Extents carry CRC-32s, checked whenever an extent
is first read in a process, so damage inside the data is found too.
"""

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tierflow.cpu_kernels.dequant import dequantize
from tierflow.cpu_kernels.linear import PackedLinear
from tierflow.cpu_kernels.packed import TILE_ROWS, PackedMatrix, pack
from tierflow.cpu_kernels.quant_groups import GROUPED_TYPES, QuantGroups, stack_rows, to_quant_groups
from tierflow.errors import ModelFileError, TierflowError
from tierflow.gpu_kernels.matmul import DeviceLinear
from tierflow.gpu_kernels.packed import view_matrix
from tierflow.offload.gguf.reader import GGUFFile
from tierflow.offload.io.disk import ALIGNMENT
from tierflow.offload.plan.profile import cache_dir
from tierflow.runtime.config import ModelConfig
from tierflow.runtime.model import (
    ConcatLinear,
    DenseLinear,
    Experts,
    ExpertWeights,
    Kernels,
    LayerWeights,
    Linear,
    MoEWeights,
)

PACK_VERSION = 2
MAGIC = b"TFPACK01"
TRAILER = struct.Struct("<8sQQI")
ARRAY_ALIGNMENT = 64

LoadProgress = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)

# LayerWeights field -> the GGUF matrices (within blk.N) it computes, in output order
ATTENTION_LINEARS = {"qkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",)}
FFN_LINEARS = {"gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
LAYER_LINEARS = ATTENTION_LINEARS | FFN_LINEARS
QK_NORMS = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
# a MoE layer's extent: the router and the shared expert (qwen2moe); each expert's own extent
MOE_LINEARS = {"router": ("ffn_gate_inp",), "shared_gate_up": ("ffn_gate_shexp", "ffn_up_shexp"),
               "shared_down": ("ffn_down_shexp",)}
EXPERT_TENSORS = {"gate_up": ("ffn_gate_exps", "ffn_up_exps"), "down": ("ffn_down_exps",)}


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def pack_path(source: Path) -> Path:
    """Where the pack of `source` lives: keyed by its absolute path."""
    digest = hashlib.sha256(str(Path(source).resolve()).encode()).hexdigest()[:16]
    folder = cache_dir() / "packed"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise TierflowError(f"cannot create {folder} ({error.strerror or error}); set TIERFLOW_CACHE "
                            f"to a writable folder") from error
    return folder / f"{Path(source).stem}.{digest}.tfpack"


def source_identity(source: Path) -> dict:
    stat = Path(source).stat()
    return {"path": str(Path(source).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "version": PACK_VERSION}


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Extent:
    offset: int
    nbytes: int
    crc32: int
    weights: dict  # how the arrays in it form the weights (see the module docstring)


class PackedFile:
    """A pack's manifest; the extents' bytes are read by the caller (see offload/io/disk.py)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        manifest = _read_manifest(self.path)
        self.source = manifest["source"]
        self.globals = Extent(**manifest["globals"])
        self.layers = [Extent(**extent) for extent in manifest["layers"]]
        self.experts = [[Extent(**extent) for extent in layer] for layer in manifest["experts"]]

    @property
    def largest_layer_bytes(self) -> int:
        return max((extent.nbytes for extent in self.layers), default=0)

    def check(self, extent: Extent, data: memoryview) -> None:
        if zlib.crc32(data) != extent.crc32:
            raise ModelFileError(f"{self.path.name}: the packed weights at byte {extent.offset} are "
                                 f"damaged (checksum mismatch); it is rebuilt on the next load")

    def layer_weights(self, index: int, data: memoryview, experts: Experts | None = None) -> LayerWeights:
        """LayerWeights viewing the bytes of layer `index`'s extent (held by the caller); a MoE
        layer's experts come from `experts`, which the caller places."""
        spec = self.layers[index].weights
        norms = {field: _array(data, spec[field], np.float32)
                 for field in ("attn_norm", "ffn_norm", *QK_NORMS) if field in spec}
        if "router" not in spec:
            return LayerWeights(**norms, **{field: _linear(data, spec[field]) for field in LAYER_LINEARS})
        shared = None
        if "shared_gate_up" in spec:
            shared = ExpertWeights(_linear(data, spec["shared_gate_up"]), _linear(data, spec["shared_down"]))
        moe = MoEWeights(_linear(data, spec["router"]), experts, shared,
                         _linear(data, spec["shared_gate"]) if shared else None)
        return LayerWeights(**norms, qkv=_linear(data, spec["qkv"]), wo=_linear(data, spec["wo"]), moe=moe)

    def expert_weights(self, index: int, expert: int, data: memoryview) -> ExpertWeights:
        """ExpertWeights viewing the bytes of expert `expert` of layer `index` (held by the caller)."""
        spec = self.experts[index][expert].weights
        return ExpertWeights(_linear(data, spec["gate_up"]), _linear(data, spec["down"]))

    def device_layer_weights(self, index: int, buffer: torch.Tensor, kernels: Kernels) -> LayerWeights:
        """LayerWeights viewing layer `index`'s extent as uploaded to a device (uint8 [bytes]),
        computed there by `kernels` (gpu_kernels.layer_kernels.TritonKernels): no re-layout."""
        spec = self.layers[index].weights
        return LayerWeights(attn_norm=_device_array(buffer, spec["attn_norm"], torch.float32),
                            ffn_norm=_device_array(buffer, spec["ffn_norm"], torch.float32),
                            **{field: _device_linear(buffer, spec[field]) for field in LAYER_LINEARS},
                            kernels=kernels)

    def device_expert_weights(self, index: int, expert: int, buffer: torch.Tensor,
                              kernels: Kernels) -> ExpertWeights:
        """ExpertWeights viewing an expert's extent as uploaded to a device, computed by kernels."""
        spec = self.experts[index][expert].weights
        return ExpertWeights(_device_linear(buffer, spec["gate_up"]), _device_linear(buffer, spec["down"]),
                             kernels)

    def global_weights(self, data: memoryview) -> dict:
        """embedding (PackedMatrix or float32 [V, E]), output_norm, output (Linear), rope_freqs."""
        spec = self.globals.weights
        embedding = _matrix(data, spec["token_embd"])
        output = (_as_linear(embedding, None) if spec["output"] == "tied" else _linear(data, spec["output"]))
        rope = spec.get("rope_freqs")
        return {"embedding": embedding, "output_norm": _array(data, spec["output_norm"], np.float32),
                "output": output,
                "rope_freqs": None if rope is None else torch.from_numpy(_array(data, rope, np.float32))}


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
        if zlib.crc32(raw) != crc:
            raise ValueError("manifest checksum mismatch")
        manifest = json.loads(raw)
        if manifest.get("version") != PACK_VERSION:
            raise ValueError(f"format version {manifest.get('version')}")
        return manifest
    except (OSError, ValueError, KeyError) as error:
        raise ModelFileError(f"{path.name}: not a valid tierflow pack ({error})") from error


def _array(data: memoryview, spec: list, dtype) -> np.ndarray:
    at, nbytes = spec
    return np.frombuffer(data, dtype, nbytes // np.dtype(dtype).itemsize, at)


def _matrix(data: memoryview, spec: dict) -> PackedMatrix | torch.Tensor:
    rows, cols = spec["rows"], spec["cols"]
    if spec["kind"] == "dense":
        return torch.from_numpy(_array(data, spec["weight"], np.float32).reshape(rows, cols))
    bits, group = spec["bits"], spec["group"]
    tiles = -(-rows // TILE_ROWS)
    if bits == 8:
        codes = _array(data, spec["data"], np.int8).reshape(tiles, cols // 4, TILE_ROWS, 4)
    else:
        codes = _array(data, spec["data"], np.uint8).reshape(tiles, cols // 8, bits, TILE_ROWS)
    params = (tiles, cols // group, TILE_ROWS)
    mins = None if spec["mins"] is None else _array(data, spec["mins"], np.float16).reshape(params)
    scales = _array(data, spec["scales"], np.float16).reshape(params)
    return PackedMatrix(rows, cols, bits, group, codes, scales, mins)


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
    at = {name: None if spec[name] is None else spec[name][0] for name in ("data", "scales", "mins")}
    return DeviceLinear(view_matrix(buffer, spec["rows"], spec["cols"], spec["bits"], spec["group"],
                                    at["data"], at["scales"], at["mins"]), bias)


# -- writing ----------------------------------------------------------------------------------


class _ExtentBuilder:
    """Collects the arrays of one extent, each 64-byte aligned, and describes them."""

    def __init__(self):
        self.chunks: list[tuple[int, bytes]] = []
        self.size = 0

    def add(self, array: np.ndarray) -> list[int]:
        at = _align(self.size, ARRAY_ALIGNMENT)
        raw = np.ascontiguousarray(array).tobytes()
        self.chunks.append((at, raw))
        self.size = at + len(raw)
        return [at, len(raw)]

    def matrix(self, matrix: QuantGroups | np.ndarray, bias: np.ndarray | None) -> dict:
        rows = matrix.q.shape[0] if isinstance(matrix, QuantGroups) else matrix.shape[0]
        spec = {"rows": rows, "bias": None if bias is None else self.add(bias.astype(np.float32))}
        if isinstance(matrix, np.ndarray):
            return spec | {"kind": "dense", "cols": matrix.shape[1], "weight": self.add(matrix)}
        packed = pack(matrix)
        return spec | {"kind": "packed", "cols": packed.cols, "bits": packed.bits, "group": packed.group,
                       "data": self.add(packed.data), "scales": self.add(packed.scales),
                       "mins": None if packed.mins is None else self.add(packed.mins)}

    def bytes(self) -> bytes:
        out = bytearray(_align(self.size, ALIGNMENT))
        for at, raw in self.chunks:
            out[at: at + len(raw)] = raw
        return bytes(out)


class _PackWriter:
    def __init__(self, gguf: GGUFFile, config: ModelConfig, progress: LoadProgress | None):
        self.gguf, self.config, self.progress = gguf, config, progress
        self.done = 0
        self.total = sum(info.nbytes for info in gguf.tensors.values())

    def _tensor(self, name: str, expert: int | None = None) -> QuantGroups | np.ndarray:
        """A tensor in the layout the pack stores, or one expert's slice of a 3-D expert tensor."""
        info = self.gguf.tensors[name]
        data, shape = self.gguf.tensor_data(name), info.shape
        if expert is not None:  # the experts are the outermost dimension: each a run of bytes
            per_expert = info.nbytes // shape[2]
            data, shape = data[expert * per_expert: (expert + 1) * per_expert], shape[:2]
        self.done += len(data)
        if self.progress is not None:
            self.progress("packing the weights (once)", self.done, self.total)
        if info.ggml_type in GROUPED_TYPES and len(shape) == 2:
            return to_quant_groups(data, info.ggml_type, shape)
        return dequantize(data, info.ggml_type, shape)

    def _linear(self, extent: _ExtentBuilder, names: list[str], expert: int | None = None) -> dict:
        """Matrices that read the same input, fused into one when their formats agree."""
        matrices = [self._tensor(f"{name}.weight", expert) for name in names]
        biases = [self._tensor(f"{name}.bias") if f"{name}.bias" in self.gguf.tensors else None
                  for name in names]
        rows = [m.q.shape[0] if isinstance(m, QuantGroups) else m.shape[0] for m in matrices]
        bias = None if all(b is None for b in biases) else np.concatenate(
            [np.zeros(n, np.float32) if b is None else b for b, n in zip(biases, rows)])
        if all(isinstance(m, np.ndarray) for m in matrices):
            return extent.matrix(np.concatenate(matrices), bias)
        formats = {(m.bits, m.group) for m in matrices if isinstance(m, QuantGroups)}
        if all(isinstance(m, QuantGroups) for m in matrices) and len(formats) == 1:
            return extent.matrix(stack_rows(matrices), bias)
        return {"kind": "concat", "parts": [extent.matrix(m, b) for m, b in zip(matrices, biases)]}

    def globals_extent(self) -> tuple[_ExtentBuilder, dict]:
        extent = _ExtentBuilder()
        embedding = self._tensor("token_embd.weight")
        spec = {"token_embd": extent.matrix(embedding, None),
                "output_norm": extent.add(self._tensor("output_norm.weight")),
                "output": "tied" if self.config.tied_embeddings else self._linear(extent, ["output"])}
        if "rope_freqs.weight" in self.gguf.tensors:
            spec["rope_freqs"] = extent.add(self._tensor("rope_freqs.weight"))
        return extent, spec

    def layer_extent(self, index: int) -> tuple[_ExtentBuilder, dict]:
        extent, prefix, config = _ExtentBuilder(), f"blk.{index}.", self.config
        spec = {"attn_norm": extent.add(self._tensor(prefix + "attn_norm.weight")),
                "ffn_norm": extent.add(self._tensor(prefix + "ffn_norm.weight"))}
        if config.qk_norm:
            for field, name in QK_NORMS.items():
                spec[field] = extent.add(self._tensor(f"{prefix}{name}.weight"))
        for field, names in layer_linears(config).items():
            spec[field] = self._linear(extent, [prefix + name for name in names])
        if config.shared_expert_ffn_size:
            gate = self._tensor(prefix + "ffn_gate_inp_shexp.weight")  # [E]: a 1-row matrix
            spec["shared_gate"] = extent.matrix(gate[None], None)
        return extent, spec

    def expert_extent(self, index: int, expert: int) -> tuple[_ExtentBuilder, dict]:
        extent, prefix = _ExtentBuilder(), f"blk.{index}."
        return extent, {field: self._linear(extent, [prefix + name for name in names], expert)
                        for field, names in EXPERT_TENSORS.items()}


def layer_linears(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The linears of a layer's extent: attention, then the dense FFN or the router (and the
    shared expert's)."""
    if not config.is_moe:
        return LAYER_LINEARS
    moe = MOE_LINEARS if config.shared_expert_ffn_size else {"router": MOE_LINEARS["router"]}
    return ATTENTION_LINEARS | moe


def build_pack(gguf: GGUFFile, config: ModelConfig, path: Path, progress: LoadProgress | None = None) -> None:
    """Writes the pack of `gguf` (whose tensors passed check_tensors) to path, atomically."""
    writer = _PackWriter(gguf, config, progress)
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            def write(builder: _ExtentBuilder, spec: dict) -> dict:
                data = builder.bytes()
                entry = {"offset": f.tell(), "nbytes": len(data), "crc32": zlib.crc32(data), "weights": spec}
                f.write(data)
                return entry

            manifest = {"version": PACK_VERSION, "source": source_identity(gguf.path),
                        "globals": write(*writer.globals_extent()), "layers": [], "experts": []}
            for i in range(config.num_layers):  # a layer's experts follow it
                manifest["layers"].append(write(*writer.layer_extent(i)))
                experts = [write(*writer.expert_extent(i, e)) for e in range(config.num_experts)]
                manifest["experts"].append(experts)
            raw = json.dumps(manifest).encode()
            offset = f.tell()
            f.write(raw)
            f.write(TRAILER.pack(MAGIC, offset, len(raw), zlib.crc32(raw)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def open_pack(gguf: GGUFFile, config: ModelConfig, progress: LoadProgress | None = None) -> PackedFile:
    """The model's pack from the cache, built first if it is missing, stale or damaged."""
    path = pack_path(gguf.path)
    if path.exists():
        try:
            packed = PackedFile(path)
            if packed.source == source_identity(gguf.path) and len(packed.layers) == config.num_layers:
                return packed
        except ModelFileError:
            pass  # damaged: rebuilt below
    try:
        build_pack(gguf, config, path, progress)
    except OSError as error:  # a full disk, a read-only cache folder
        raise TierflowError(f"cannot write the packed weights of {gguf.path.name} to {path.parent} "
                            f"({error.strerror or error}); free space there or set TIERFLOW_CACHE to "
                            f"another folder") from error
    return PackedFile(path)
