"""Writing a pack: a GGUF's weights in the kernels' layout, layer-major, built once per model.

Streaming a layer from disk must be one sequential read of exactly the bytes the kernels use, and
some types take seconds to lay out (those packed by numpy: cpu_kernels/packed.py). So a load that
streams layers or experts from disk, or of a model of such types, writes those bytes to a file in
the user's cache directory once, and every later load (and every streamed read) uses it. A load
that holds everything in RAM, of a model whose types transcode in C, writes none (built.py).

File (every extent 4 KiB-aligned and padded to 4 KiB, so O_DIRECT can read it; each extent's
arrays as layout.py lays them out, its family's fields in order):

    extent "globals"   the token embeddings, the output norm and head, rope factors
    extent layer 0     its attention and FFN fields; in a MoE layer, its router (and shared expert)
    extents experts    of a MoE layer: one extent per expert, the unit that streams and is cached
    ...
    extent layer L-1 (and its experts)
    manifest           JSON: the source's identity, and per extent its offset, size, CRC-32 and
                       its fields' arrays (layout.py)
    trailer            MAGIC, manifest offset, manifest size, manifest CRC-32 (28 bytes)

The file is written under a temporary name (NAME.tfpack.<pid>.tmp, locked while written, removed on
a failure or SIGTERM: temporaries.py), synced, then renamed: a pack either exists whole or not at
all. The build holds at most about `memory_bytes` (the load's cpu_memory): an extent up to an eighth
of it is laid out in RAM and written whole, a larger one (a large vocabulary's embedding) goes to the
file a job's rows at a time (layout.py) and its checksum is read back; the GGUF's pages are dropped
from the process's memory as it is read (TensorDecoder.release_bytes, every eighth), and jobs are
sized so that those running at once hold at most a quarter of it.

Where it lives and what makes it the source's is cache.py's: its manifest records the
source's identity (cache.source_identity) and the format version, and a pack that disagrees
(stale) or whose trailer, manifest or size is wrong (damaged), or whose manifest is not exactly
the layout the header implies (a crafted one with a valid checksum), is rebuilt. Extents carry
CRC-32s, checked when they are first read and again once the file has changed (reader.py).
Before a build, cache.make_room checks the cap and the disk against the pack's size, known from
the header (pack_sizes).
"""

import errno
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from tierflow.cpu_kernels.checksum import crc32
from tierflow.errors import ModelFileError, TierflowError
from tierflow.offload.gguf.model_file import ModelFile
from tierflow.offload.io.heap import give_back_freed_memory
from tierflow.offload.pack.layout import (
    PIECE_BYTES,
    ExtentLayout,
    ExtentSize,
    TensorDecoder,
    fill_threads,
    write_all,
)
from tierflow.offload.pack.pack_cache import (
    content_crc,
    make_room,
    other_packs_of_inode,
    pack_path,
    record_use,
    remove_pack,
    same_source,
    source_identity,
)
from tierflow.offload.pack.reader import MAGIC, PACK_VERSION, TRAILER, PackedFile
from tierflow.offload.pack.temporaries import writing
from tierflow.progress import LoadPhase, LoadProgress
from tierflow.units import format_size

# What a build may hold when the caller names no budget: this much, or a quarter of the available RAM.
DEFAULT_BUILD_MEMORY = 512 << 20
MIN_PIECE_BYTES = 1 << 20
CHECKSUM_WINDOW = 8 << 20  # a large extent's bytes read back for its checksum, this many at a time
# Where a build starts and ends, with the pack's size and place (the CLI shows these at INFO).
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackSizes:
    """The pack's extents, sized from the header alone (no weight is read)."""

    globals: ExtentSize
    layers: list[ExtentSize]
    experts: list[list[ExtentSize]]  # per layer, each expert's (none in a dense model)

    @property
    def total_bytes(self) -> int:
        experts = (x for layer in self.experts for x in layer)
        return sum(x.nbytes for x in [self.globals, *self.layers, *experts])


