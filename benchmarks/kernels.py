"""Matmul kernels per GGUF type and Llama shape: decode GB/s against the read bandwidth, prefill GOP/s
against the int8 kernel's peak, all measured in one run.

    python -m benchmarks.kernels [--threads 2] [--repeats 5] [--types Q4_K,Q6_K,...] [--shapes 1b,8b]
                                 [--quick] [--json]

Each type's matrices are real GGUF blocks: random ones from the model generator
(tests/support/random_weights.py, weights of std 0.02), split into codes and scales by
quant_groups.py and packed as the kernels read them (packed.py: the file's own bytes, or no more).
Shapes (N rows x K columns) are the Llama projections: 1b is Llama-3.2-1B's (2048 x 2048 for q/o,
8192 x 2048 for gate/up, 2048 x 8192 for down), 8b Llama-3-8B's (4096, 14336).

Decode, M = 1: `matmul(w, x, out)` on one token. The figure is the packed matrix's bytes (codes,
scales, two-level scale codes) per second, GB = 1e9 bytes, and its fraction of the read bandwidth
measured in the same run at the same thread count. Goal (issue 22): 90% at every shape.
Weights are never cache-resident: each case cycles through distinct copies of its matrix whose
total exceeds 4x the L3 cache, so every call reads its matrix from DRAM.

Prefill, M = 512 tokens (128 with --quick): GOP/s = 2 N K M / seconds, cycling through copies that
together exceed the L3 once (a layer's weights come from DRAM in a real prefill too), and its
fraction of the int8 peak. The peak is the int8 kernel's own, not the instruction's: its best GOP/s
at the same M on a 2048 x 2048 matrix that stays in the cache (4.25 MiB in Q8_0: no DRAM traffic;
smaller matrices lose a fifth to the per-call costs, preparing activations and writing outputs).
It is taken on Q8_0 (signed int8 codes) and on Q4_0 (unsigned nibble codes), and the faster is the
peak: signed codes cost the kernel a sign flip per token, so Q8_0 alone is beaten by the 4-bit types.

Read bandwidth: numpy reductions over a buffer 16x the L3 cache, one slice per thread
(offload/plan/measure.py's ReadBandwidth, as `tierflow probe` measures it).

No llama.cpp column: llama.cpp cannot time one matmul, and an end-to-end model per type and shape
(several GB at 8b) is not cheap; benchmarks/decode.py and benchmarks/weight_types.py compare end to
end.

The machine is shared and noisy: the types are measured one after another, each in rounds (one
warm-up, then every task once per round, the order reversed every round) that also sample the read
bandwidth and the int8 peak, and the best sample of each is reported; bandwidth and peak are the
best over every type's rounds. Peak memory is about 40 x L3 (one type's 6 cases of 4 x L3 of copies
and the 16 x L3 read buffer; 1.3 GiB here).
"""

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from benchmarks.decode import positive_int
from tests.support.random_weights import random_tensor_bytes
from tierflow.cpu_kernels import matmul as kernels
from tierflow.cpu_kernels.packed import PackedMatrix, pack
from tierflow.cpu_kernels.quant_groups import to_quant_groups
from tierflow.offload.plan.measure import (
    ReadBandwidth,
    best_of_rounds,
    cold_ring,
    l3_cache_bytes,
    seconds_per_call,
)

TYPES = ("Q4_0", "Q4_1", "Q5_K", "Q4_K", "Q6_K", "Q8_0", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "TQ2_0")
SHAPES = {"1b": (2048, 8192), "8b": (4096, 14336)}  # hidden, FFN
WEIGHT_STD = 0.02
PREFILL_TOKENS, QUICK_PREFILL_TOKENS = 512, 128
PEAK_SHAPE = (2048, 2048)
PEAK_TYPES = ("Q8_0", "Q4_0")  # the int8 kernel's signed and unsigned codes
PEAK_CALLS = 4  # per pass, on the same (cache-resident) matrix
GOAL_FRACTION = 0.9


def projections(shape_names: list[str]) -> Iterator[tuple[str, int, int]]:
    """(label, N rows, K columns) of each projection of each named shape."""
    for name in shape_names:
        h, f = SHAPES[name]
        yield from ((f"{name} {h} x {h} (q/o)", h, h), (f"{name} {f} x {h} (gate/up)", f, h),
                    (f"{name} {h} x {f} (down)", h, f))


