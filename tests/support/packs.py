"""A generated model's pack, written as a load that streams would write it."""

from pathlib import Path

from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.reader import PackedFile
from tierflow.offload.pack.writer import open_pack


def written_pack(model: Path) -> PackedFile:
    """The model's pack, written first if it is missing (what a streaming load opens; a load that
    holds every layer in RAM writes none)."""
    with open_model_file(model) as opened:
        return open_pack(opened)
