"""Byte sizes as users write them ("512MB", "4GiB", "2.5e9", 1 << 30)."""

import re
from decimal import ROUND_FLOOR, Context, Decimal
from numbers import Integral

from tierflow.errors import BudgetError

_UNITS = {
    "": 1, "B": 1,
    "K": 1000, "KB": 1000, "KIB": 1 << 10,
    "M": 1000**2, "MB": 1000**2, "MIB": 1 << 20,
    "G": 1000**3, "GB": 1000**3, "GIB": 1 << 30,
    "T": 1000**4, "TB": 1000**4, "TIB": 1 << 40,
}
# A decimal number (digits may be grouped with underscores, as in Python), an optional exponent, a unit.
_SIZE = re.compile(r"^\s*([+-]?)(\d(?:_?\d)*(?:\.\d(?:_?\d)*)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")
MAX_SIZE = 1 << 63  # sizes from here up are no machine's memory, and overflow the int64s they meet
_ROUND_DOWN = Context(rounding=ROUND_FLOOR)  # a product rounded down keeps its whole bytes exact


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "512MB", "4GiB", "1.5G", "2.5e9", "1_000_000" (K/M/G/T
    are decimal, KiB/MiB/GiB/TiB binary; a fraction of a byte is dropped)."""
    if isinstance(size, Integral) and not isinstance(size, bool):
        return _checked(int(size), size)
    if isinstance(size, str):
        match = _SIZE.match(size)
        if match and match.group(3).upper() in _UNITS:
            sign, number, unit = match.groups()
            return _checked(_scaled(Decimal(sign + number.replace("_", "")), _UNITS[unit.upper()], size),
                            size)
    raise BudgetError(f"cannot read memory size {size!r}: write bytes or a size like '512MB', '4GiB'")


def _scaled(value: Decimal, unit: int, size: str) -> int:
    """The whole bytes of value * unit. The exponent is looked at first, so that '1e999999999'
    is refused without the arithmetic."""
    if value.adjusted() > 20:
        raise _too_large(size)
    return int(_ROUND_DOWN.multiply(value, unit))


def _checked(num_bytes: int, size: int | str) -> int:
    if num_bytes < 0:
        raise BudgetError(f"memory size must not be negative, got {size!r}")
    if num_bytes >= MAX_SIZE:
        raise _too_large(size)
    return num_bytes


def _too_large(size: int | str) -> BudgetError:
    return BudgetError(f"memory size {size!r} is absurdly large (2**63 bytes or more)")


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
