"""Measures the hardware profile (profile.py): disk, RAM and kernel speeds, the decoder's fixed cost.

    profile = load_profile(threads=2)      # cached in cache_dir(); measured on first use (~20 s)
    profile = probe(threads=2, quick=True) # a fresh, smaller measurement (tests)

What is timed, each the best of a few passes unless said otherwise (the machine may be shared,
so the best is the least disturbed figure; GB = 1e9 bytes):
- disk: sequential 4 MiB `preadv` requests into a page-aligned (mmap) buffer over a scratch file
  written in the cache directory, opened with O_DIRECT so that the page cache is bypassed. Where
  the file system refuses O_DIRECT (EINVAL), buffered reads after the file's cached pages are
  dropped (fsync, then POSIX_FADV_DONTNEED). The scratch file is removed in every case.
- RAM: numpy reductions over a buffer far larger than L3, one slice per thread (`ReadBandwidth`).
- kernels: M = 1 and M = 32 products of the C kernels on random packed matrices (group 32),
  cycling through copies that together exceed 4x L3, so that the weights come from RAM (1x L3
  when quick: partly cached, so rougher). RAM and kernels are timed in interleaved rounds.
The per-layer overhead of the decoder depends on the model's shape, so it is not measured here
but for each model planned (runtime/overhead.py), and cached in the same file.
- GPU (only with CUDA): pinned host to device copy speed.

On a shared machine another process holding a core for a while can halve a figure even so:
`probe` warns (ProbeWarning) when other processes kept more than BUSY_CORES cores busy meanwhile.

The measuring helpers (offload/plan/measure.py: `l3_cache_bytes`, `ReadBandwidth`, `cold_ring`,
`seconds_per_call`) are shared with benchmarks/kernels.py; `random_packed` is the probe's own.
"""

import errno
import math
import mmap
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from tierflow.cpu_kernels import matmul as kernels
from tierflow.errors import InvalidArgumentError, TierflowError
from tierflow.offload.io.disk import DiskFile, aligned_buffer
from tierflow.offload.plan.measure import (
    ReadBandwidth,
    best_of_rounds,
    cold_ring,
    l3_cache_bytes,
    random_packed,
    seconds_per_call,
)
from tierflow.offload.plan.profile import GpuProfile, HardwareProfile, cache_dir, profile_path

Progress = Callable[[str], None]  # told what is being measured now

KERNEL_BITS = (1, 2, 3, 4, 8)
BATCH = 32  # M of the batched (prefill) products
READ_REQUEST_BYTES = 32 * 2**20  # about a streamed layer of a 7B model: the streamer's reads
BUSY_CORES = 0.3  # other processes' average load above which a measurement is suspect


@dataclass(frozen=True)
class ProbeSizes:
    scratch_bytes: int  # the disk's scratch file
    read_buffer_l3: int  # the RAM read buffer, in multiples of L3
    kernel_shape: tuple[int, int]  # N rows x K columns of the kernels' matrices
    kernel_ring_l3: int  # the kernels' copies of a matrix together exceed this many L3 sizes
    disk_passes: int
    rounds: int  # of the RAM and kernel timings, after a warm-up round
    h2d_bytes: int


FULL = ProbeSizes(256 * 2**20, 16, (4096, 4096), 4, disk_passes=3, rounds=5,
                  h2d_bytes=256 * 2**20)
QUICK = ProbeSizes(32 * 2**20, 4, (1024, 1024), 1, disk_passes=2, rounds=1,
                   h2d_bytes=64 * 2**20)


def probe(threads: int, directory: Path | None = None, quick: bool = False,
          progress: Progress | None = None) -> HardwareProfile:
    """Measures this machine with `threads` CPU threads; the disk is the one holding `directory`
    (default: the cache directory). quick: smaller sizes, a few seconds, rougher figures."""
    _check_threads(threads)
    sizes = QUICK if quick else FULL
    say = progress or (lambda step: None)
    l3_bytes, _ = l3_cache_bytes()
    say("disk read speed")
    disk_gbps, direct = disk_read_gbps(directory or cache_dir(), sizes.scratch_bytes, sizes.disk_passes)
    previous_threads = kernels.threads()
    try:
        kernels.set_threads(threads)
        with OtherProcesses() as others:
            say("RAM and kernel speeds")
            ram_gbps, single, batch = cpu_speeds(threads, sizes, l3_bytes)
    finally:
        kernels.set_threads(previous_threads)
    if others.busy_cores > BUSY_CORES:
        warnings.warn(ProbeWarning(
            f"other processes kept {others.busy_cores:.1f} cores busy on average while the CPU was "
            f"measured, so its speeds are probably low; measure again on an idle machine "
            f"(tierflow probe --refresh)"), stacklevel=2)
    say("GPU")
    return HardwareProfile(threads=threads, cpu_name=cpu_name(), disk_read_gbps=disk_gbps,
                           disk_direct_io=direct, ram_read_gbps=ram_gbps, kernel_gbps=single,
                           kernel_batch_gbps=batch,
                           gpu=gpu_profile(sizes.h2d_bytes))