def extents(model: ModelFile, decoder: TensorDecoder | None = None, all_experts: bool = True
            ) -> Iterator[tuple[int | None, int | None, ExtentLayout]]:
    """(layer, expert, layout) of every extent in file order: the globals (None, None), then each
    layer (i, None) followed by its experts (i, e) (only the first unless all_experts). With a
    decoder the layouts can write their bytes; without, they only size them."""
    arch, config = model.arch, model.config
    yield None, None, ExtentLayout(model.gguf, decoder).add_fields(arch.global_fields(config))
    for i in range(config.num_layers):
        yield i, None, ExtentLayout(model.gguf, decoder).add_fields(arch.layer_fields(config, i))
        experts = range(config.num_experts if config.has_experts(i) else 0)  # none in a dense layer
        for e in experts if all_experts else experts[:1]:
            yield i, e, ExtentLayout(model.gguf, decoder).add_fields(arch.expert_fields(config, i, e))


def pack_sizes(model: ModelFile) -> PackSizes:
    """Every extent's size, as the writer lays it out. A layer's experts all read the same
    tensors' slices, so the first one's size serves them all."""
    config = model.config
    layouts = iter(extents(model, all_experts=False))
    globals_ = next(layouts)[2].extent_size()
    layers, experts = [], []
    for layer, expert, layout in layouts:
        if expert is None:
            layers.append(layout.extent_size())
            experts.append([])
        else:
            experts[layer] = [layout.extent_size()] * config.num_experts
    return PackSizes(globals_, layers, experts)


def _laid_out_as_the_header_says(packed: PackedFile, model: ModelFile) -> bool:
    """Whether the manifest is exactly the layout the header implies: every extent where the
    writer puts it, back to back, of its size, with its arrays where the layout walk places them
    (a layer's experts all as its first). A manifest with a valid checksum but other sizes or
    offsets would have the readers read past their extents."""
    config = model.config
    counts = [config.num_experts if config.has_experts(i) else 0 for i in range(config.num_layers)]
    if len(packed.layers) != config.num_layers or [len(xs) for xs in packed.experts] != counts:
        return False
    expected = {(layer, expert): (layout.extent_size().nbytes, json.loads(json.dumps(layout.spec)))
                for layer, expert, layout in extents(model, all_experts=False)}
    offset = 0
    entries = [((None, None), packed.globals)]
    for i, layer in enumerate(packed.layers):
        entries += [((i, None), layer)] + [((i, 0), expert) for expert in packed.experts[i]]
    for key, extent in entries:
        if extent.offset != offset or (extent.nbytes, extent.weights) != expected[key]:
            return False
        offset += extent.nbytes
    return True


def add_extent(manifest: dict, layer: int | None, expert: int | None, entry: dict) -> None:
    """Files an extent's entry (extents() order) under the globals, its layer, or its layer's experts."""
    if layer is None:
        manifest["globals"] = entry
    elif expert is None:
        manifest["layers"].append(entry)
        manifest["experts"].append([])
    else:
        manifest["experts"][layer].append(entry)


