"""Damage done to files on purpose, for tests of what notices it."""

import os


def flip_byte(path: str | os.PathLike, offset: int) -> None:
    """Inverts every bit of the byte at `offset` in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
