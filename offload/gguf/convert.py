"""`tierflow convert`: a GGUF model with its layer weights requantized to 4, 3 or 2 bits.

Every 2-D matrix of a transformer block that its family's tensor map marks as requantizable (the
attention and FFN projections, not routers) is dequantized to float32 and re-encoded
(`tierflow.cpu_kernels.quantize`): 4 bits as standard Q4_1,
which llama.cpp loads too, 3 and 2 bits as tierflow's TQ3_1 and TQ2_1 (see `tierflow.ggml_types`),
which only tierflow loads. Or, with `weight_type`, as ggml's Q2_K, Q3_K or IQ4_XS
(`tierflow.cpu_kernels.quantize_ggml`), which llama.cpp loads; as in llama.cpp's own quantizer, a
matrix whose rows are not a multiple of their 256-weight blocks becomes IQ4_NL instead.
Everything else (token_embd, output, norms, biases, rope_freqs) is
copied byte for byte, and so is the metadata, value types included, with two changes:
general.file_type becomes the type's (MOSTLY_Q4_1 at 4 bits, MOSTLY_Q2_K, ...) and is dropped at 3
and 2 bits (llama.cpp has no file type for TQ3_1 and TQ2_1), and `tierflow.quantization` says what
was done, e.g. "TQ2_1 g32, scale search".

The file is written by gguf-py's GGUFWriter to a temporary file beside the destination, read
back with the validating reader, and only then renamed into place: a failure or an interrupt
never leaves a half-written model. Peak memory is about three times the largest requantized
tensor in float32; the source stays memory-mapped.
"""

import numbers
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from tierflow.cpu_kernels.dequant import SUPPORTED_TYPES, dequantize
from tierflow.cpu_kernels.quantize import GROUP, METHODS, TYPE_FOR_BITS, quantize
from tierflow.cpu_kernels.quantize_ggml import ENCODERS, quantize_ggml
from tierflow.errors import InvalidArgumentError, ModelFileError, UnsupportedModelError
from tierflow.ggml_types import QUANT_SIZES, type_name
from tierflow.offload.gguf.model_file import ModelFile, open_model_file
from tierflow.offload.gguf.reader import GGUFFile, TensorInfo, read_gguf
from tierflow.offload.gguf.split_files import SPLIT_KEY_PREFIX
from tierflow.offload.store.model_path import resolve_model_path
from tierflow.runtime.models.tensor_map import Matmul

ConvertProgress = Callable[[str, int, int], None]  # ("convert", source bytes done, total)

QUANTIZATION_KEY = "tierflow.quantization"
_METHOD_NAMES = {"search": "scale search", "rtn": "round to nearest"}
# Keys the writer sets itself, or that this conversion replaces.
_DROPPED_KEYS = {"general.architecture", "general.file_type", QUANTIZATION_KEY}
# weight_type -> (bits per code, its general.file_type)
GGML_TARGETS = {"Q2_K": (2, LlamaFileType.MOSTLY_Q2_K), "Q3_K": (3, LlamaFileType.MOSTLY_Q3_K_S),
                "IQ4_XS": (4, LlamaFileType.MOSTLY_IQ4_XS)}
_SUPER_BLOCK = 256  # the K-quant and IQ4_XS block


@dataclass(frozen=True)
class _Target:
    """What the requantized matrices become."""

    ggml_type: int  # the type of every requantized matrix whose rows allow it
    file_type: LlamaFileType | None  # general.file_type; None: not written
    description: str  # the tierflow.quantization value
    method: str

    def type_for(self, info: TensorInfo) -> int:
        """IQ4_NL where a 256-weight type does not divide the rows (llama.cpp's fallback)."""
        if self.ggml_type in ENCODERS and info.shape[0] % _SUPER_BLOCK:
            return GGMLQuantizationType.IQ4_NL
        return self.ggml_type

    def encode(self, weights: np.ndarray, ggml_type: int) -> np.ndarray:
        if ggml_type in ENCODERS:
            return quantize_ggml(weights, ggml_type)
        return quantize(weights, ggml_type, self.method)


