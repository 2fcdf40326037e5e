"""Measures the hardware profile (profile.py): disk, RAM and kernel speeds, the decoder's fixed cost.

    profile = load_profile(threads=2)      # cached in cache_dir(); measured on first use (~10 s)
    profile = probe(threads=2, quick=True) # a fresh, smaller measurement (tests)
    sizes = probe_sizes(allowance(cpu_memory), total_l3_bytes())  # what it takes, sizes.seconds

It measures within a memory allowance: the cpu_memory of the load that needs it (or `tierflow probe
--cpu-memory`), or 10% of the available RAM, whichever is smaller (`allowance`); every buffer below
is sized from it (`probe_sizes`), and the RSS it adds stays within it. Before it starts, the caller
can say how long it will take (`ProbeSizes.seconds`, an upper estimate: each phase stops at a time
limit), and the progress callback is told each step as it starts, with the seconds left, and the
steps done of PROBE_STEPS.

What is timed, each the best of a few passes unless said otherwise (the machine may be shared,
so the best is the least disturbed figure; GB = 1e9 bytes):
- disk: sequential 32 MiB `preadv` requests (READ_REQUEST_BYTES, the streamer's reads) over a
  scratch file written in the cache directory, opened with O_DIRECT so that the page cache is
  bypassed; a request's iovecs all point at one page-aligned buffer of at most 4 MiB (an eighth of
  the allowance), so its size costs no RAM. Where the file system refuses O_DIRECT (EINVAL),
  buffered reads after the file's cached pages are dropped (fsync, then POSIX_FADV_DONTNEED). The
  scratch file (up to 256 MiB of disk, written for at most ProbeSizes.disk_seconds, 2 s, and read for
  as long) is removed in every case, SIGTERM included, and one a killed probe left
  (.tierflow-probe.<pid>.tmp) by the next probe.
- RAM: numpy reductions over one page-aligned buffer (the arena), one slice per thread
  (`ReadBandwidth`).
- kernels: M = 1 and M = 32 products of the C kernels on random packed matrices (group 32, up to
  4096 x 4096), each bit width's copies (a ring) carved from the same arena. Before each timing, the
  rest of the arena (up to 2 L3 sizes of it) is read, which evicts the ring from the caches: its
  matrices come from RAM however small the ring, as a streamed or resident model's do.
  RAM and kernels are timed in interleaved rounds, until ProbeSizes.cpu_seconds (5 s) have passed.
The per-layer overhead of the decoder depends on the model's shape, so it is not measured here
but for each model planned (runtime/loading/overhead.py), and cached in the same file.
- GPU (only with CUDA): pinned host to device copy speed (a buffer of at most a quarter of the
  allowance).

The smallest sizes that keep the figures meaningful, and why:
- the arena, which the RAM figure reads whole: at least MIN_READ_L3 = 2 L3 sizes (all the machine's
  L3 caches together, `total_l3_bytes`: threads on two sockets read through both). A buffer read
  over and over that is larger than the last-level cache misses it on every line under LRU; twice
  its size leaves margin for the adaptive policies of recent CPUs, which keep part of a scan that
  only just exceeds the cache. Up to MAX_READ_L3 = 4 L3 sizes are used when the allowance has room
  (more reads the same speed, for longer), or more where rings of whole 4096 x 4096 matrices need it.
- the kernels' rings need no size of their own (each timing is preceded by reading 2 L3 sizes of
  other data). Their matrices have 4096 columns and up to 4096 rows, as many as let the largest (8-bit
  codes) fit its ring, a tenth of the arena; they are made a chunk of rows at a time, which takes
  MAKE_BYTES_PER_WEIGHT a weight, in at most a 16th of the allowance. The least is one tile of 64
  rows; below about 1024 rows (an allowance under 64 MiB) a call's fixed cost, microseconds, shows in
  the 1-token figures, which come out low.
- the disk's scratch file: at least one 32 MiB request (on disk, not in RAM).
An allowance too small for an arena of 2 L3 sizes (a small --cpu-memory on a CPU with a large L3) is
still kept: the probe measures within it, warns (ProbeWarning) that its RAM and kernel figures are
partly the cache's, and records it (HardwareProfile.rough), so that a later load or probe whose
allowance holds the smallest sizes measures again. Below MIN_ALLOWANCE (32 MiB) the probe takes
MIN_ALLOWANCE.

On a shared machine another process holding a core for a while can halve a figure even so:
`probe` warns (ProbeWarning) when other processes kept more than BUSY_CORES cores busy meanwhile.

The measuring helpers (offload/plan/measure.py: `total_l3_bytes`, `ReadBandwidth`, `rings_in`,
`seconds_per_call`) are shared with benchmarks/kernels.py; `random_packed` is the probe's own.
"""

