"""Freed memory handed back to the system.

The C allocator (glibc's malloc) keeps the blocks it frees for later allocations, in one heap per
thread that allocated: after a pack build or a probe, whose pieces were allocated and freed on several
threads, tens of MiB would stay in the process's RSS, counted against the budget of what loads next.
`give_back_freed_memory` asks glibc to return its free pages (malloc_trim); elsewhere it does nothing.
"""

import ctypes
import ctypes.util
import functools


def give_back_freed_memory() -> None:
    """Returns the allocator's free pages to the system (glibc only), so that RSS is what is held."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None
