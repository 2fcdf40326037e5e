"""Timing primitives shared by `tierflow probe` and the benchmarks: how much L3 there is, RAM
read bandwidth, packed matrices whose weights come from RAM rather than cache, and rates sampled
in interleaved rounds (a shared machine's noise then hits every figure alike)."""

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from tierflow.cpu_kernels import matmul as kernels
from tierflow.cpu_kernels.packed import TILE_ROWS, PackedMatrix, pack
from tierflow.cpu_kernels.quant_groups import QuantGroups
from tierflow.offload.io.disk import aligned_buffer

GROUP = 32
FALLBACK_L3_BYTES = 64 * 2**20


def l3_cache_bytes() -> tuple[int, str]:
    """The L3 size from sysfs, and where it came from."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()
                units = {"K": 2**10, "M": 2**20, "G": 2**30}
                return int(size.rstrip("KMG")) * units.get(size[-1], 1), f"{index}/size"
        except (OSError, ValueError):
            break
    return FALLBACK_L3_BYTES, "not found in sysfs: assumed 64 MiB"


def total_l3_bytes() -> int:
    """All the L3 caches of the machine together: one per group of cores that share one (a socket, an
    AMD CCX), as sysfs lists them; l3_cache_bytes() when sysfs says nothing. Threads on several such
    groups read through all of them."""
    caches: dict[str, int] = {}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index3"):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip()
            units = {"K": 2**10, "M": 2**20, "G": 2**30}
            caches[(index / "shared_cpu_list").read_text().strip()] = int(size.rstrip("KMG")) * units.get(
                size[-1], 1)
        except (OSError, ValueError):
            continue
    return sum(caches.values()) or l3_cache_bytes()[0]


class ReadBandwidth:
    """Read-only passes over a buffer far larger than L3 (numpy releases the GIL inside a
    reduction, so the threads' slices are read in parallel)."""

    # (view dtype, reduction): numpy's SIMD max over int32 reads ~20% faster with 2 threads here
    # than the plain add over uint64 words; a sample is the faster of the two.
    READERS = ((np.uint64, np.add.reduce), (np.int32, np.maximum.reduce))

    def __init__(self, num_bytes: int, max_threads: int, buffer: np.ndarray | None = None):
        """Over a buffer of its own (num_bytes, written once so that every page is mapped), or over
        the first num_bytes of `buffer` (uint8, its pages mapped)."""
        if buffer is None:
            self.buffer = np.ones(num_bytes // 8 * 8, np.uint8)
        else:
            self.buffer = buffer[: min(num_bytes, buffer.nbytes) // 8 * 8]
        self.pool = ThreadPoolExecutor(max_threads)

    def gb_per_s(self, threads: int, passes: int) -> float:
        best = math.inf
        for _ in range(passes):
            for dtype, reduce in self.READERS:
                parts = np.array_split(self.buffer.view(dtype), threads)
                started = time.perf_counter()
                list(self.pool.map(reduce, parts))
                best = min(best, time.perf_counter() - started)
        return self.buffer.nbytes / best / 1e9

    def read(self, spans: list[tuple[int, int]], threads: int) -> None:
        """Reads the buffer's bytes [start, end) of each span, split over `threads` (to evict other
        data from the caches)."""
        words = self.buffer.view(np.uint64)
        parts = [part for start, end in spans if end - start >= 8
                 for part in np.array_split(words[start // 8: end // 8], threads)]
        list(self.pool.map(np.add.reduce, parts))

    def close(self) -> None:
        self.pool.shutdown()
        self.buffer = None

    def __enter__(self) -> "ReadBandwidth":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def random_packed(rng: np.random.Generator, bits: int, rows: int, cols: int, group: int = GROUP,
                  empty: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None,
                  chunk_rows: int | None = None) -> PackedMatrix:
    """Random codes with sane scales; int8 codes get no mins, as Q8_0. With `empty`, its arrays are
    made by empty(shape, dtype) (an arena's) and packed chunk_rows rows at a time (whole tiles), so
    that making them holds one chunk's codes and bit planes, not the whole matrix's."""
    if empty is None:
        return _random_rows(rng, bits, rows, cols, group)
    step = max(TILE_ROWS, (chunk_rows or rows) // TILE_ROWS * TILE_ROWS)
    matrix, names = None, ("data", "scales", "mins")
    for first in range(0, rows, step):
        part = _random_rows(rng, bits, min(step, rows - first), cols, group)
        if matrix is None:
            tiles = -(-rows // TILE_ROWS)
            matrix = replace(part, rows=rows, **{name: None if getattr(part, name) is None else empty(
                (tiles, *getattr(part, name).shape[1:]), getattr(part, name).dtype) for name in names})
        tile = first // TILE_ROWS
        for name in names:
            if getattr(part, name) is not None:
                getattr(matrix, name)[tile: tile + part.tiles] = getattr(part, name)
    return matrix


def _random_rows(rng: np.random.Generator, bits: int, rows: int, cols: int, group: int) -> PackedMatrix:
    groups = (rows, cols // group)
    scale = rng.uniform(0.005, 0.015, groups).astype(np.float32)
    if bits == 8:
        q = rng.integers(-128, 128, (rows, cols), dtype=np.int8)
        min_ = np.full(groups, -0.0, np.float32)
    else:
        q = rng.integers(0, 2**bits, (rows, cols), dtype=np.uint8)
        min_ = -scale * (2**bits - 1) / 2
    return pack(QuantGroups(q, scale, min_, group, bits))


class _Arena:
    """Arrays carved from one page-aligned buffer (on transparent huge pages from 2 MiB up), each
    64-byte aligned; or from `buffer` (a uint8 array), from byte `start` on."""

    def __init__(self, nbytes: int, buffer: np.ndarray | None = None, start: int = 0):
        self.buffer = aligned_buffer(nbytes) if buffer is None else buffer
        self.used = start

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.used = -(-self.used // 64) * 64
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        array = np.frombuffer(self.buffer, np.uint8, nbytes, self.used).view(dtype).reshape(shape)
        self.used += nbytes
        return array


def cold_ring(first: PackedMatrix, cold_bytes: int) -> list[PackedMatrix]:
    """Distinct copies of `first`, together more than cold_bytes: cycling through them, no call finds
    its matrix in the cache when cold_bytes is a few times the L3 size. They share one buffer, as a
    layer's matrices share the huge-page buffer the engine reads its resident weights into
    (offload/tiers/tiered.py): in numpy arrays of their own, matrices of a few MiB sit on 4 KiB
    pages, whose TLB misses cost a cold 1-thread read up to a fifth of its speed here."""
    copies = cold_bytes // first.nbytes + 1
    arena = _Arena(copies * (first.nbytes + 64 * 6))
    return [first.copy(arena.empty) for _ in range(copies)]


def rings_in(buffer: np.ndarray, makers: list[Callable[[Callable], PackedMatrix]], ring_bytes: int
             ) -> list[tuple[list[PackedMatrix], tuple[int, int]]]:
    """Rings of copies as cold_ring's, carved one after the other from `buffer` (uint8): for each of
    `makers` (each makes a matrix given an `empty(shape, dtype)` to make its arrays with), that matrix
    made in the buffer and as many copies of it as fit ring_bytes in all (at least one); per matrix its
    ring and the span [start, end) of the buffer it takes. A buffer too small raises ValueError."""
    arena, rings = _Arena(0, buffer), []
    for make in makers:
        start = arena.used
        first = make(arena.empty)
        copies = max(1, ring_bytes // (first.nbytes + 64 * 6))
        rings.append(([first] + [first.copy(arena.empty) for _ in range(copies - 1)], (start, arena.used)))
    return rings


def seconds_per_call(ring: list[PackedMatrix], batch: int, passes: int) -> float:
    """Best over `passes` passes through the ring of the mean time of one [batch, K] product."""
    x = np.random.default_rng(batch).standard_normal((batch, ring[0].cols), dtype=np.float32)
    out = np.empty((batch, ring[0].rows), np.float32)
    best = math.inf
    for _ in range(passes):
        started = time.perf_counter()
        for w in ring:
            kernels.matmul(w, x, out)
        best = min(best, (time.perf_counter() - started) / len(ring))
    return best


def best_of_rounds(tasks: dict[object, Callable[[], float]], rounds: int,
                   seconds: float | None = None) -> dict[object, float]:
    """The highest of each task's samples (a rate) over `rounds` rounds after a warm-up round, or
    fewer (at least one) when `seconds` have passed since the start at the end of a round."""
    best = {name: 0.0 for name in tasks}
    order = list(tasks)
    started = time.perf_counter()
    for round_idx in range(rounds + 1):
        for name in order:
            time.sleep(0.02)  # the last task's spinning threads go to sleep, off the cores
            sample = tasks[name]()
            if round_idx:
                best[name] = max(best[name], sample)
        order.reverse()
        if round_idx and seconds is not None and time.perf_counter() - started >= seconds:
            break
    return best
