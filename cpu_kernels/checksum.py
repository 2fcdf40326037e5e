"""zlib's CRC-32 at memory speed (csrc/crc32.c): the checksum the pack keeps of every extent, checked
when one is read (again after the file changes: offload/pack/reader.py). On two cores zlib's table
method (7 GB/s) took a streamed model's checks from the kernels' time; folding with PCLMULQDQ
runs at 18 GB/s a core here. Without that instruction zlib computes it."""

import zlib
from collections.abc import Callable

from tierflow.cpu_kernels import _kernels

# crc32(data, crc=0) -> zlib.crc32's value
crc32: Callable[..., int] = _kernels.crc32 if _kernels.crc32_folds() else zlib.crc32