import errno
import functools
import logging
import math
import mmap
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import psutil

from tierflow.cpu_kernels import matmul as kernels
from tierflow.cpu_kernels.packed import TILE_ROWS
from tierflow.errors import InvalidArgumentError, TierflowError
from tierflow.offload.io.disk import ALIGNMENT, DiskFile, aligned_buffer
from tierflow.offload.io.heap import give_back_freed_memory
from tierflow.offload.pack.temporaries import remove_stale, writing
from tierflow.offload.plan.measure import (
    ReadBandwidth,
    best_of_rounds,
    random_packed,
    rings_in,
    seconds_per_call,
    total_l3_bytes,
)
from tierflow.offload.plan.profile import BATCH_WIDTH, GpuProfile, HardwareProfile, cache_dir, profile_path
from tierflow.units import format_size

# Told what is being measured now and about how long is left, and the steps done of all; at the end
# ("done", n, n).
Progress = Callable[[str, int, int], None]
PROBE_STEPS = ("disk read speed", "RAM and kernel speeds", "GPU")
log = logging.getLogger(__name__)  # load_profile says, at INFO, how long a probe takes before it starts

KERNEL_BITS = (1, 2, 3, 4, 8)
READ_REQUEST_BYTES = 32 * 2**20  # about a streamed layer of a 7B model: the streamer's reads
BUSY_CORES = 0.3  # other processes' average load above which a measurement is suspect

DEFAULT_SHARE = 0.10  # of the available RAM: the allowance when no budget is given
MIN_ALLOWANCE = 32 * 2**20
MIN_READ_L3, MAX_READ_L3 = 2, 4  # the arena, in L3 sizes (module docstring)
QUICK_ALLOWANCE = 128 * 2**20  # a quick probe's allowance, at most
FLUSH_L3 = 2  # read before each kernel timing, at most, in L3 sizes
COLS, MAX_ROWS = 4096, 4096  # the kernels' matrices: K columns, up to this many rows
MAKE_BYTES_PER_WEIGHT = 11  # random_packed's peak for 4-bit codes: bit planes, tiles (10.25)
INT8_BYTES_PER_WEIGHT = 1.07  # the largest matrix's (8-bit codes, float16 scales per 32, a copy's padding)
# numpy's, the threads', the page tables' and the allocator's own beside the buffers: this, and a
# 64th of the allowance
RESERVE_BYTES = 16 * 2**20
RING_MAX = 256 * 2**20  # a bit width's copies: enough for a timing of tens of milliseconds
BATCH_RING_MAX = 32 * 2**20  # of those, read by a 32-token product (compute-bound: fewer suffice)
DISK_CHUNK_MAX = 4 * 2**20  # the disk's buffer, which each request's iovecs repeat
# For ProbeSizes.seconds: speeds no machine this runs on should be slower than (GB/s), and the time
# a GPU's measurement (its context) takes.
SLOW_RAM_GBPS, SLOW_FAULT_GBPS, SLOW_BATCH_GBPS, GPU_SECONDS = 6.0, 1.5, 15.0, 3.0
MAKE_SECONDS_PER_WEIGHT = 40e-9  # random_packed, per weight of one width


