"""Decode tokens/s per weight type on one dense shape, against the memory-bandwidth bound, in one run.

    python -m benchmarks.weight_types [--threads 2] [--decode-tokens 32] [--repeats 3]
                                      [--types Q4_K,Q2_K,...] [--json]

For every weight type tierflow runs (the floats, ggml's quant types and tierflow's TQ2_1/TQ3_1),
a random llama of one dense shape (tests/support/make_model.py: hidden 1024, FFN 2816, 8 layers, 16
query and 4 KV heads, every matrix and the tied embedding in that type) is loaded and decoded
greedily, as benchmarks/decode.py times tierflow (`run_tierflow`, the median of the repeats).

Each decode step reads every weight once: the layers and the tied embedding as the output head,
so bytes per token is the pack's size (its extents: what the kernels read, e.g. 4-bit codebook
indices and float16 scales for IQ4_NL's 4.5-bit blocks, float32 for F16). Its bound is the read
bandwidth measured in the same run at the same thread count (offload/plan/measure.py's
ReadBandwidth, as benchmarks/kernels.py measures it) over those bytes; the table gives each type's
fraction of it, and the bytes the GGUF file's own blocks would be (what llama.cpp reads) beside
them. The attention over a short context, the norms and the Python around each step are in the
time too, as in any decode.

Models and packs live in a temporary folder (TIERFLOW_CACHE points there) and go with it.
Peak memory is about twice the largest pack (F32: ~0.6 GB).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.decode import build_prompt, positive_int, run_tierflow
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.cpu_kernels.quant_groups import GROUPED_TYPES
from tierflow.ggml_types import type_name
from tierflow.offload.gguf.reader import read_gguf
from tierflow.offload.plan.measure import ReadBandwidth, l3_cache_bytes

SHAPE = dict(num_layers=8, hidden_size=1024, ffn_size=2816, num_heads=16, num_kv_heads=4,
             context_length=512)
FLOAT_TYPES = ("F32", "F16", "BF16")
TIERFLOW_ONLY = {"TQ2_1", "TQ3_1"}  # make_model writes ggml's types only
PROMPT_TOKENS = 32


def weight_types() -> list[str]:
    """Every type the generator writes and tierflow computes with, floats first."""
    quantized = sorted(type_name(t) for t in GROUPED_TYPES if type_name(t) not in TIERFLOW_ONLY)
    return [*FLOAT_TYPES, *quantized]


def measure_type(directory: Path, weight_type: str, threads: int, decode_tokens: int, repeats: int) -> dict:
    """Decode tok/s (median of the repeats), and the bytes a token reads, for one weight type."""
    path = write_model(directory / f"{weight_type}.gguf",
                       ModelSpec(**SHAPE, weight_type=weight_type, embedding_type=weight_type))
    with read_gguf(path) as gguf:
        file_bytes = sum(info.nbytes for info in gguf.tensors.values())
        num_weights = sum(info.num_elements for info in gguf.tensors.values())
    with Engine.load(path, threads=threads, context_length=PROMPT_TOKENS + decode_tokens + 2) as engine:
        packed = engine.weights.packed
        packed_bytes = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
        prompt = build_prompt(engine, PROMPT_TOKENS)
        run_tierflow(engine, prompt, decode_tokens)  # warm-up
        samples = [run_tierflow(engine, prompt, decode_tokens) for _ in range(repeats)]
    path.unlink()
    return {"type": weight_type, "file_bits_per_weight": 8 * file_bytes / num_weights,
            "file_bytes_per_token": file_bytes, "packed_bytes_per_token": packed_bytes,
            "decode_tokens_per_s": statistics.median(s.decode_tokens_per_s for s in samples)}


def run(args: argparse.Namespace) -> dict:
    l3_bytes, _ = l3_cache_bytes()
    with tempfile.TemporaryDirectory(prefix="tierflow-weight-types-") as folder:
        os.environ["TIERFLOW_CACHE"] = str(Path(folder) / "cache")
        rows = []
        for weight_type in args.types:
            rows.append(measure_type(Path(folder), weight_type, args.threads, args.decode_tokens,
                                     args.repeats))
            print(f"measured {weight_type}", file=sys.stderr)
    with ReadBandwidth(16 * l3_bytes, args.threads) as bandwidth:
        read_gb_per_s = bandwidth.gb_per_s(args.threads, passes=5)
    read_bytes_per_s = read_gb_per_s * 1e9
    for row in rows:
        row["bound_tokens_per_s"] = read_bytes_per_s / row["packed_bytes_per_token"]
        row["of_bound"] = row["decode_tokens_per_s"] / row["bound_tokens_per_s"]
        row["of_file_bound"] = row["decode_tokens_per_s"] * row["file_bytes_per_token"] / read_bytes_per_s
    return {"shape": SHAPE, "threads": args.threads, "decode_tokens": args.decode_tokens,
            "repeats": args.repeats, "read_gb_per_s": read_gb_per_s, "rows": rows}


def print_table(report: dict) -> None:
    print(f"shape: {report['shape']}, tied embedding in the same type; {report['threads']} threads, "
          f"{report['decode_tokens']} decode steps, median of {report['repeats']}")
    print(f"read bandwidth: {report['read_gb_per_s']:.1f} GB/s")
    print(f"{'type':<8}{'file b/w':>9}{'file MB/tok':>12}{'read MB/tok':>12}{'decode tok/s':>13}"
          f"{'bound tok/s':>12}{'of bound':>9}{'of file bound':>14}")
    for row in report["rows"]:
        print(f"{row['type']:<8}{row['file_bits_per_weight']:>9.2f}{row['file_bytes_per_token'] / 1e6:>12.1f}"
              f"{row['packed_bytes_per_token'] / 1e6:>12.1f}{row['decode_tokens_per_s']:>13.1f}"
              f"{row['bound_tokens_per_s']:>12.1f}{row['of_bound']:>9.0%}{row['of_file_bound']:>14.0%}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--decode-tokens", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--types", type=lambda text: text.split(","), default=weight_types(),
                        help="comma-separated weight types (default: all)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
