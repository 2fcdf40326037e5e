"""GPU kernel GB/s against the card's memory bandwidth and against the torch references, in one run.

    python -m benchmarks.gpu [--quick] [--json]     where CUDA and Triton are
    python -m benchmarks.gpu --smoke                anywhere: tiny shapes in Triton's interpreter

Each fused kernel of tierflow.gpu_kernels runs at Llama-style shapes (hidden 4096, feed-forward
11008, 32 query heads and 8 key/value heads of 128; --quick: a quarter of each) and is timed
with triton.testing.do_bench (median; the L2 cache is flushed before every call, so weights are
read from memory as in a real decode step). Its figure is the bytes the operation must move at
least (packed weights with scales and mins, activations in and out; for attention the cache it
reads and the slots it writes), GB = 1e9 bytes, per second, and that as a fraction of the card's
bandwidth, measured in the same run as a 1 GiB device-to-device copy (bytes read + written). The
torch reference of the same call (gpu_kernels/reference.py, the fallback path) is timed beside
it, on the same tensors: "vs torch" is its time over the kernel's.

Without CUDA the script says so and exits 0; --smoke then checks every kernel once against its
reference at a tiny shape in the interpreter, which proves the script and kernels run, not speed.
"""

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tierflow.cpu_kernels.packed import pack
from tierflow.cpu_kernels.quant_groups import QuantGroups
from tierflow.gpu_kernels import reference
from tierflow.gpu_kernels.attention import attention
from tierflow.gpu_kernels.launch import load_all_kernels
from tierflow.gpu_kernels.matmul import matmul, matmul_silu_mul
from tierflow.gpu_kernels.ops import add_rms_norm, silu_mul
from tierflow.gpu_kernels.packed import DeviceMatrix, to_device

GROUP = 32
DECODE_BITS = (2, 3, 4, 8)
COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class Shapes:
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int  # positions in the cache when the attention step runs
    rows: int  # tokens of the norm and activation cases
    prefill: int  # tokens of the prefill matmul


FULL = Shapes(hidden=4096, ffn=11008, heads=32, kv_heads=8, head_dim=128, context=4096, rows=2048,
              prefill=512)
QUICK = Shapes(hidden=1024, ffn=2752, heads=8, kv_heads=2, head_dim=128, context=1024, rows=512,
               prefill=512)
SMOKE = Shapes(hidden=64, ffn=64, heads=4, kv_heads=2, head_dim=16, context=32, rows=3, prefill=9)


@dataclass
class Case:
    kernel: str
    shape: str
    bytes_moved: int
    run: Callable[[], object]
    run_reference: Callable[[], object]


