"""A file llama.cpp can read the vocabulary from, for models whose tensors it cannot parse.

tierflow's tokenizer is llama.cpp's, loaded with `vocab_only`, but llama.cpp's GGUF parser rejects
a file with a tensor type it does not know, such as tierflow's TQ2_1 and TQ3_1 (written by
`tierflow convert --bits 2|3`), before it looks at the vocabulary. For such a file llama.cpp is
given a copy of the header and metadata with no tensors instead: the key-value section is copied
byte for byte, so every value keeps its exact type and bytes. llama.cpp reads it in full while
loading, so the copy is deleted as soon as the tokenizer is built.

    with llama_vocab_file(gguf) as path:
        tokenizer = Tokenizer.from_gguf(path)
"""

import os
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gguf import GGML_QUANT_SIZES

from tierflow.offload.gguf.reader import MAGIC, GGUFFile


def llama_can_parse(model: GGUFFile) -> bool:
    """Whether every tensor type of the file is one of ggml's (so llama.cpp accepts the file)."""
    return all(info.ggml_type in GGML_QUANT_SIZES for info in model.tensors.values())


@contextmanager
def llama_vocab_file(model: GGUFFile) -> Iterator[Path]:
    """The model's own path when llama.cpp can parse it, else a metadata-only copy that lives
    until the block exits."""
    if llama_can_parse(model):
        yield model.path
        return
    handle, name = tempfile.mkstemp(prefix=f"{model.path.stem}.", suffix=".vocab.gguf")
    path = Path(name)
    try:
        with os.fdopen(handle, "wb") as file:
            write_metadata_only(model, file)
        yield path
    finally:
        path.unlink(missing_ok=True)


def write_metadata_only(model: GGUFFile, file) -> None:
    """Write `model`'s header and metadata, with no tensors, as a GGUF file to a binary file."""
    num_kvs = len(model.metadata)
    file.write(MAGIC + struct.pack("<IQQ", model.version, 0, num_kvs))
    file.write(model.metadata_bytes())