@dataclass(frozen=True)
class ConvertReport:
    """What `convert_model` wrote."""

    path: Path
    bits: int  # bits per code of the requantized weights
    method: str  # "search" or "rtn"
    quant_type: str  # "Q4_1", "TQ3_1", "TQ2_1", "Q2_K", "Q3_K" or "IQ4_XS"
    num_requantized: int  # tensors re-encoded
    num_copied: int  # tensors copied byte for byte
    requantized_weights: int  # weights in the re-encoded tensors
    requantized_bytes: int  # their bytes in the new file
    num_weights: int  # weights in every tensor of the file
    file_bytes: int
    seconds: float

    @property
    def bits_per_weight(self) -> float:
        """The whole file's bits over all its weights (embedding and metadata included)."""
        return 8 * self.file_bytes / self.num_weights

    @property
    def requantized_bits_per_weight(self) -> float:
        """Bits per weight of the re-encoded tensors, codes plus scales: 5.0 (Q4_1), 4.0 (TQ3_1)
        or 3.0 (TQ2_1)."""
        return 8 * self.requantized_bytes / self.requantized_weights


def convert_model(src: str | os.PathLike | None, dst: str | os.PathLike, bits: int = 4,
                  method: str = "search", progress: ConvertProgress | None = None, *,
                  force: bool = False, weight_type: str | None = None) -> ConvertReport:
    """Write `src` (default: the bundled model) to `dst` with its block weights requantized to
    `bits` (4, 3 or 2) by `method` ("search", the default, or "rtn"), or with `weight_type`
    (a key of GGML_TARGETS; then `bits` is the type's and only "search" applies) to that type.
    An existing `dst` is replaced only with force=True; `dst` is never the source.
    progress(phase, done, total) is called after each tensor with the source bytes done.

    Raises InvalidArgumentError for bad settings or destination, ModelFileError for a missing or
    malformed source, UnsupportedModelError for weights that cannot be requantized."""
    started = time.perf_counter()
    target = _target(bits, method, weight_type)
    bits = GGML_TARGETS[weight_type][0] if weight_type else int(bits)
    src, dst = resolve_model_path(src), Path(dst).expanduser()
    _check_destination(src, dst, force)
    with open_model_file(src) as opened:
        model = opened.gguf
        plan = _plan(model, _requantizable(opened))
        tmp = _temporary_beside(dst)
        try:
            requantized_bytes = _write(model, plan, tmp, target, progress)
            read_gguf(tmp).close()  # what was written parses and validates
            os.replace(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    requantized = [info for info, requantize in plan if requantize]
    return ConvertReport(
        path=dst, bits=bits, method=method, quant_type=type_name(target.ggml_type),
        num_requantized=len(requantized), num_copied=len(plan) - len(requantized),
        requantized_weights=sum(info.num_elements for info in requantized),
        requantized_bytes=requantized_bytes,
        num_weights=sum(info.num_elements for info, _ in plan),
        file_bytes=dst.stat().st_size, seconds=time.perf_counter() - started,
    )


def _target(bits: int, method: str, weight_type: str | None) -> _Target:
    if method not in METHODS:
        raise InvalidArgumentError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if weight_type is not None:
        if weight_type not in GGML_TARGETS:
            raise InvalidArgumentError(f"weight type must be one of {', '.join(GGML_TARGETS)}, got "
                                       f"{weight_type!r}")
        if method != "search":
            raise InvalidArgumentError(f"{weight_type} has one encoder, the scale search (method "
                                       f"{method!r} applies to --bits only)")
        return _Target(GGMLQuantizationType[weight_type], GGML_TARGETS[weight_type][1],
                       f"{weight_type} (IQ4_NL where rows are not whole blocks of {_SUPER_BLOCK}), "
                       f"{_METHOD_NAMES[method]}", method)
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or bits not in TYPE_FOR_BITS:
        raise InvalidArgumentError(f"bits must be 2, 3 or 4, got {bits!r}")
    quant_type = TYPE_FOR_BITS[bits]
    return _Target(quant_type, LlamaFileType.MOSTLY_Q4_1 if bits == 4 else None,
                   f"{type_name(quant_type)} g{GROUP}, {_METHOD_NAMES[method]}", method)


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    if dst.resolve() == src.resolve():
        raise InvalidArgumentError(f"{dst}: the output would overwrite the source model")
    if dst.is_dir():
        raise InvalidArgumentError(f"{dst} is a directory; give the output file's name")
    if dst.exists() and not force:
        raise InvalidArgumentError(f"{dst} already exists (use --force to replace it)")
    if not dst.parent.is_dir():
        raise InvalidArgumentError(f"{dst.parent}: no such directory")


def _requantizable(model: ModelFile) -> set[str]:
    """The 2-D matrices of the layers' requantizable matmuls (experts' stacks are 3-D: left as they are)."""
    arch, config = model.arch, model.config
    return {weight.name for i in range(config.num_layers) for field in arch.layer_fields(config, i)
            if isinstance(field.kind, Matmul) and field.kind.requantize
            for weight in field.kind.weights if len(weight.shape) == 2}


def _plan(model: GGUFFile, requantizable: set[str]) -> list[tuple[TensorInfo, bool]]:
    """Every tensor in file order and whether it is requantized, checked before writing."""
    plan = []
    for info in model.tensors.values():
        requantize = info.name in requantizable
        if requantize and info.shape[0] % GROUP:
            raise UnsupportedModelError(
                f"{model.path.name}: tensor '{info.name}' has rows of {info.shape[0]} weights, "
                f"not a multiple of {GROUP}, so it cannot be requantized"
            )
        if requantize and info.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{model.path.name}: tensor '{info.name}' has type {info.type_name}, which "
                f"tierflow cannot decode"
            )
        plan.append((info, requantize))
    return plan