class ProbeWarning(UserWarning):
    """The machine was busy while it was measured: the figures are probably low."""


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


def load_profile(threads: int, refresh: bool = False, progress: Progress | None = None) -> HardwareProfile:
    """The cached profile for `threads`, measured (full) and cached first when there is none, when
    it is unreadable or of another version, or when refresh is set."""
    _check_threads(threads)
    path = profile_path(threads)
    if not refresh:
        cached = read_profile(path)
        if cached is not None and cached.threads == threads:
            return cached
    profile = probe(threads, progress=progress)
    save_profile(profile)
    return profile


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

def disk_read_gbps(directory: Path, size_bytes: int, passes: int = 3) -> tuple[float, bool]:
    """(GB/s, whether O_DIRECT bypassed the page cache): the best of `passes` sequential reads of
    a scratch file of size_bytes written in `directory`, then removed."""
    size_bytes = max(1, size_bytes // READ_REQUEST_BYTES) * READ_REQUEST_BYTES
    buffer = mmap.mmap(-1, READ_REQUEST_BYTES)  # page-aligned, as O_DIRECT requires
    path = None
    try:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=".tierflow-probe-", suffix=".tmp", dir=directory)
            path = Path(name)
            try:
                _write_scratch(fd, buffer, size_bytes)
            finally:
                os.close(fd)
        except OSError as error:
            raise TierflowError(f"cannot measure the disk: writing {size_bytes >> 20} MiB to "
                                f"{directory} failed: {error.strerror or error}") from error
        disk = DiskFile(path)
        try:
            best = min(_read_seconds(disk, size_bytes) for _ in range(passes))
        finally:
            disk.close()
        return size_bytes / best / 1e9, disk.direct
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
        buffer.close()


def _write_scratch(fd: int, buffer: mmap.mmap, size_bytes: int) -> None:
    """Random bytes (a compressing or deduplicating file system must not shrink them), synced."""
    rng = np.random.default_rng()
    for _ in range(size_bytes // READ_REQUEST_BYTES):
        buffer[:] = rng.bytes(READ_REQUEST_BYTES)
        if os.write(fd, buffer) != READ_REQUEST_BYTES:  # a regular file's writes stop short only when full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.fsync(fd)


def _read_seconds(disk: DiskFile, size_bytes: int) -> float:
    """One pass over the file in READ_REQUEST_BYTES requests, as the streamer reads layers."""
    buffer = aligned_buffer(READ_REQUEST_BYTES)
    try:
        if not disk.direct:
            os.posix_fadvise(disk.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the file is synced: its pages go
        started = time.perf_counter()
        for offset in range(0, size_bytes, READ_REQUEST_BYTES):
            disk.read_into(buffer, offset, READ_REQUEST_BYTES)
        return time.perf_counter() - started
    finally:
        buffer.close()


# --- kernels -------------------------------------------------------------------------------------

def cpu_speeds(threads: int, sizes: ProbeSizes,
               l3_bytes: int) -> tuple[float, dict[int, float], dict[int, float]]:
    """(RAM read GB/s, bits -> kernel GB/s at M = 1, bits -> packed bytes x 32 / time at M = 32),
    with the kernels' current thread count.

    Timed in rounds, as benchmarks/kernels.py times its sweeps: after a warm-up round each timing runs
    once a round, the order reversed every round, and each keeps its best. A quiet moment anywhere in the
    run then serves every figure; timing each figure's passes back to back lets another process
    that holds a core for a second halve one figure and not the next. Peak memory: the read
    buffer plus every bit width's ring (16 + 5 x 4 L3 sizes, 1.3 GiB with a 36 MiB L3), capped
    at a quarter of the available RAM.
    """
    budget = psutil.virtual_memory().available // 4
    rows, cols = sizes.kernel_shape
    ring_bytes = min(sizes.kernel_ring_l3 * l3_bytes, budget // 2 // len(KERNEL_BITS))
    rng = np.random.default_rng(0)
    rings = {bits: cold_ring(random_packed(rng, bits, rows, cols), ring_bytes) for bits in KERNEL_BITS}
    with ReadBandwidth(min(sizes.read_buffer_l3 * l3_bytes, budget // 2), threads) as bandwidth:
        tasks: dict[object, Callable[[], float]] = {"ram": lambda: bandwidth.gb_per_s(threads, 1)}
        for bits, ring in rings.items():
            for batch in (1, BATCH):
                tasks[bits, batch] = (lambda ring=ring, batch=batch:
                                      ring[0].nbytes * batch / seconds_per_call(ring, batch, 1) / 1e9)
        best = best_of_rounds(tasks, sizes.rounds)
    return (best["ram"], {bits: best[bits, 1] for bits in KERNEL_BITS},
            {bits: best[bits, BATCH] for bits in KERNEL_BITS})


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