def packed_matrix(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> PackedMatrix:
    """Random `qtype` blocks of a rows x cols matrix, as a GGUF file holds them, packed for the kernels."""
    ggml_type = GGMLQuantizationType[qtype]
    raw = random_tensor_bytes(rng, ggml_type, (rows, cols), WEIGHT_STD).reshape(-1)
    return pack(to_quant_groups(raw, ggml_type, (cols, rows)))


def gop_per_s(rows: int, cols: int, tokens: int, seconds: float) -> float:
    return 2 * rows * cols * tokens / seconds / 1e9


@dataclass(frozen=True)
class Settings:
    threads: int
    repeats: int
    decode_passes: int
    prefill_tokens: int
    l3_bytes: int

    @property
    def cold_bytes(self) -> int:
        return 4 * self.l3_bytes


@dataclass
class KernelCase:
    qtype: str
    label: str
    rows: int  # N
    cols: int  # K
    ring: list[PackedMatrix]  # distinct copies of one matrix, together more than 4x L3
    prefill_ring: list[PackedMatrix]  # its first copies, together more than L3

    def decode_gb_per_s(self, passes: int) -> float:
        return self.ring[0].nbytes / seconds_per_call(self.ring, 1, passes) / 1e9

    def prefill_gop_per_s(self, tokens: int) -> float:
        return gop_per_s(self.rows, self.cols, tokens, seconds_per_call(self.prefill_ring, tokens, 1))


def make_case(rng: np.random.Generator, qtype: str, label: str, rows: int, cols: int,
              settings: Settings) -> KernelCase:
    ring = cold_ring(packed_matrix(rng, qtype, rows, cols), settings.cold_bytes)
    return KernelCase(qtype, label, rows, cols, ring, ring[: settings.l3_bytes // ring[0].nbytes + 2])


def shared_tasks(rng: np.random.Generator, bandwidth: ReadBandwidth,
                 settings: Settings) -> dict[tuple, Callable[[], float]]:
    """The rates every type's rounds also sample: read GB/s at 1 and `threads` threads, and the int8
    kernel's GOP/s on each cache-resident peak matrix."""
    passes = settings.decode_passes
    tasks = {("bandwidth", n): (lambda n=n: bandwidth.gb_per_s(n, passes))
             for n in sorted({1, settings.threads})}
    for qtype in PEAK_TYPES:
        calls = [packed_matrix(rng, qtype, *PEAK_SHAPE)] * PEAK_CALLS
        tasks[("peak", qtype)] = lambda calls=calls: gop_per_s(
            *PEAK_SHAPE, settings.prefill_tokens, seconds_per_call(calls, settings.prefill_tokens, passes))
    return tasks


def measure_type(rng: np.random.Generator, qtype: str, shape_names: list[str], shared: dict,
                 settings: Settings) -> tuple[list[dict], dict[tuple, float]]:
    """Best decode GB/s and prefill GOP/s of each of the type's cases, and the best of the shared rates
    over its rounds; the cases' copies are freed on return."""
    cases = [make_case(rng, qtype, label, rows, cols, settings)
             for label, rows, cols in projections(shape_names)]
    tasks = dict(shared)
    for case in cases:
        tasks[("decode", case.label)] = lambda case=case: case.decode_gb_per_s(settings.decode_passes)
        tasks[("prefill", case.label)] = lambda case=case: case.prefill_gop_per_s(settings.prefill_tokens)
    best = best_of_rounds(tasks, settings.repeats)
    rows = [{"type": qtype, "shape": case.label, "rows": case.rows, "cols": case.cols,
             "matrix_bytes": case.ring[0].nbytes, "copies": len(case.ring),
             "prefill_copies": len(case.prefill_ring), "decode_gb_per_s": best[("decode", case.label)],
             "prefill_gop_per_s": best[("prefill", case.label)]} for case in cases]
    return rows, {key: best[key] for key in shared}


def summarize(rows: list[dict], shared_best: dict[tuple, float], settings: Settings) -> dict:
    """Each row's times and fractions of the run's best bandwidth and peak, the goal, and notes."""
    bandwidth = {n: rate for (kind, n), rate in shared_best.items() if kind == "bandwidth"}
    peaks = {qtype: rate for (kind, qtype), rate in shared_best.items() if kind == "peak"}
    peak = max(peaks.values())
    for row in rows:
        weights = row["rows"] * row["cols"]
        row["bits_per_weight"] = 8 * row["matrix_bytes"] / weights
        row["decode_ms"] = row["matrix_bytes"] / row["decode_gb_per_s"] / 1e6
        row["decode_of_bandwidth"] = row["decode_gb_per_s"] / bandwidth[settings.threads]
        row["prefill_ms"] = 2 * weights * settings.prefill_tokens / row["prefill_gop_per_s"] / 1e6
        row["prefill_of_peak"] = row["prefill_gop_per_s"] / peak
    worst = {qtype: min(row["decode_of_bandwidth"] for row in rows if row["type"] == qtype)
             for qtype in dict.fromkeys(row["type"] for row in rows)}
    return {"bandwidth_gb_per_s": bandwidth, "peak_gop_per_s": peaks, "int8_peak_gop_per_s": peak,
            "kernels": rows, "decode_worst_of_bandwidth": worst,
            "notes": notes(rows, bandwidth, settings.threads)}


def notes(rows: list[dict], bandwidth: dict[int, float], threads: int) -> list[str]:
    found = []
    if threads > 1 and bandwidth[threads] < 1.3 * bandwidth[1]:
        found.append(f"{threads}-thread read bandwidth is barely above 1 thread's: another process "
                     "probably held a core in every round; rerun")
    if any(row["prefill_of_peak"] > 1.05 for row in rows):
        found.append("a prefill beat the int8 peak by over 5%: the peak's rounds were all disturbed; rerun")
    return found


def print_table(report: dict) -> None:
    print(f"threads: {report['threads']}, ISA {report['isa']}; L3 {report['l3_bytes'] / 2**20:.1f} MiB "
          f"({report['l3_source']}); decode cycles over > {report['cold_bytes'] / 2**20:.0f} MiB of copies, "
          f"prefill over > {report['l3_bytes'] / 2**20:.0f} MiB; best of {report['repeats']} rounds")
    print("read bandwidth: " + ", ".join(f"{gb:.1f} GB/s with {n} thread{'s' * (n > 1)}"
                                         for n, gb in report["bandwidth_gb_per_s"].items()))
    tokens, (rows, cols) = report["prefill_tokens"], PEAK_SHAPE
    print(f"int8 peak, M={tokens} on a cache-resident {rows} x {cols}: "
          + ", ".join(f"{q} {gop:.0f}" for q, gop in report["peak_gop_per_s"].items())
          + f" GOP/s -> {report['int8_peak_gop_per_s']:.0f}")
    header = (f"{'type':<8}{'weights N x K':<30}{'MiB':>7}{'b/w':>6}{'M=1 ms':>9}{'GB/s':>7}{'% BW':>6}"
              f"{f'M={tokens} ms':>11}{'GOP/s':>7}{'% peak':>8}")
    print(header)
    print("-" * len(header))
    for row in report["kernels"]:
        print(f"{row['type']:<8}{row['shape']:<30}{row['matrix_bytes'] / 2**20:>7.1f}"
              f"{row['bits_per_weight']:>6.2f}"
              f"{row['decode_ms']:>9.3f}{row['decode_gb_per_s']:>7.1f}{row['decode_of_bandwidth']:>6.0%}"
              f"{row['prefill_ms']:>11.1f}{row['prefill_gop_per_s']:>7.0f}{row['prefill_of_peak']:>8.0%}")
    print("b/w: packed bits per weight; GB/s: packed bytes read per second; GOP/s: 2 N K M per second")
    worst = report["decode_worst_of_bandwidth"]
    met = [qtype for qtype, fraction in worst.items() if fraction >= GOAL_FRACTION]
    missed = [f"{qtype} {fraction:.0%}" for qtype, fraction in worst.items() if fraction < GOAL_FRACTION]
    print(f"decode goal >= {GOAL_FRACTION:.0%} of read bandwidth at every shape: "
          f"met by {', '.join(met) or 'none'}; not by {', '.join(missed) or 'none'} (worst shape)")
    for note in report["notes"]:
        print(f"note: {note}")


def type_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in GGMLQuantizationType.__members__]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown GGUF type {', '.join(unknown)}; known: {', '.join(TYPES)}")
    return names


def shape_list(text: str) -> list[str]:
    names = text.split(",")
    if any(name not in SHAPES for name in names):
        raise argparse.ArgumentTypeError(f"shapes are {', '.join(SHAPES)}, not {text}")
    return names


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed rounds after a warm-up")
    parser.add_argument("--types", type=type_list, default=list(TYPES), help="comma-separated GGUF types")
    parser.add_argument("--shapes", type=shape_list, default=None,
                        help="comma-separated, of 1b and 8b (default: both; 1b with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help=f"1b shapes, a {QUICK_PREFILL_TOKENS}-token prefill, fewer passes: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    l3_bytes, l3_source = l3_cache_bytes()
    prefill_tokens = QUICK_PREFILL_TOKENS if args.quick else PREFILL_TOKENS
    settings = Settings(args.threads, args.repeats, decode_passes=2 if args.quick else 3,
                        prefill_tokens=prefill_tokens, l3_bytes=l3_bytes)
    shape_names = args.shapes or (["1b"] if args.quick else list(SHAPES))
    kernels.set_threads(args.threads)
    rng = np.random.default_rng(0)
    rows, shared_best = [], {}
    with ReadBandwidth(16 * l3_bytes, args.threads) as bandwidth:
        shared = shared_tasks(rng, bandwidth, settings)
        for qtype in args.types:
            type_rows, type_best = measure_type(rng, qtype, shape_names, shared, settings)
            rows += type_rows
            shared_best = {key: max(rate, shared_best.get(key, 0.0)) for key, rate in type_best.items()}
            print(f"measured {qtype}", file=sys.stderr)
        read_buffer_bytes = bandwidth.buffer.nbytes
    return {"threads": args.threads, "isa": kernels.isa(), "quick": args.quick, "shapes": shape_names,
            "prefill_tokens": settings.prefill_tokens, "peak_shape": PEAK_SHAPE, "l3_bytes": l3_bytes,
            "l3_source": l3_source, "cold_bytes": settings.cold_bytes, "read_buffer_bytes": read_buffer_bytes,
            "repeats": args.repeats, "statistic": "best", "gb": 1e9,
            **summarize(rows, shared_best, settings)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
