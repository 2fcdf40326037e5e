"""Byte sizes as users write them ("512MB", "4GiB", 1 << 30)."""

import re

from tierflow.errors import BudgetError

_UNITS = {
    "": 1, "B": 1,
    "K": 1000, "KB": 1000, "KIB": 1 << 10,
    "M": 1000**2, "MB": 1000**2, "MIB": 1 << 20,
    "G": 1000**3, "GB": 1000**3, "GIB": 1 << 30,
    "T": 1000**4, "TB": 1000**4, "TIB": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "512MB", "4GiB", "1.5G" (K/M/G/T are decimal)."""
    if isinstance(size, bool):
        raise BudgetError(f"memory size must be bytes or a string like '4GiB', not {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise BudgetError(f"memory size must not be negative, got {size}")
        return size
    if isinstance(size, str):
        match = _SIZE.match(size)
        if match and match.group(2).upper() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    raise BudgetError(f"cannot read memory size {size!r}: write bytes or a size like '512MB', '4GiB'")


def format_size(num_bytes: int) -> str:
    """A short human-readable size: 1536 -> '1.5 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def round_up_as_printed(num_bytes: int) -> int:
    """The smallest size >= num_bytes that format_size prints exactly (a tenth of its unit), so
    that the printed figure, parsed back, is enough."""
    unit = max([1] + [step for step in (1 << 10, 1 << 20, 1 << 30) if num_bytes >= step])
    if unit == 1:
        return num_bytes
    tenths = -(-num_bytes * 10 // unit)
    return -(-tenths * unit // 10)
