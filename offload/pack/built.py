"""A pack built in RAM: the extents a load holds in RAM, laid out from the GGUF as it reads them.

A plan that reads nothing from disk while it runs (no layer streamed, no expert at home on disk)
needs a pack only to load from, and the block types most files are made of (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, and MXFP4, gpt-oss's experts) transcode in C about as
fast as a disk reads them, on a thread per core (layout.ExtentLayout.fill). For such a model the load
builds each extent straight into the memory it keeps and writes no pack: a model takes no disk
beside its GGUF. Its extents are exactly the ones writer.build_pack would write (the same walk), so
everything after the load is the same.
"""

import numpy as np
from gguf import GGMLQuantizationType as T

from tierflow.cpu_kernels.packed import BLOCK_PACKED_TYPES
from tierflow.offload.gguf.model_file import ModelFile
from tierflow.offload.pack.layout import ExtentLayout, TensorDecoder
from tierflow.offload.pack.reader import Extent, PackedFile
from tierflow.offload.pack.writer import add_extent, extents

# The types a load lays out in RAM at about the speed it reads them, or that need no layout.
BUILT_IN_RAM_TYPES = BLOCK_PACKED_TYPES | {T.F32, T.F16, T.BF16}
# The GGUF's bytes read, while an extent is built, after which its mapped pages are let go: a large
# embedding's file pages would otherwise count in RSS beside the extent built from them.
RELEASE_BYTES = 64 << 20


def builds_in_ram(model: ModelFile) -> bool:
    """Whether every tensor of the model is of a type a load builds in RAM as fast as it reads it."""
    return all(info.ggml_type in BUILT_IN_RAM_TYPES for info in model.gguf.tensors.values())


class BuiltPack(PackedFile):
    """The model's extents, built in RAM from its GGUF as a load asks for them (path None): the
    manifest build_pack would write, without the file."""

    def __init__(self, model: ModelFile):
        self._gguf = model.gguf
        manifest = {"source": None, "layers": [], "experts": []}
        self._layouts: dict[int, ExtentLayout] = {}  # by offset, until built
        offset = 0
        # the file's pages read for an extent are let go as it is built, not only once it is whole
        decoder = TensorDecoder(model.gguf, release_bytes=RELEASE_BYTES)
        for layer, expert, layout in extents(model, decoder):
            nbytes = layout.extent_size().nbytes
            add_extent(manifest, layer, expert, {"offset": offset, "nbytes": nbytes, "crc32": 0,
                                                 "weights": layout.spec})
            self._layouts[offset] = layout
            offset += nbytes
        super().__init__(None, manifest)

    def build_into(self, extent: Extent, buffer: memoryview) -> memoryview:
        """The extent's bytes, built at the start of `buffer`, once (its layout is then let go)."""
        data = memoryview(buffer)[: extent.nbytes]
        self._layouts.pop(extent.offset).fill(np.frombuffer(data, np.uint8))
        self._gguf.release_pages()
        return data
