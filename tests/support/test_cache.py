"""A cache folder of this run's own, with a fixed hardware profile: what tests and the fuzzer write
(packs, profiles) never reaches the user's cache, and no engine measures the machine first."""

import atexit
import os
import shutil
import tempfile

from tierflow.offload.plan.profile import HardwareProfile, profile_path

TEST_PROFILE = dict(cpu_name="Test CPU", disk_read_gbps=1.0, disk_direct_io=True, ram_read_gbps=20.0,
                    kernel_gbps={b: 10.0 for b in (1, 2, 3, 4, 8)},
                    kernel_batch_gbps={b: 30.0 for b in (1, 2, 3, 4, 8)}, layer_overhead_s=3e-5)


def use_test_cache() -> None:
    """Points TIERFLOW_CACHE at a new temporary folder (removed at exit; child processes inherit
    it) holding TEST_PROFILE for 1 and 2 threads."""
    os.environ["TIERFLOW_CACHE"] = tempfile.mkdtemp(prefix="tierflow-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TIERFLOW_CACHE"], ignore_errors=True)
    write_test_profiles()


def write_test_profiles() -> None:
    """TEST_PROFILE for 1 and 2 threads, in the cache folder TIERFLOW_CACHE names."""
    for threads in (1, 2):
        profile_path(threads).write_text(HardwareProfile(threads=threads, **TEST_PROFILE).to_json())
