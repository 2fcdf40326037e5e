"""Timing primitives shared by `tierflow probe` and the benchmarks: how much L3 there is, RAM
read bandwidth, packed matrices whose weights come from RAM rather than cache, and rates sampled
in interleaved rounds (a shared machine's noise then hits every figure alike)."""

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tierflow.cpu_kernels import matmul as kernels
from tierflow.cpu_kernels.packed import PackedMatrix, pack
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


class ReadBandwidth:
    """Read-only passes over a buffer far larger than L3 (numpy releases the GIL inside a
    reduction, so the threads' slices are read in parallel)."""

    # (view dtype, reduction): numpy's SIMD max over int32 reads ~20% faster with 2 threads here
    # than the plain add over uint64 words; a sample is the faster of the two.
    READERS = ((np.uint64, np.add.reduce), (np.int32, np.maximum.reduce))

    def __init__(self, num_bytes: int, max_threads: int):
        self.buffer = np.ones(num_bytes // 8 * 8, np.uint8)  # written once, so every page is mapped
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

    def close(self) -> None:
        self.pool.shutdown()
        self.buffer = None

    def __enter__(self) -> "ReadBandwidth":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def random_packed(rng: np.random.Generator, bits: int, rows: int, cols: int,
                  group: int = GROUP) -> PackedMatrix:
    """Random codes with sane scales; int8 codes get no mins, as Q8_0."""
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
    64-byte aligned."""

    def __init__(self, nbytes: int):
        self.buffer, self.used = aligned_buffer(nbytes), 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        array = np.frombuffer(self.buffer, np.uint8, nbytes, self.used).view(dtype).reshape(shape)
        self.used += -(-nbytes // 64) * 64
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


def best_of_rounds(tasks: dict[object, Callable[[], float]], rounds: int) -> dict[object, float]:
    """The highest of each task's samples (a rate) over `rounds` rounds after a warm-up round."""
    best = {name: 0.0 for name in tasks}
    order = list(tasks)
    for round_idx in range(rounds + 1):
        for name in order:
            time.sleep(0.02)  # the last task's spinning threads go to sleep, off the cores
            sample = tasks[name]()
            if round_idx:
                best[name] = max(best[name], sample)
        order.reverse()
    return best
