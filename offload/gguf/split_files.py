"""Models in parts, as llama.cpp's gguf-split writes them: `<stem>-00001-of-00003.gguf`, each part a GGUF
file of its own (metadata `split.no`, `split.count`, `split.tensors.count`), the tensors spread over them."""

import os
import re
from pathlib import Path

from tierflow.errors import ModelFileError, UnsupportedModelError

_SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)


def split_parts(path: Path) -> list[Path] | None:
    """Every part's path when the file name is a part's, else None."""
    found = _SPLIT_NAME.fullmatch(path.name)
    if found is None or int(found["count"]) < 1:
        return None
    stem, count = found["stem"], int(found["count"])
    return [path.with_name(f"{stem}-{no:05d}-of-{count:05d}.gguf") for no in range(1, count + 1)]


def first_part(path: Path) -> Path:
    """The first part of a split model, or the path itself."""
    parts = split_parts(path)
    return parts[0] if parts else path


def is_later_part(path: Path) -> bool:
    return first_part(path) != path


def refuse_split_model(path: Path) -> None:
    """A split model: each of its parts must be there; loading them as one model is not done yet."""
    parts = split_parts(path)
    if parts is None:
        return
    missing = [part for part in parts if not os.path.lexists(part)]
    if missing:
        raise ModelFileError(f"{path.name} is part of a model split in {len(parts)} files, and part "
                             f"{missing[0]} is missing")
    raise UnsupportedModelError(f"{first_part(path)} is the first of {len(parts)} parts of a split model "
                                "(gguf-split); tierflow cannot load split models yet: merge them with "
                                "llama.cpp's `llama-gguf-split --merge`")
