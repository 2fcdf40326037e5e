"""Matrix-vector kernel GB/s per bit width, against the machine's read bandwidth and llama.cpp, in one run.

    python -m benchmarks.kernels [--threads 2] [--repeats 5] [--quick] [--json]

For each bit width (1-4: the LUT kernel; 8: the int8 kernel) and each Llama-2-7B projection shape
(N rows x K columns: 4096 x 4096 for q/k/v/o, 11008 x 4096 for gate/up, 4096 x 11008 for down),
`matmul(w, x, out)` is timed at M = 1 (decode) and M = 8 (a speculative verify batch) on random
codes packed with group 32. The figure is bytes of the packed matrix (data + scales + mins) per
second, GB = 1e9 bytes, and its fraction of the read bandwidth measured in the same run with the
same thread count. Goal: 80% or more at 4 and 2 bits.

Weights are never cache-resident: each case cycles through distinct copies of its matrix whose
total exceeds 4x the L3 cache, so every call reads its matrix from DRAM.

Read bandwidth: numpy reductions (`np.add.reduce` over uint64 words, `np.maximum.reduce` over
int32, the faster of the two) over a buffer 16x the L3 cache, one slice per thread (numpy releases
the GIL inside a reduction, so the slices are read in parallel).

ggml-style baseline: llama.cpp cannot run a single matmul, so it decodes with a random llama model
of the same shapes (hidden 4096, ffn 11008) in Q4_0 (beside 4 bits) and Q8_0 (beside 8 bits), with
a 259-token byte vocabulary so that the output head is negligible, and as many layers as it takes
to exceed 4x L3 too. Its GB/s is every weight byte of the file (all read once per token) times
tokens/s: an end-to-end figure, attention and norms included, so a little below its matmuls' own.

The machine is shared and noisy: after one warm-up round every measurement (bandwidth, each kernel
case, each llama.cpp model) runs once per round, the order reversed every round, and the best of
the rounds is reported. Peak memory is about 76 x L3 (15 cases of 4 x L3 of packed copies, and
the 16 x L3 read buffer; 2.7 GiB here) plus the two models.
"""

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import llama_cpp
import numpy as np

from tierflow.cpu_kernels import matmul as kernels
from tierflow.cpu_kernels.packed import PackedMatrix
from tierflow.offload.plan.measure import (
    ReadBandwidth,
    cold_ring,
    l3_cache_bytes,
    random_packed,
    seconds_per_call,
)

BITS = (1, 2, 3, 4, 8)
GROUP = 32
VERIFY_BATCH = 8  # M of a speculative verify step
GOAL_FRACTION, GOAL_BITS = 0.8, (2, 4)
BASELINE_TYPES = {4: "Q4_0", 8: "Q8_0"}  # ggml type run beside each bit width


@dataclass(frozen=True)
class Shapes:
    hidden: int
    ffn: int
    num_heads: int  # of the baseline model (Llama-2-7B: 32 heads of 128, no grouped KV)

    def matrices(self) -> list[tuple[str, int, int]]:
        """(label, N rows, K columns) of each projection shape."""
        h, f = self.hidden, self.ffn
        return [(f"{h} x {h} (q/k/v/o)", h, h), (f"{f} x {h} (gate/up)", f, h),
                (f"{h} x {f} (down)", h, f)]


FULL_SHAPES = Shapes(hidden=4096, ffn=11008, num_heads=32)
QUICK_SHAPES = Shapes(hidden=1024, ffn=2752, num_heads=8)


# --- what is timed ------------------------------------------------------------------------------

@dataclass
class KernelCase:
    bits: int
    label: str
    rows: int  # N
    cols: int  # K
    ring: list[PackedMatrix]  # distinct copies of one matrix, together more than 4x L3

    @property
    def matrix_bytes(self) -> int:
        return self.ring[0].nbytes

    def seconds_per_call(self, batch: int, passes: int) -> float:
        """Best over `passes` passes through the ring of the mean time of one call."""
        return seconds_per_call(self.ring, batch, passes)


def make_case(rng: np.random.Generator, bits: int, label: str, rows: int, cols: int,
              cold_bytes: int) -> KernelCase:
    first = random_packed(rng, bits, rows, cols, GROUP)
    return KernelCase(bits, label, rows, cols, cold_ring(first, cold_bytes))


