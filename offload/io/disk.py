"""Reads from disk that report disk speed: O_DIRECT into page-aligned buffers, with a fallback.

With O_DIRECT the kernel copies straight from the device into our buffer and the page cache never
holds the file, so a streamed layer costs a real disk read every time (and RAM budgets are not
silently exceeded by cached pages). File systems that refuse O_DIRECT (tmpfs, some network
mounts) get buffered reads followed by POSIX_FADV_DONTNEED for the range, which drops the pages
again. Reads use os.preadv, which releases the GIL and returns short at end of file, so a file
that shrinks under us is an error we can name rather than the bus error a memory map would give.
"""

import mmap
import os
from pathlib import Path

from tierflow.errors import ModelFileError

ALIGNMENT = 4096  # offsets, lengths and buffer addresses of O_DIRECT reads are multiples of this
HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64): buffers this large and larger ask for them


def aligned_size(nbytes: int) -> int:
    """nbytes rounded up to ALIGNMENT (at least one block): an aligned buffer's size."""
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer of aligned_size(nbytes) bytes (anonymous memory)."""
    buffer = mmap.mmap(-1, aligned_size(nbytes), flags=mmap.MAP_PRIVATE)
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


class DiskFile:
    """A file opened for aligned reads; `direct` says whether the page cache is bypassed."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd, self.direct = _open(self.path)

    def read_into(self, buffer: mmap.mmap, offset: int, nbytes: int) -> memoryview:
        """Reads nbytes at offset (both multiples of ALIGNMENT) into the start of buffer."""
        view = memoryview(buffer)[:nbytes]
        done = 0
        while done < nbytes:
            try:
                count = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as error:
                raise ModelFileError(f"{self.path.name}: reading {nbytes} bytes at {offset} "
                                     f"failed: {error.strerror or error}") from error
            if count == 0:
                raise ModelFileError(f"{self.path.name}: the file ends before byte {offset + nbytes} "
                                     f"(was it truncated or replaced while in use?)")
            done += count
        if not self.direct:
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return view

    def changed(self) -> int:
        """The file's ctime in ns. Any change through the file system moves it (a write in place,
        a truncation), and no call sets it back."""
        return os.fstat(self.fd).st_ctime_ns

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open(path: Path) -> tuple[int, bool]:
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            fd = os.open(path, flags | direct)
        except OSError:
            pass
        else:
            probe = aligned_buffer(ALIGNMENT)
            try:
                os.preadv(fd, [probe], 0)  # some file systems accept the flag but refuse reads
                return fd, True
            except OSError:
                os.close(fd)
            finally:
                probe.close()
    return os.open(path, flags), False
