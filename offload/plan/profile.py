"""The hardware profile: the measured speeds the planner predicts with, cached between runs.

`tierflow probe` measures it (offload/plan/probe.py); the planner reads it. It lives in the user's
cache directory beside the packed model files (`cache_dir()`), as JSON, one file per thread count.
"""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tierflow.errors import TierflowError

PROFILE_VERSION = 2


def cache_dir(*subfolders: str) -> Path:
    """$TIERFLOW_CACHE, else $XDG_CACHE_HOME/tierflow, else ~/.cache/tierflow, or a folder in it
    (created)."""
    root = os.environ.get("TIERFLOW_CACHE")
    if root:
        path = Path(root)
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierflow"
    path = path.joinpath(*subfolders)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise TierflowError(f"cannot create the cache folder {path} ({error.strerror or error}); "
                            f"set TIERFLOW_CACHE to a writable folder") from error
    return path


BATCH_WIDTH = 32  # the tokens of the products kernel_batch_gbps is measured with


@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_bytes: int
    h2d_gbps: float  # pinned host to device copies, GB/s (1e9 bytes)
    kernel_gbps: dict[int, float]  # bits -> the GPU matmul kernels' weight GB/s


@dataclass(frozen=True)
class HardwareProfile:
    """Speeds in GB/s (1e9 bytes per second) measured with `threads` CPU threads."""

    threads: int
    cpu_name: str
    disk_read_gbps: float  # sequential reads of 1 MiB+ from the cache directory's disk
    disk_direct_io: bool  # whether those reads bypassed the page cache (O_DIRECT)
    ram_read_gbps: float  # reading a buffer far larger than the last-level cache
    kernel_gbps: dict[int, float]  # bits (1, 2, 3, 4, 8) -> matrix-vector weight GB/s, uncached
    # bits -> weight bytes per second per token in BATCH_WIDTH-token products (prefill): the time of
    # such a product is BATCH_WIDTH * bytes / this
    kernel_batch_gbps: dict[int, float]
    # The planned model's fixed time per layer per decode step beyond its matmuls (norms, rotary,
    # attention over a short context, activations, Python): it depends on the model's shape, so the
    # loader sets it from overhead_by_shape (runtime/loading/overhead.py measures a shape once).
    layer_overhead_s: float = 0.0
    overhead_by_shape: dict[str, float] = field(default_factory=dict)  # shape_key(config) -> seconds
    gpu: GpuProfile | None = None
    # Measured within an allowance too small for the smallest meaningful sizes (probe.py): the RAM and
    # kernel speeds are partly the cache's. A load or probe allowed more measures again.
    rough: bool = False
    version: int = field(default=PROFILE_VERSION)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        data = json.loads(text)
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')}, expected {PROFILE_VERSION}")
        for key in ("kernel_gbps", "kernel_batch_gbps"):
            data[key] = {int(bits): gbps for bits, gbps in data[key].items()}
        if data.get("gpu") is not None:
            gpu = data["gpu"]
            gpu["kernel_gbps"] = {int(bits): gbps for bits, gbps in gpu["kernel_gbps"].items()}
            data["gpu"] = GpuProfile(**gpu)
        return cls(**data)


def profile_path(threads: int) -> Path:
    return cache_dir() / f"profile-{threads}-threads.json"
