"""Damage done to files on purpose, for tests of what notices it."""

import os
import shutil
from pathlib import Path


def flip_byte(path: str | os.PathLike, offset: int) -> None:
    """Inverts every bit of the byte at `offset` in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def copy_patched(source: str | os.PathLike, dest: str | os.PathLike, offset: int, data: bytes) -> Path:
    """A copy of `source` with `data` written over its bytes from `offset` on."""
    shutil.copyfile(source, dest)
    with open(dest, "r+b") as file:
        file.seek(offset)
        file.write(data)
    return Path(dest)