@dataclass(frozen=True)
class ProbeSizes:
    """What a probe allocates and how long it measures, from its allowance (probe_sizes)."""

    allowance: int  # the bytes the probe may add to the process's RSS
    arena_bytes: int  # the RAM buffer: read whole for the RAM figure; the kernels' rings are made in it
    matrix_rows: int  # of the kernels' matrices (COLS columns)
    chunk_rows: int  # made (random codes, packed) this many rows at a time
    ring_bytes: int  # each bit width's matrix and its copies
    flush_l3: int  # L3 sizes read before each kernel timing (less where the arena holds less)
    disk_chunk_bytes: int  # the disk reads' and writes' buffer
    scratch_bytes: int  # the disk's scratch file, at most (on disk)
    disk_seconds: float  # writing the scratch file, then reading it, stop after this long each
    disk_passes: int  # reads of the scratch file, at most
    rounds: int  # of the RAM and kernel timings after a warm-up round, at most ...
    cpu_seconds: float  # ... stopping after the round that ends past this
    h2d_bytes: int
    rough: bool  # the arena is smaller than MIN_READ_L3 L3 sizes: RAM and kernel figures partly cached
    l3_bytes: int

    @property
    def seconds(self) -> float:
        """About how long the probe takes at most on a machine no slower than SLOW_*: making the
        arena and the matrices, the disk's two phases (each may run a request or a pass past its
        limit), the rounds (the last may end past cpu_seconds), and the GPU's if there is one."""
        setup = (len(KERNEL_BITS) * self.matrix_rows * COLS * MAKE_SECONDS_PER_WEIGHT
                 + 2 * self.arena_bytes / SLOW_FAULT_GBPS / 1e9)
        disk = 2 * self.disk_seconds + 0.5
        batch_ring = min(self.ring_bytes, BATCH_RING_MAX)
        flush = min(self.flush_l3 * self.l3_bytes, self.arena_bytes)
        per_round = ((2 * self.arena_bytes + len(KERNEL_BITS) * (self.ring_bytes + batch_ring + 2 * flush))
                     / SLOW_RAM_GBPS / 1e9
                     + len(KERNEL_BITS) * batch_ring * BATCH_WIDTH / SLOW_BATCH_GBPS / 1e9
                     + 2 * len(KERNEL_BITS) * 0.02)  # and best_of_rounds' pauses
        cpu = min(self.rounds + 1, 1 + max(1, math.ceil(self.cpu_seconds / per_round))) * per_round
        return setup + disk + cpu + (GPU_SECONDS if _has_cuda() else 0.0)


def allowance(memory_bytes: int | None = None) -> int:
    """What a probe may take: memory_bytes (a load's cpu_memory) or DEFAULT_SHARE of the available
    RAM, whichever is smaller; at least MIN_ALLOWANCE."""
    share = int(psutil.virtual_memory().available * DEFAULT_SHARE)
    memory = share if memory_bytes is None else min(int(memory_bytes), share)
    return max(memory, MIN_ALLOWANCE)