def _temporary_beside(dst: Path) -> Path:
    """A new empty file in dst's directory (so the final rename stays on one file system),
    created like any other file (tempfile's are private to the user)."""
    while True:
        path = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}.partial")
        try:
            path.open("xb").close()
            return path
        except FileExistsError:
            continue


def _write(model: GGUFFile, plan: list[tuple[TensorInfo, bool]], path: Path, target: _Target,
           progress: ConvertProgress | None) -> int:
    """Write the converted model to `path`; returns the requantized tensors' bytes."""
    arch = model.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{model.path.name}: no general.architecture in the metadata")
    writer = GGUFWriter(path, arch)
    try:
        _copy_metadata(model, writer)
        if target.file_type is not None:
            writer.add_uint32("general.file_type", target.file_type)
        writer.add_string(QUANTIZATION_KEY, target.description)
        for info, requantize in plan:
            ggml_type = target.type_for(info) if requantize else info.ggml_type
            block_size, block_bytes = QUANT_SIZES[ggml_type]
            # The logical shape, numpy order; any dtype but uint8 (which would make gguf-py
            # read the shape as a byte count) tells it so.
            writer.add_tensor_info(info.name, tuple(reversed(info.shape)), np.dtype(np.float32),
                                   info.num_elements // block_size * block_bytes,
                                   raw_dtype=ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        return _write_tensors(model, plan, writer, target, progress)
    finally:
        writer.close()


def _write_tensors(model: GGUFFile, plan: list[tuple[TensorInfo, bool]], writer: GGUFWriter,
                   target: _Target, progress: ConvertProgress | None) -> int:
    total = sum(info.nbytes for info, _ in plan)
    done = requantized_bytes = 0
    for info, requantize in plan:
        data = model.tensor_data(info.name)
        if requantize:
            data = _requantize(model, info, target)
            requantized_bytes += data.nbytes
        writer.write_tensor_data(data)
        done += info.nbytes
        if progress is not None:
            progress("convert", done, total)
    return requantized_bytes


def _requantize(model: GGUFFile, info: TensorInfo, target: _Target) -> np.ndarray:
    weights = dequantize(model.tensor_data(info.name), info.ggml_type, info.shape)
    try:
        return target.encode(weights, target.type_for(info))
    except InvalidArgumentError as error:  # weights that cannot be encoded: a bad source file
        raise ModelFileError(f"{model.path.name}: tensor '{info.name}': {error}") from None


def _copy_metadata(model: GGUFFile, writer: GGUFWriter) -> None:
    """Every key but _DROPPED_KEYS, with its value type (a uint32 stays a uint32).

    Strings are copied as read_gguf decoded them, so a byte sequence that is not UTF-8 becomes
    U+FFFD. general.alignment also sets the writer's data alignment."""
    for key, value in model.metadata.items():
        if key in _DROPPED_KEYS or key.startswith(SPLIT_KEY_PREFIX):  # the copy is one file
            continue
        vtype, element_type = model.value_types[key]
        if vtype == GGUFValueType.ARRAY:
            if element_type == GGUFValueType.ARRAY or len(value) == 0:
                raise UnsupportedModelError(
                    f"{model.path.name}: metadata '{key}' is an empty or nested array, which "
                    f"gguf-py's writer cannot copy"
                )
            value = value.tolist() if isinstance(value, np.ndarray) else value
        writer.add_key_value(key, value, vtype, sub_type=element_type)
        if key == "general.alignment":
            writer.data_alignment = value
