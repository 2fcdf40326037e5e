"""The hardware probe: plausible figures, no scratch file left behind (nor one a killed probe left), the
cached profile, and what it says before it starts. What it takes of RAM: tests/test_memory_budgets.py."""

import errno
import json
import os
import re
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.cli import run_tierflow
from tierflow.errors import TierflowError
from tierflow.offload.plan import probe as probing
from tierflow.offload.plan.profile import PROFILE_VERSION, GpuProfile, HardwareProfile, profile_path

BITS = (1, 2, 3, 4, 8)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[HardwareProfile, Path]:
    directory = tmp_path_factory.mktemp("probe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", probing.ProbeWarning)  # a busy machine is no failure here
        return probing.probe(threads=2, directory=directory, quick=True), directory


def fake_profile(threads: int = 2) -> HardwareProfile:
    return HardwareProfile(threads=threads, cpu_name="Test CPU", disk_read_gbps=1.5, disk_direct_io=True,
                           ram_read_gbps=12.0, kernel_gbps={b: 8.0 + b for b in BITS},
                           kernel_batch_gbps={b: 30.0 + b for b in BITS}, layer_overhead_s=4e-5)


def test_probe_figures_are_positive_and_plausible(quick):
    profile, _ = quick
    assert profile.threads == 2 and profile.cpu_name and profile.version == PROFILE_VERSION
    assert 0.01 < profile.disk_read_gbps < 1000
    assert 0.5 < profile.ram_read_gbps < 5000
    assert set(profile.kernel_gbps) == set(BITS) == set(profile.kernel_batch_gbps)
    for bits in BITS:
        assert 0.05 < profile.kernel_gbps[bits] < 5000
        assert 0.05 < profile.kernel_batch_gbps[bits] < 50000
    assert profile.overhead_by_shape == {}  # measured per model shape as models are planned


def test_probe_removes_its_scratch_file(quick):
    _, directory = quick
    assert list(directory.iterdir()) == []


def test_scratch_file_is_removed_when_reading_is_interrupted(tmp_path, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(probing, "_read_seconds", interrupted)
    with pytest.raises(KeyboardInterrupt):
        probing.disk_read_gbps(tmp_path, 4 * 2**20, passes=1)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_directory_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(TierflowError, match="cannot measure the disk"):
        probing.disk_read_gbps(tmp_path / "file" / "cache", 4 * 2**20)


def test_gpu_profile_is_none_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    assert probing.gpu_profile(2**20) is None


@pytest.mark.cuda
def test_gpu_profile_measures_host_to_device_copies():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    gpu = probing.gpu_profile(64 * 2**20)
    assert gpu.name and gpu.memory_bytes > 2**30 and 0.5 < gpu.h2d_gbps < 1000 and gpu.kernel_gbps == {}


def test_other_processes_busy_cores_are_counted():
    with probing.OtherProcesses() as idle:
        pass
    spin = "import time\nend = time.time() + 0.4\nwhile time.time() < end: pass"
    with probing.OtherProcesses() as busy:
        subprocess.run([sys.executable, "-c", spin], check=True)
    assert idle.busy_cores >= 0 and busy.busy_cores > 0.3


def test_profile_json_round_trips(quick):
    profile, _ = quick
    assert HardwareProfile.from_json(profile.to_json()) == profile
    with_gpu = replace(profile, gpu=GpuProfile("Test GPU", 8 * 2**30, 25.0, {4: 500.0}))
    assert HardwareProfile.from_json(with_gpu.to_json()) == with_gpu


def refusing_o_direct(monkeypatch, where: str) -> None:
    """Makes O_DIRECT fail with EINVAL at open or at the first read, as tmpfs did before Linux 6.6
    (from 6.6 on tmpfs accepts O_DIRECT, so the refusal is forced)."""
    real_open, real_preadv = os.open, os.preadv
    direct_fds = set()

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            if where == "open":
                raise OSError(errno.EINVAL, "Invalid argument")
            fd = real_open(path, flags, *args, **kwargs)
            direct_fds.add(fd)
            return fd
        return real_open(path, flags, *args, **kwargs)

    def fake_preadv(fd, buffers, offset, *args):
        if fd in direct_fds:
            direct_fds.discard(fd)  # closed after this refusal: its number may be reused
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)


SHM = Path("/dev/shm")
needs_shm = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")