def build_pack(model: ModelFile, path: Path, progress: LoadProgress | None = None,
               memory_bytes: int | None = None) -> None:
    """Writes the pack of `model` (whose tensors passed check_tensors) to path, atomically, holding at
    most about memory_bytes (default: build_memory(None)) meanwhile; progress is told PACKING with the
    GGUF's bytes read of all its tensors' (from the fill threads)."""
    total, done = sum(info.nbytes for info in model.gguf.tensors.values()), 0

    def decoded(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        progress(LoadPhase.PACKING, done, total)

    memory = build_memory(memory_bytes)
    threads = os.cpu_count() or 1
    piece = min(PIECE_BYTES, max(MIN_PIECE_BYTES, memory // 4 // threads))  # the jobs running at once
    decoder = TensorDecoder(model.gguf, decoded if progress is not None else None, piece_bytes=piece,
                            release_bytes=max(memory // 8, piece))
    try:
        with fill_threads(), writing(path, "w+b") as (temporary, f):  # read too: a large extent's checksum
            fd, offset = f.fileno(), 0
            source = {**source_identity(model.path), "content_crc32": content_crc(model.path)}
            manifest = {"version": PACK_VERSION, "source": source, "layers": [], "experts": []}
            for layer, expert, layout in extents(model, decoder):
                nbytes = layout.extent_size().nbytes
                if nbytes <= memory // 8:
                    data = layout.bytes()
                    checksum = crc32(data)
                    write_all(fd, data, offset)
                    del data
                else:
                    layout.write_to(fd, offset)
                    os.ftruncate(fd, offset + nbytes)  # its padding at the end, not written, reads as zeros
                    checksum = _file_crc32(fd, offset, nbytes)
                add_extent(manifest, layer, expert, {"offset": offset, "nbytes": nbytes, "crc32": checksum,
                                                      "weights": layout.spec})
                offset += nbytes
            raw = json.dumps(manifest).encode()
            write_all(fd, raw + TRAILER.pack(MAGIC, offset, len(raw), crc32(raw)), offset)
            os.fsync(fd)
            os.replace(temporary, path)
    finally:
        model.gguf.release_pages()
        give_back_freed_memory()  # the pieces freed on the fill threads, kept in their heaps otherwise


def build_memory(memory_bytes: int | None) -> int:
    """What a build may hold: memory_bytes, or by default DEFAULT_BUILD_MEMORY or a quarter of the
    available RAM, whichever is less."""
    if memory_bytes is not None:
        return max(int(memory_bytes), 0)
    return min(DEFAULT_BUILD_MEMORY, psutil.virtual_memory().available // 4)


def _file_crc32(fd: int, offset: int, nbytes: int) -> int:
    """The CRC-32 of nbytes of the file at offset (read back: an extent written in pieces)."""
    window = bytearray(min(CHECKSUM_WINDOW, nbytes))
    view, checksum, done = memoryview(window), 0, 0
    while done < nbytes:
        count = os.preadv(fd, [view[: min(len(view), nbytes - done)]], offset + done)
        if count == 0:
            raise OSError(errno.EIO, f"the pack ends before byte {offset + nbytes} while it is written")
        checksum = crc32(view[:count], checksum)
        done += count
    return checksum


def open_pack(model: ModelFile, progress: LoadProgress | None = None, memory_bytes: int | None = None
              ) -> PackedFile:
    """The model's pack from the cache, built first if it is missing, stale or damaged (once the
    cap and the disk have room for it), holding at most about memory_bytes while it is built."""
    identity = source_identity(model.path)
    path = pack_path(model.path)
    packed = _cached_pack(path, identity, model)
    if packed is None:
        packed = _new_pack(model, path, progress, memory_bytes)
    record_use(packed, model.path)
    return packed


def _cached_pack(path: Path, identity: dict, model: ModelFile) -> PackedFile | None:
    """The pack at path if it is whole and of this very source; None if it must be (re)built."""
    if not path.exists():
        return None
    try:
        packed = PackedFile(path)
    except ModelFileError:
        return None  # damaged
    if same_source(packed.source, identity, path, model.path) and _laid_out_as_the_header_says(packed, model):
        return packed
    return None


def _new_pack(model: ModelFile, path: Path, progress: LoadProgress | None, memory_bytes: int | None
              ) -> PackedFile:
    nbytes = pack_sizes(model).total_bytes
    for stale in other_packs_of_inode(path):  # a deleted file's, whose inode this one reuses
        remove_pack(stale)
    make_room(path, nbytes, model.path.name)
    log.info("packing the weights of %s once: %s into %s", model.path.name, format_size(nbytes), path)
    try:
        build_pack(model, path, progress, memory_bytes)
    except OSError as error:  # a full disk, a read-only cache folder
        raise TierflowError(f"cannot write the packed weights of {model.path.name} to {path.parent} "
                            f"({error.strerror or error}); free space there or set TIERFLOW_CACHE to "
                            f"another folder") from error
    log.info("packed %s: %s, %s", model.path.name, path, format_size(path.stat().st_size))
    return PackedFile(path)