@dataclass
class GgmlBaseline:
    bits: int
    qtype: str
    num_layers: int
    weight_bytes: int  # every tensor of the file: all are read once per decoded token
    num_weights: int  # their elements
    llama: llama_cpp.Llama

    def tokens_per_s(self, steps: int) -> float:
        self.llama.reset()  # the KV cache restarts at 0, so attention stays negligible
        started = time.perf_counter()
        for step in range(steps):
            self.llama.eval([FIRST_BYTE_TOKEN + step % 256])
        return steps / (time.perf_counter() - started)


# --- the baseline model: make_model's layout with a byte vocabulary ------------------------------

FIRST_BYTE_TOKEN = 3  # <unk>, <s>, </s>, then <0x00> .. <0xFF>


def _model_writers():
    """make_model's building blocks (tests/support), imported when a baseline model is written."""
    from tests.support import gguf_bytes, gguf_writing, model_spec, random_weights

    return gguf_bytes, gguf_writing, model_spec, random_weights


def _byte_vocabulary_kvs(gguf_bytes) -> tuple[list[bytes], int]:
    """A 259-token SentencePiece vocabulary, instead of make_model's 49152-token one (whose tied
    output head would read twice the bytes of a whole 4096-wide layer per token)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    token_types = np.array([2, 3, 3] + [6] * 256, np.int32)  # unknown, control, byte
    kvs = [("tokenizer.ggml.model", "llama"), ("tokenizer.ggml.tokens", tokens),
           ("tokenizer.ggml.scores", np.zeros(len(tokens), np.float32)),
           ("tokenizer.ggml.token_type", token_types)]
    kvs += [(key, gguf_bytes.Typed(gguf_bytes.UINT32, token_id)) for key, token_id in (
        ("tokenizer.ggml.unknown_token_id", 0), ("tokenizer.ggml.bos_token_id", 1),
        ("tokenizer.ggml.eos_token_id", 2))]
    return [gguf_bytes.pack_kv(key, value) for key, value in kvs], len(tokens)


def write_baseline_model(path: Path, shapes: Shapes, qtype: str, cold_bytes: int) -> tuple[int, int, int]:
    """A random llama model of `shapes` in `qtype` whose layers together exceed `cold_bytes`;
    returns (num_layers, bytes of all its tensors, their elements)."""
    gguf_bytes, gguf_writing, model_spec, random_weights = _model_writers()
    vocab_kvs, vocab_size = _byte_vocabulary_kvs(gguf_bytes)
    spec = model_spec.ModelSpec(num_layers=1, hidden_size=shapes.hidden, ffn_size=shapes.ffn,
                                num_heads=shapes.num_heads, num_kv_heads=shapes.num_heads,
                                weight_type=qtype, embedding_type=qtype)
    layer_bytes = sum(t.entry.nbytes for t in model_spec.tensor_plan(spec, vocab_size)
                      if t.name.startswith("blk."))
    spec = replace(spec, num_layers=max(1, math.ceil(cold_bytes / layer_bytes)))
    plan = model_spec.tensor_plan(spec, vocab_size)
    rng = np.random.default_rng(spec.seed)
    kvs = [gguf_bytes.pack_kv(k, v) for k, v in model_spec.architecture_metadata(spec, vocab_size)]
    data = (random_weights.random_tensor_bytes(rng, t.qtype, t.shape, t.std, t.mean, t.values)
            for t in plan)
    gguf_writing.write_gguf(path, kvs + vocab_kvs, [t.entry for t in plan], data)
    return spec.num_layers, sum(t.entry.nbytes for t in plan), sum(math.prod(t.shape) for t in plan)


def load_baseline(directory: Path, bits: int, shapes: Shapes, cold_bytes: int,
                  threads: int) -> GgmlBaseline:
    qtype = BASELINE_TYPES[bits]
    path = directory / f"{qtype}.gguf"
    num_layers, weight_bytes, num_weights = write_baseline_model(path, shapes, qtype, cold_bytes)
    # No mmap: weights in anonymous memory, as tierflow's packed arrays are.
    llama = llama_cpp.Llama(str(path), n_ctx=256, n_batch=64, n_threads=threads,
                            n_threads_batch=threads, use_mmap=False, verbose=False)
    return GgmlBaseline(bits, qtype, num_layers, weight_bytes, num_weights, llama)


# --- running and reporting -----------------------------------------------------------------------

def measure(tasks: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """One warm-up round, then `repeats` rounds running every task once, order reversed each round."""
    for task in tasks.values():
        task()
    samples: dict[str, list[float]] = {name: [] for name in tasks}
    order = list(tasks)
    for _ in range(repeats):
        for name in order:
            time.sleep(0.02)  # let the last task's spinning threads (ours or ggml's) go to sleep
            samples[name].append(tasks[name]())
        order.reverse()
    return samples


def build_tasks(bandwidth: ReadBandwidth, cases: list[KernelCase], baselines: list[GgmlBaseline],
                threads: int, passes: int, steps: int) -> dict[str, Callable[[], float]]:
    """Name -> a callable returning one sample: GB/s, seconds per call, or tokens/s."""
    tasks = {f"bandwidth/{n}": (lambda n=n: bandwidth.gb_per_s(n, passes)) for n in sorted({1, threads})}
    for case in cases:
        for batch in (1, VERIFY_BATCH):
            tasks[f"kernel/{case.bits}/{case.label}/M{batch}"] = (
                lambda case=case, batch=batch: case.seconds_per_call(batch, passes))
    for baseline in baselines:
        tasks[f"llama.cpp/{baseline.qtype}"] = lambda baseline=baseline: baseline.tokens_per_s(steps)
    return tasks


def summarize(samples: dict[str, list[float]], cases: list[KernelCase], baselines: list[GgmlBaseline],
              threads: int) -> dict:
    bandwidth = max(samples[f"bandwidth/{threads}"])
    baseline_rows = {}
    for b in baselines:
        tokens_per_s = max(samples[f"llama.cpp/{b.qtype}"])
        gb_per_s = b.weight_bytes * tokens_per_s / 1e9
        baseline_rows[b.bits] = {
            "system": f"llama.cpp {b.qtype}", "layers": b.num_layers, "weight_bytes": b.weight_bytes,
            "ms_per_token": 1e3 / tokens_per_s, "gb_per_s": gb_per_s,
            "weights_per_s": b.num_weights * tokens_per_s,
            "fraction_of_bandwidth": gb_per_s / bandwidth,
            "tokens_per_s_samples": samples[f"llama.cpp/{b.qtype}"]}
    rows = []
    for case in cases:
        key = f"kernel/{case.bits}/{case.label}"
        seconds, verify_seconds = min(samples[key + "/M1"]), min(samples[f"{key}/M{VERIFY_BATCH}"])
        gb_per_s = case.matrix_bytes / seconds / 1e9
        baseline = baseline_rows.get(case.bits)
        rows.append({
            "bits": case.bits, "shape": case.label, "rows": case.rows, "cols": case.cols,
            "matrix_bytes": case.matrix_bytes, "copies": len(case.ring), "ms_per_call": seconds * 1e3,
            "gb_per_s": gb_per_s, "weights_per_s": case.rows * case.cols / seconds,
            "fraction_of_bandwidth": gb_per_s / bandwidth,
            f"m{VERIFY_BATCH}_over_m1": verify_seconds / seconds,
            "vs_baseline": gb_per_s / baseline["gb_per_s"] if baseline else None,
            "seconds_samples": samples[key + "/M1"],
            f"m{VERIFY_BATCH}_seconds_samples": samples[f"{key}/M{VERIFY_BATCH}"]})
    goal = {bits: min(r["fraction_of_bandwidth"] for r in rows if r["bits"] == bits)
            for bits in GOAL_BITS}
    notes = []
    if threads > 1 and bandwidth < 1.3 * max(samples["bandwidth/1"]):
        notes.append(f"{threads}-thread read bandwidth is barely above 1 thread's: another process "
                     "probably held a core in every round; rerun")
    return {"bandwidth_gb_per_s": {n: max(samples[f"bandwidth/{n}"]) for n in sorted({1, threads})},
            "bandwidth_samples": {n: samples[f"bandwidth/{n}"] for n in sorted({1, threads})},
            "kernels": rows, "baselines": list(baseline_rows.values()),
            "goal_min_fraction": goal, "notes": notes}


def print_table(report: dict) -> None:
    bw = report["bandwidth_gb_per_s"]
    print(f"threads: {report['threads']}, ISA {report['isa']}; L3 {report['l3_bytes'] / 2**20:.1f} MiB "
          f"({report['l3_source']}); weights cycled over > {report['cold_bytes'] / 2**20:.0f} MiB; "
          f"best of {report['repeats']} rounds")
    print("read bandwidth: " + ", ".join(f"{gb:.1f} GB/s with {n} thread{'s' * (n > 1)}"
                                         for n, gb in bw.items()))
    header = (f"{'bits':>4}  {'weights N x K':<32}{'MiB':>8}{'ms/call':>9}{'GB/s':>7}{'Gw/s':>7}"
              f"{'% of BW':>9}{f'M={VERIFY_BATCH}/M=1':>9}{'vs ggml':>9}")
    print(header)
    print("-" * len(header))
    baselines = {row["system"].split()[1]: row for row in report["baselines"]}
    for row in report["kernels"]:
        vs = f"{row['vs_baseline']:.2f}x" if row["vs_baseline"] else ""
        print(f"{row['bits']:>4}  {row['shape']:<32}{row['matrix_bytes'] / 2**20:>8.1f}"
              f"{row['ms_per_call']:>9.3f}{row['gb_per_s']:>7.1f}{row['weights_per_s'] / 1e9:>7.1f}"
              f"{row['fraction_of_bandwidth']:>9.0%}"
              f"{row[f'm{VERIFY_BATCH}_over_m1']:>8.2f}x{vs:>9}")
        qtype = BASELINE_TYPES.get(row["bits"])
        if qtype in baselines and row is _last_of_bits(report["kernels"], row["bits"]):
            b = baselines[qtype]
            label = f"{qtype} llama.cpp, {b['layers']} layer{'s' * (b['layers'] > 1)}*"
            print(f"{'':>4}  {label:<32}{b['weight_bytes'] / 2**20:>8.1f}{b['ms_per_token']:>9.3f}"
                  f"{b['gb_per_s']:>7.1f}{b['weights_per_s'] / 1e9:>7.1f}{b['fraction_of_bandwidth']:>9.0%}")
    print("* ggml-style baseline, end-to-end decode: all weight bytes x tokens/s; ms is per token")
    print("Gw/s: billions of weights per second; vs ggml: GB/s over the baseline's GB/s")
    goals = ", ".join(f"{bits}-bit worst shape {f:.0%} ({'met' if f >= GOAL_FRACTION else 'not met'})"
                      for bits, f in report["goal_min_fraction"].items())
    print(f"goal >= {GOAL_FRACTION:.0%} of read bandwidth: {goals}")
    for note in report["notes"]:
        print(f"note: {note}")


def _last_of_bits(rows: list[dict], bits: int) -> dict:
    return [row for row in rows if row["bits"] == bits][-1]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed rounds after a warm-up")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_SHAPES.hidden}/{QUICK_SHAPES.ffn} shapes, fewer passes: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    l3_bytes, l3_source = l3_cache_bytes()
    cold_bytes = 4 * l3_bytes
    kernels.set_threads(args.threads)
    rng = np.random.default_rng(0)
    cases = [make_case(rng, bits, label, rows, cols, cold_bytes)
             for bits in BITS for label, rows, cols in shapes.matrices()]
    bandwidth = ReadBandwidth(16 * l3_bytes, args.threads)
    with tempfile.TemporaryDirectory(prefix="tierflow-kernels-") as directory:
        baselines = [load_baseline(Path(directory), bits, shapes, cold_bytes, args.threads)
                     for bits in BASELINE_TYPES]
    tasks = build_tasks(bandwidth, cases, baselines, args.threads, passes=2 if args.quick else 3,
                        steps=8 if args.quick else 16)
    samples = measure(tasks, args.repeats)
    report = {"threads": args.threads, "isa": kernels.isa(), "quick": args.quick, "group": GROUP,
              "l3_bytes": l3_bytes, "l3_source": l3_source, "cold_bytes": cold_bytes,
              "read_buffer_bytes": bandwidth.buffer.nbytes, "repeats": args.repeats, "statistic": "best",
              "gb": 1e9, **summarize(samples, cases, baselines, args.threads)}
    for baseline in baselines:
        baseline.llama.close()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