@needs_shm
@pytest.mark.parametrize("where", ["open", "read"])
def test_disk_falls_back_to_buffered_reads_without_o_direct(monkeypatch, where):
    before = set(SHM.iterdir())
    refusing_o_direct(monkeypatch, where)
    gbps, direct = probing.disk_read_gbps(SHM, 8 * 2**20, passes=2)
    assert direct is False and gbps > 0
    assert set(SHM.iterdir()) <= before


@needs_shm
def test_disk_measures_tmpfs_either_way():
    """tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since: both must work."""
    before = set(SHM.iterdir())
    gbps, direct = probing.disk_read_gbps(SHM, 8 * 2**20, passes=1)
    assert gbps > 0 and isinstance(direct, bool)
    assert set(SHM.iterdir()) <= before


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TIERFLOW_CACHE", str(tmp_path))
    return tmp_path


def forbid_probing(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("probed although a valid profile was cached")

    monkeypatch.setattr(probing, "probe", fail)


def test_load_profile_reuses_the_cached_file(cache, monkeypatch):
    profile_path(2).write_text(fake_profile().to_json())
    forbid_probing(monkeypatch)
    assert probing.load_profile(2) == fake_profile()


@pytest.mark.parametrize("text", [
    "{ not json", "[]", "", json.dumps({"version": PROFILE_VERSION}),
    fake_profile().to_json().replace(f'"version": {PROFILE_VERSION}', f'"version": {PROFILE_VERSION + 1}'),
    fake_profile(threads=3).to_json(),
])
def test_load_profile_probes_again_when_the_cache_is_unusable(cache, monkeypatch, text):
    profile_path(2).write_text(text)
    probed = replace(fake_profile(), cpu_name="probed")
    monkeypatch.setattr(probing, "probe", lambda threads, **kwargs: probed)
    assert probing.load_profile(2) == probed
    assert HardwareProfile.from_json(profile_path(2).read_text()) == probed
    assert [p.name for p in cache.iterdir()] == [profile_path(2).name]  # no temporary file left


def test_refresh_probes_even_with_a_cached_file(cache, monkeypatch):
    profile_path(2).write_text(fake_profile().to_json())
    probed = replace(fake_profile(), cpu_name="probed")
    monkeypatch.setattr(probing, "probe", lambda threads, **kwargs: probed)
    assert probing.load_profile(2, refresh=True) == probed


def test_cli_probe_prints_the_cached_profile(cache):
    profile_path(2).write_text(fake_profile().to_json())
    env = {"TIERFLOW_CACHE": str(cache)}
    done = run_tierflow("probe", "--threads", "2", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert HardwareProfile.from_json(done.stdout) == fake_profile()
    table = run_tierflow("probe", "--threads", "2", env=env)
    assert table.returncode == 0, table.stderr
    assert "Test CPU" in table.stdout and str(profile_path(2)) in table.stdout.replace("\n", "")


def test_cli_probe_says_how_long_it_takes_and_within_how_much_ram_before_it_starts(cache, monkeypatch):
    started = []

    def fake_probe(threads, memory_bytes=None, **kwargs):
        started.append(memory_bytes)
        return fake_profile(threads)

    monkeypatch.setattr(probing, "probe", fake_probe)
    env = {"TIERFLOW_CACHE": str(cache)}
    done = run_tierflow("probe", "--threads", "2", "--cpu-memory", "48MiB", env=env)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    estimate = re.search(r"measuring this machine once for the planner \(tierflow probe\): about (\d+) s, "
                         r"within 48\.0 MiB of RAM", said)
    assert estimate and 1 <= int(estimate.group(1)) <= 60 and started == [48 << 20]
    again = run_tierflow("probe", "--threads", "2", env=env)
    assert "measuring" not in again.stderr and started == [48 << 20]  # cached: nothing to announce


def test_a_scratch_file_a_killed_probe_left_is_removed_by_the_next(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    left = tmp_path / f".tierflow-probe.{int(gone.stdout)}.tmp"
    left.write_bytes(bytes(1 << 20))
    probing.disk_read_gbps(tmp_path, 4 * 2**20, passes=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("chunk", [64 << 10, 1 << 20, 32 << 20])
def test_disk_reads_whole_requests_through_a_buffer_of_any_size(tmp_path, chunk):
    gbps, _ = probing.disk_read_gbps(tmp_path, 64 * 2**20, passes=1, chunk_bytes=chunk)
    assert gbps > 0 and list(tmp_path.iterdir()) == []
