"""Decode attention over a long KV cache, per cache type and ISA path, against the machine's read
bandwidth measured in the same run.

    python -m benchmarks.attention [--context 32768] [--threads 2] [--repeats 5] [--json]

One decode token of one layer with Llama-3.2-1B's heads (32 query heads, 8 key/value heads of 64)
attends over a cache of --context positions filled with random rows, through the C kernel
(cpu_kernels/csrc/attend.h) on each ISA this machine runs. Reported per type and ISA: the median
time, the cache bytes read per second, and that as a fraction of the RAM read bandwidth
(offload/plan/measure.ReadBandwidth, the same threads). A fraction near 1 is memory-bound; far
below it, compute-bound.
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch

from tierflow.cpu_kernels import _kernels
from tierflow.cpu_kernels.kv_layout import CACHE_DTYPES, cache_shapes
from tierflow.cpu_kernels.ops import attention
from tierflow.kv_types import KV_TYPES
from tierflow.offload.plan.measure import ReadBandwidth, l3_cache_bytes

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
FLOAT_DTYPES = {"f32": np.float32, "f16": np.float16}


def random_cache(name: str, context: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A layer's keys and values of `context` positions (and a free block), random items."""
    kv, dtype = KV_TYPES[name], CACHE_DTYPES[name]
    shapes = cache_shapes(kv, KV_HEADS, context + 16, HEAD_DIM)
    if dtype == torch.uint8:  # random codes; scales' bytes stay small halves
        return tuple(rng.integers(0, 60, shape, dtype=np.uint8) for shape in shapes)
    return tuple(rng.standard_normal(shape).astype(FLOAT_DTYPES[name]) for shape in shapes)


def seconds_per_token(name: str, context: int, repeats: int, rng: np.random.Generator) -> float:
    keys, values = random_cache(name, context, rng)
    cos, sin = np.ones((1, HEAD_DIM // 2), np.float32), np.zeros((1, HEAD_DIM // 2), np.float32)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        qkv = rng.standard_normal((1, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
        started = time.perf_counter()
        attention(qkv, keys, values, cos, sin, HEADS, context, False)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def run(args: argparse.Namespace) -> dict:
    _kernels.set_threads(args.threads)
    rng, chosen = np.random.default_rng(0), _kernels.isa()
    with ReadBandwidth(16 * l3_cache_bytes()[0], args.threads) as reader:
        bandwidth = reader.gb_per_s(args.threads, 3)
    rows = []
    try:
        for isa in _kernels.supported_isas():
            _kernels.set_isa(isa)
            for name, kv in KV_TYPES.items():
                seconds = seconds_per_token(name, args.context, args.repeats, rng)
                cache_bytes = 2 * KV_HEADS * kv.row_bytes(HEAD_DIM) * args.context
                gb_per_s = cache_bytes / seconds / 1e9
                rows.append({"isa": isa, "type": name, "ms": 1e3 * seconds, "gb_per_s": gb_per_s,
                             "fraction_of_bandwidth": gb_per_s / bandwidth})
    finally:
        _kernels.set_isa(chosen)
    return {"context": args.context, "threads": args.threads, "bandwidth_gb_per_s": bandwidth, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"context {report['context']}, {report['threads']} threads; read bandwidth "
          f"{report['bandwidth_gb_per_s']:.1f} GB/s")
    print(f"{'isa':<8}{'type':<6}{'ms/layer':>10}{'GB/s':>8}{'of bandwidth':>14}")
    for row in report["rows"]:
        print(f"{row['isa']:<8}{row['type']:<6}{row['ms']:>10.2f}{row['gb_per_s']:>8.1f}"
              f"{row['fraction_of_bandwidth']:>13.2f}x")


if __name__ == "__main__":
    main()