def random_matrix(rows: int, cols: int, bits: int, device: torch.device, seed: int = 0) -> DeviceMatrix:
    """Random codes with sane scales, packed and copied to the device; int8 without mins (Q8_0)."""
    rng = np.random.default_rng(seed)
    groups = (rows, cols // GROUP)
    scale = rng.uniform(0.005, 0.015, groups).astype(np.float32)
    if bits == 8:
        q, min_ = rng.integers(-128, 128, (rows, cols), dtype=np.int8), np.full(groups, -0.0, np.float32)
    else:
        q, min_ = rng.integers(0, 2**bits, (rows, cols), dtype=np.uint8), -scale * (2**bits - 1) / 2
    return to_device(pack(QuantGroups(q, scale, min_, GROUP, bits)), device)


def matmul_cases(s: Shapes, device: torch.device) -> list[Case]:
    cases = []
    for bits in DECODE_BITS:
        for label, rows, cols in [("q/k/v/o", s.hidden, s.hidden), ("down", s.hidden, s.ffn)]:
            w, x = random_matrix(rows, cols, bits, device), torch.randn(1, cols, device=device)
            moved = w.nbytes + 4 * (rows + cols)
            cases.append(Case(f"matmul {bits}-bit M=1", f"{label} {rows} x {cols}", moved,
                              lambda w=w, x=x: matmul(w, x),
                              lambda w=w, x=x: reference.matmul_reference(w, x)))
    w = random_matrix(2 * s.ffn, s.hidden, 4, device)
    x = torch.randn(1, s.hidden, device=device)
    cases.append(Case("matmul_silu_mul 4-bit M=1", f"gate+up {2 * s.ffn} x {s.hidden}",
                      w.nbytes + 4 * (s.hidden + s.ffn), lambda: matmul_silu_mul(w, x),
                      lambda: reference.matmul_silu_mul_reference(w, x)))
    w = random_matrix(s.hidden, s.hidden, 4, device)
    x = torch.randn(s.prefill, s.hidden, device=device)
    cases.append(Case(f"matmul 4-bit M={s.prefill}", f"q/k/v/o {s.hidden} x {s.hidden}",
                      w.nbytes + 8 * s.prefill * s.hidden, lambda: matmul(w, x),
                      lambda: reference.matmul_reference(w, x)))
    return cases


def layer_op_cases(s: Shapes, device: torch.device) -> list[Case]:
    residual, x = torch.randn(s.rows, s.hidden, device=device), torch.randn(s.rows, s.hidden, device=device)
    weight, gate_up = torch.randn(s.hidden, device=device), torch.randn(s.rows, 2 * s.ffn, device=device)
    kv, d = s.kv_heads, s.head_dim
    capacity = -(-(s.context + 1) // 16) * 16
    keys = torch.randn(kv, capacity // 16, d, 16, device=device)
    values = torch.randn(kv, capacity, d, device=device)
    qkv = torch.randn(1, (s.heads + 2 * kv) * d, device=device)
    cos, sin = torch.rand(1, d // 2, device=device), torch.rand(1, d // 2, device=device)
    start = s.context - 1
    return [
        Case("add_rms_norm", f"{s.rows} x {s.hidden}", 16 * s.rows * s.hidden,
             lambda: add_rms_norm(residual, x, weight, 1e-5),
             lambda: reference.add_rms_norm_reference(residual, x, weight, 1e-5)),
        Case("silu_mul", f"{s.rows} x 2 x {s.ffn}", 12 * s.rows * s.ffn, lambda: silu_mul(gate_up),
             lambda: reference.silu_mul_reference(gate_up)),
        Case("attention + rope, T=1", f"{s.heads}/{kv} heads of {d}, {s.context} positions",
             8 * kv * s.context * d + 4 * qkv.numel() + 4 * s.heads * d,
             lambda: attention(qkv, keys, values, cos, sin, s.heads, start, True),
             lambda: reference.attention_reference(qkv, keys, values, cos, sin, s.heads, start, True)),
    ]


def copy_gb_per_s(device: torch.device, bench) -> float:
    """Device-to-device copy bandwidth: bytes read plus bytes written per second."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = bench(lambda: dst.copy_(src)) / 1e3
    return 2 * COPY_BYTES / seconds / 1e9


def measure(cases: list[Case], bandwidth: float, bench) -> list[dict]:
    rows = []
    for case in cases:
        ms, reference_ms = bench(case.run), bench(case.run_reference)
        gb_per_s = case.bytes_moved / (ms / 1e3) / 1e9
        rows.append({"kernel": case.kernel, "shape": case.shape, "bytes": case.bytes_moved, "us": ms * 1e3,
                     "gb_per_s": gb_per_s, "fraction_of_bandwidth": gb_per_s / bandwidth,
                     "reference_us": reference_ms * 1e3, "vs_torch": reference_ms / ms})
    return rows


def print_table(report: dict) -> None:
    print(f"{report['device']}; torch {report['torch']}, triton {report['triton']}; median of do_bench, "
          f"L2 flushed before each call")
    print(f"device-to-device copy bandwidth: {report['copy_gb_per_s']:.0f} GB/s (read + write)")
    header = (f"{'kernel':<28}{'shape':<40}{'MiB':>8}{'us':>9}{'GB/s':>8}{'% of BW':>9}{'torch us':>10}"
              f"{'vs torch':>10}")
    print(header)
    print("-" * len(header))
    for r in report["kernels"]:
        print(f"{r['kernel']:<28}{r['shape']:<40}{r['bytes'] / 2**20:>8.1f}{r['us']:>9.1f}"
              f"{r['gb_per_s']:>8.0f}{r['fraction_of_bandwidth']:>9.0%}{r['reference_us']:>10.1f}"
              f"{r['vs_torch']:>9.1f}x")


def smoke() -> None:
    """Every kernel once at a tiny shape in Triton's interpreter, against its reference."""
    load_all_kernels(interpret=True)
    cpu = torch.device("cpu")
    for case in matmul_cases(SMOKE, cpu) + layer_op_cases(SMOKE, cpu):
        theirs = case.run_reference()  # first: the kernels update the residual and cache in place
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        torch.testing.assert_close(case.run(), theirs, rtol=1e-4, atol=1e-3)
        print(f"ok  {case.kernel:<28}{case.shape}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the shapes: a fast run")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    parser.add_argument("--smoke", action="store_true",
                        help="without CUDA: run each kernel once at a tiny shape in Triton's interpreter")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("triton") is None:
        print("Triton is not installed (pip install 'triton>=3.2'): nothing to benchmark")
        return
    if not torch.cuda.is_available():
        print("No CUDA GPU here: the GPU kernels are benchmarked only where one is "
              "(run with --smoke to check that they run, in Triton's interpreter).")
        if args.smoke:
            smoke()
        return
    load_all_kernels()
    import triton
    import triton.testing

    device = torch.device("cuda")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    shapes = QUICK if args.quick else FULL
    bandwidth = copy_gb_per_s(device, bench)
    cases = matmul_cases(shapes, device) + layer_op_cases(shapes, device)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "triton": triton.__version__, "quick": args.quick, "group": GROUP, "gb": 1e9,
              "copy_gb_per_s": bandwidth, "kernels": measure(cases, bandwidth, bench)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