def probe_sizes(allowed: int, l3_bytes: int, quick: bool = False) -> ProbeSizes:
    """The sizes of a probe within `allowed` bytes (allowance()) on a CPU with this L3; quick: within
    QUICK_ALLOWANCE at most, shorter limits, one round (tests)."""
    memory = max(min(allowed, QUICK_ALLOWANCE) if quick else allowed, MIN_ALLOWANCE)
    chunk = _rows(memory // 16 // (MAKE_BYTES_PER_WEIGHT * COLS), MAX_ROWS)  # making a matrix: a 16th
    making = chunk * COLS * MAKE_BYTES_PER_WEIGHT
    # up to MAX_READ_L3 L3 sizes, or room for rings of whole 4096 x 4096 matrices where that is more
    full_rings = int(2 * len(KERNEL_BITS) * MAX_ROWS * COLS * INT8_BYTES_PER_WEIGHT) + 2**20
    arena = min(memory - RESERVE_BYTES - memory // 64 - making, max(MAX_READ_L3 * l3_bytes, full_rings))
    arena = arena // ALIGNMENT * ALIGNMENT
    ring = min(RING_MAX, arena // (2 * len(KERNEL_BITS)))  # the rings take half: the rest is read between
    rows = _rows(int(ring / INT8_BYTES_PER_WEIGHT / COLS), MAX_ROWS)  # the largest (8-bit) fits its ring
    disk_chunk = min(DISK_CHUNK_MAX, memory // 8)
    return ProbeSizes(
        allowance=allowed, arena_bytes=arena, matrix_rows=rows, chunk_rows=min(chunk, rows), ring_bytes=ring,
        flush_l3=FLUSH_L3, disk_chunk_bytes=disk_chunk, scratch_bytes=(32 if quick else 256) * 2**20,
        disk_seconds=0.5 if quick else 2.0, disk_passes=2 if quick else 3, rounds=1 if quick else 5,
        cpu_seconds=1.0 if quick else 5.0, h2d_bytes=min((64 if quick else 256) * 2**20, memory // 4),
        rough=arena < MIN_READ_L3 * l3_bytes, l3_bytes=l3_bytes)


def _rows(rows: int, most: int) -> int:
    """rows in whole tiles, at least one, at most `most`."""
    return min(most, max(TILE_ROWS, rows // TILE_ROWS * TILE_ROWS))


def probe(threads: int, directory: Path | None = None, quick: bool = False,
          progress: Progress | None = None, memory_bytes: int | None = None) -> HardwareProfile:
    """Measures this machine with `threads` CPU threads, adding at most allowance(memory_bytes) to
    the process's RSS; the disk is the one holding `directory` (default: the cache directory).
    quick: smaller sizes, a few seconds, rougher figures."""
    _check_threads(threads)
    l3_bytes = total_l3_bytes()
    sizes = probe_sizes(allowance(memory_bytes), l3_bytes, quick)
    started, estimate = time.perf_counter(), sizes.seconds

    def say(step: str) -> None:
        if progress is not None:
            left = max(1, round(estimate - (time.perf_counter() - started)))
            progress(f"{step}, about {left} s left", PROBE_STEPS.index(step), len(PROBE_STEPS))

    say("disk read speed")
    disk_gbps, direct = disk_read_gbps(directory or cache_dir(), sizes.scratch_bytes, sizes.disk_passes,
                                       sizes.disk_chunk_bytes, sizes.disk_seconds)
    previous_threads = kernels.threads()
    try:
        kernels.set_threads(threads)
        with OtherProcesses() as others:
            say("RAM and kernel speeds")
            ram_gbps, single, batch = cpu_speeds(threads, sizes)
    finally:
        kernels.set_threads(previous_threads)
        give_back_freed_memory()
    if others.busy_cores > BUSY_CORES:
        warnings.warn(ProbeWarning(
            f"other processes kept {others.busy_cores:.1f} cores busy on average while the CPU was "
            f"measured, so its speeds are probably low; measure again on an idle machine "
            f"(tierflow probe --refresh)"), stacklevel=2)
    if sizes.rough:
        warnings.warn(ProbeWarning(
            f"the probe measured within {format_size(sizes.allowance)}, which holds a RAM buffer of "
            f"{format_size(sizes.arena_bytes)}, less than twice this CPU's {format_size(l3_bytes)} L3 cache: "
            f"its RAM and kernel speeds are partly the cache's, probably high; a load or probe allowed "
            f"{format_size(_floor_allowance(l3_bytes))} measures again"), stacklevel=2)
    say("GPU")
    profile = HardwareProfile(threads=threads, cpu_name=cpu_name(), disk_read_gbps=disk_gbps,
                              disk_direct_io=direct, ram_read_gbps=ram_gbps, kernel_gbps=single,
                              kernel_batch_gbps=batch, gpu=gpu_profile(sizes.h2d_bytes), rough=sizes.rough)
    if progress is not None:
        progress("done", len(PROBE_STEPS), len(PROBE_STEPS))
    return profile


def _floor_allowance(l3_bytes: int) -> int:
    """The least allowance (to a MiB) whose arena holds MIN_READ_L3 L3 sizes: a profile measured
    within it is not rough."""
    low, high = MIN_ALLOWANCE, 2 * MIN_ALLOWANCE + 4 * MIN_READ_L3 * l3_bytes  # rough at low, not at high
    while high - low > 2**20:
        middle = (low + high) // 2
        low, high = (middle, high) if probe_sizes(middle, l3_bytes).rough else (low, middle)
    return high


class ProbeWarning(UserWarning):
    """The machine was busy while it was measured, or the allowance too small for the smallest
    sizes: the figures are probably off."""


class OtherProcesses:
    """`busy_cores`: how many cores other processes (and the hypervisor, as steal time) kept busy
    on average while the block ran."""

    def __enter__(self) -> "OtherProcesses":
        self._start = (_busy_seconds(psutil.cpu_times()), _own_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, own, started = self._start
        others = (_busy_seconds(psutil.cpu_times()) - busy) - (_own_seconds() - own)
        self.busy_cores = max(0.0, others / max(time.perf_counter() - started, 1e-9))


def _busy_seconds(times) -> float:
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_seconds() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def load_profile(threads: int, refresh: bool = False, progress: Progress | None = None,
                 memory_bytes: int | None = None) -> HardwareProfile:
    """The cached profile for `threads`, measured (full, within allowance(memory_bytes)) and cached
    first when there is none, when it is unreadable or of another version, when refresh is set, or
    when it was measured rough and this allowance holds the smallest sizes."""
    _check_threads(threads)
    cached = read_profile(profile_path(threads))
    sizes = will_probe(threads, refresh, memory_bytes)
    if sizes is None:
        return cached
    log.info("%s", announcement(sizes))  # a load's CLI shows it (cli/display.py pack_notices)
    profile = probe(threads, progress=progress, memory_bytes=memory_bytes)
    if cached is not None and cached.threads == threads and cached.rough and cached.overhead_by_shape:
        profile = replace(profile, overhead_by_shape=cached.overhead_by_shape)  # per shape: still valid
    save_profile(profile)
    return profile


def will_probe(threads: int, refresh: bool = False, memory_bytes: int | None = None) -> ProbeSizes | None:
    """The sizes of the probe load_profile(threads, refresh, memory_bytes=...) would run, or None
    when it would answer from the cache."""
    sizes = probe_sizes(allowance(memory_bytes), total_l3_bytes())
    cached = read_profile(profile_path(threads))
    usable = cached is not None and cached.threads == threads and not (cached.rough and not sizes.rough)
    if usable and not refresh:
        return None
    return sizes


def announcement(sizes: ProbeSizes) -> str:
    """What a caller says before a probe starts: how long, within how much RAM."""
    return (f"measuring this machine once for the planner (tierflow probe): about {sizes.seconds:.0f} s, "
            f"within {format_size(sizes.allowance)} of RAM")


def save_profile(profile: HardwareProfile) -> None:
    """Caches the profile (replacing the one of its thread count)."""
    _write_atomically(profile_path(profile.threads), profile.to_json())


def read_profile(path: Path) -> HardwareProfile | None:
    """The profile in `path`, or None if it is missing, corrupt or of another version."""
    try:
        return HardwareProfile.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of one."""
    fd, temp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _check_threads(threads: int) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r}")


# --- disk ----------------------------------------------------------------------------------------

SCRATCH_NAME = ".tierflow-probe"  # the scratch file is SCRATCH_NAME.<pid>.tmp


def disk_read_gbps(directory: Path, size_bytes: int, passes: int = 3, chunk_bytes: int = DISK_CHUNK_MAX,
                   seconds: float | None = None) -> tuple[float, bool]:
    """(GB/s, whether O_DIRECT bypassed the page cache): the best of `passes` sequential reads of
    a scratch file of up to size_bytes written in `directory`, then removed. With `seconds`, writing
    stops after that long (at least one request written), and so do the passes (at least one).
    The buffer is chunk_bytes, repeated in each request's iovecs."""
    size_bytes = max(1, size_bytes // READ_REQUEST_BYTES) * READ_REQUEST_BYTES
    chunk_bytes = _chunk(chunk_bytes)

    def failed(error: OSError) -> TierflowError:
        return TierflowError(f"cannot measure the disk: writing {size_bytes >> 20} MiB to {directory} "
                             f"failed: {error.strerror or error}")

    with ExitStack() as scratch:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            remove_stale(directory, f"{SCRATCH_NAME}.*.tmp")  # left by a probe that was killed
            path, file = scratch.enter_context(writing(directory / SCRATCH_NAME))  # removed at the end
            written = _write_scratch(file.fileno(), size_bytes, chunk_bytes, seconds)
        except OSError as error:
            raise failed(error) from error
        disk = DiskFile(path)
        try:
            best, started = math.inf, time.perf_counter()
            for _ in range(passes):
                best = min(best, _read_seconds(disk, written, chunk_bytes))
                if seconds is not None and time.perf_counter() - started >= seconds:
                    break
        finally:
            disk.close()
        return written / best / 1e9, disk.direct


def _chunk(chunk_bytes: int) -> int:
    """A buffer size that divides READ_REQUEST_BYTES, a power of two from 64 KiB (a request's iovecs
    then stay under IOV_MAX) up to chunk_bytes."""
    chunk = 64 * 2**10
    while chunk * 2 <= min(chunk_bytes, READ_REQUEST_BYTES):
        chunk *= 2
    return chunk


def _write_scratch(fd: int, size_bytes: int, chunk_bytes: int, seconds: float | None) -> int:
    """Random bytes (a compressing or deduplicating file system must not shrink them), synced after
    each request; stops after `seconds` (at least one request). Returns the bytes written."""
    rng = np.random.default_rng()
    buffer = mmap.mmap(-1, chunk_bytes)  # page-aligned
    try:
        written, started = 0, time.perf_counter()
        while written < size_bytes:
            for _ in range(READ_REQUEST_BYTES // chunk_bytes):
                for at in range(0, chunk_bytes, 2**20):  # fresh bytes, a MiB at a time
                    buffer[at: at + 2**20] = rng.bytes(min(2**20, chunk_bytes - at))
                if os.write(fd, buffer) != chunk_bytes:  # a regular file's writes stop short only when full
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fdatasync(fd)
            written += READ_REQUEST_BYTES
            if seconds is not None and time.perf_counter() - started >= seconds:
                break
        os.fsync(fd)
        return written
    finally:
        buffer.close()


def _read_seconds(disk: DiskFile, size_bytes: int, chunk_bytes: int = DISK_CHUNK_MAX) -> float:
    """One pass over the file in READ_REQUEST_BYTES requests, as the streamer reads layers, each
    into one chunk_bytes buffer repeated (the bytes are not kept)."""
    buffer = aligned_buffer(chunk_bytes)
    try:
        if not disk.direct:
            os.posix_fadvise(disk.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the file is synced: its pages go
        started = time.perf_counter()
        for offset in range(0, size_bytes, READ_REQUEST_BYTES):
            _read_request(disk, buffer, chunk_bytes, offset)
        return time.perf_counter() - started
    finally:
        buffer.close()


def _read_request(disk: DiskFile, buffer: mmap.mmap, chunk_bytes: int, offset: int) -> None:
    """READ_REQUEST_BYTES at offset into `buffer`'s first chunk_bytes, repeated (preadv may stop
    short: the rest is read from there)."""
    with memoryview(buffer) as whole, whole[:chunk_bytes] as view:
        done = 0
        while done < READ_REQUEST_BYTES:
            skip, rest = divmod(done, chunk_bytes)
            with view[rest:] as first:
                count = os.preadv(disk.fd, [first] + [view] * (READ_REQUEST_BYTES // chunk_bytes - skip - 1),
                                  offset + done)
            if count == 0:
                raise TierflowError(f"cannot measure the disk: {disk.path} ended early")
            done += count


# --- kernels -------------------------------------------------------------------------------------

def cpu_speeds(threads: int, sizes: ProbeSizes) -> tuple[float, dict[int, float], dict[int, float]]:
    """(RAM read GB/s, bits -> kernel GB/s at M = 1, bits -> packed bytes x 32 / time at M = 32),
    with the kernels' current thread count.

    Timed in rounds, as benchmarks/kernels.py times its sweeps: after a warm-up round each timing runs
    once a round, the order reversed every round, and each keeps its best. A quiet moment anywhere in the
    run then serves every figure; timing each figure's passes back to back lets another process
    that holds a core for a second halve one figure and not the next. Memory: the arena, which holds
    the rings (each width's matrix, made in it sizes.chunk_rows at a time, and its copies) and is read
    whole for the RAM figure, and the making of a chunk: within sizes.allowance.
    """
    buffer = aligned_buffer(sizes.arena_bytes)
    try:
        return _timed(np.frombuffer(buffer, np.uint8), threads, sizes)
    finally:
        try:
            buffer.close()
        except BufferError:
            pass  # a view still alive (an exception's traceback): unmapped with the last one


def _timed(arena: np.ndarray, threads: int, sizes: ProbeSizes
           ) -> tuple[float, dict[int, float], dict[int, float]]:
    """cpu_speeds' rounds, in `arena` (uint8, sizes.arena_bytes)."""
    arena[:] = 1  # every page mapped before anything is timed
    rng = np.random.default_rng(0)
    makers = [lambda empty, bits=bits: random_packed(rng, bits, sizes.matrix_rows, COLS, empty=empty,
                                                     chunk_rows=sizes.chunk_rows) for bits in KERNEL_BITS]
    rings = rings_in(arena, makers, sizes.ring_bytes)
    give_back_freed_memory()  # what making them freed
    flush_bytes = sizes.flush_l3 * sizes.l3_bytes
    with ReadBandwidth(sizes.arena_bytes, threads, arena) as bandwidth:
        def cold_seconds(ring, span, batch: int) -> float:
            """A pass over the ring after reading up to flush_bytes of the arena outside it."""
            bandwidth.read(_outside(span, len(arena), flush_bytes), threads)
            return seconds_per_call(ring, batch, 1)

        tasks: dict[object, Callable[[], float]] = {"ram": lambda: bandwidth.gb_per_s(threads, 1)}
        for bits, (ring, span) in zip(KERNEL_BITS, rings):
            batch_ring = ring[: max(1, BATCH_RING_MAX // ring[0].nbytes)]
            tasks[bits, 1] = lambda ring=ring, span=span: ring[0].nbytes / cold_seconds(ring, span, 1) / 1e9
            tasks[bits, BATCH_WIDTH] = (lambda ring=batch_ring, span=span:
                                  ring[0].nbytes * BATCH_WIDTH / cold_seconds(ring, span, BATCH_WIDTH) / 1e9)
        best = best_of_rounds(tasks, sizes.rounds, sizes.cpu_seconds)
    return (best["ram"], {bits: best[bits, 1] for bits in KERNEL_BITS},
            {bits: best[bits, BATCH_WIDTH] for bits in KERNEL_BITS})


def _outside(span: tuple[int, int], total: int, limit: int) -> list[tuple[int, int]]:
    """Up to `limit` bytes of [0, total) outside `span`, from its end on, wrapping around."""
    start, end = span
    after = (end, min(total, end + limit))
    before = (0, min(start, max(0, limit - (after[1] - after[0]))))
    return [after, before]


# --- the rest ------------------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.cache
def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def gpu_profile(h2d_bytes: int, passes: int = 3) -> GpuProfile | None:
    """The first CUDA GPU's name, memory and pinned host to device copy speed; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    host = torch.empty(h2d_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(h2d_bytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm-up: context, allocator, DMA mappings
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(passes):
        started = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    # The GPU kernels' speed is not timed here yet (benchmarks/gpu.py does, where a GPU is): with
    # kernel_gbps empty the planner's GPU compute times use a stated placeholder.
    return GpuProfile(name=properties.name, memory_bytes=properties.total_memory,
                      h2d_gbps=h2d_bytes / best / 1e9, kernel_gbps={})
