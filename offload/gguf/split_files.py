"""Models in parts, as llama.cpp's gguf-split writes them: `<stem>-00001-of-00003.gguf`, each part a GGUF
file of its own (metadata `split.no`, `split.count`, `split.tensors.count`), the tensors spread over them.

A split model is named by its first part; `read_model_gguf` reads every part's header and presents one
tensor table whose entries know their part, so nothing after it knows the model was split.
"""

import os
import re
from pathlib import Path

from tierflow.errors import ModelFileError
from tierflow.offload.gguf.reader import GGUFFile, read_gguf

SPLIT_KEY_PREFIX = "split."
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


def check_split_parts(path: Path) -> Path:
    """The file that names the model: for a split model its first part, once every part is there."""
    parts = split_parts(path)
    if parts is None:
        return path
    missing = [part for part in parts if not os.path.lexists(part)]
    if missing:
        raise ModelFileError(f"{path.name} is part of a model split in {len(parts)} files, and part "
                             f"{missing[0]} is missing")
    return parts[0]


def read_model_gguf(path: str | os.PathLike) -> GGUFFile:
    """The GGUF file at path, validated; for a split model's first part, the whole model's tensors."""
    first = read_gguf(path)
    try:
        count = first.metadata.get(SPLIT_KEY_PREFIX + "count", 1)
        if count == 1:
            return first
        return first.join_parts(_read_later_parts(first, count))
    except BaseException:
        first.close()
        raise


def _read_later_parts(first: GGUFFile, count: object) -> list[GGUFFile]:
    """Parts 2..count, each checked to be the part its name says, of a model of `count` parts."""
    if not isinstance(count, int) or count < 1:
        raise ModelFileError(f"{first.path.name}: split.count is {count!r}, not a number of files")
    paths = split_parts(first.path)
    if paths is None or paths[0] != first.path or len(paths) != count:
        raise ModelFileError(f"{first.path.name}: split.count is {count}, but the file is not named as the "
                             f"first of {count} parts (<name>-00001-of-{count:05d}.gguf)")
    check_split_parts(first.path)
    _check_part(first, 0, count)
    parts: list[GGUFFile] = []
    try:
        for index, path in enumerate(paths[1:], start=1):
            parts.append(read_gguf(path))
            _check_part(parts[-1], index, count)
        _check_tensor_count(first, sum(len(part.tensors) for part in [first, *parts]))
    except BaseException:
        for part in parts:
            part.close()
        raise
    return parts


def _check_part(part: GGUFFile, index: int, count: int) -> None:
    number, total = (part.metadata.get(SPLIT_KEY_PREFIX + key) for key in ("no", "count"))
    if number != index or total != count:
        raise ModelFileError(f"{part.path.name}: split.no is {number!r} and split.count {total!r}, "
                             f"but the file is named as part {index + 1} of {count}")


def _check_tensor_count(first: GGUFFile, found: int) -> None:
    expected = first.metadata.get(SPLIT_KEY_PREFIX + "tensors.count")
    if expected is not None and expected != found:
        raise ModelFileError(f"{first.path.name}: split.tensors.count is {expected!r}, but the parts hold "
                             f"{found} tensors")
