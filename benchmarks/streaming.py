"""Layer streaming: decode speed under cpu_memory budgets against the disk-bound limit, in one run.

    python -m benchmarks.streaming [--size 2GB] [--type Q4_0] [--model PATH] [--threads 2]
                                   [--tokens 24] [--fractions 0.25,0.5] [--json]

A `llama` model of about --size, written once by the project's generator (tests/support/make_model.py)
into the cache directory, is loaded with --cpu-memory set to each fraction of its weight bytes (plus
the KV cache and activations that cpu_memory also holds), so that the rest streams from disk every
token. For each budget the script reports:
- decode tokens/s (greedy, after a short prompt);
- bytes read per token (the streamed layers) and the disk-bound limit: the disk's read speed,
  measured in the same run by reading the same pack's streamed extents back to back with the
  same reader, divided by the bytes per token; and the measured speed as a fraction of it;
- the fraction of I/O hidden: of the shorter of reading and computing (the most that can overlap),
  how much ran at the same time as the other: (reading - waiting) / min(reading, computing),
  where waiting is the decoder's time blocked on reads and computing is the rest of its time;
- the planner's predicted decode tokens/s for the same budget and its error: with this machine's
  cached profile (run `tierflow probe --refresh` on a quiet machine first), and with that
  profile's disk speed replaced by the one measured in this run (a shared or virtual disk's speed
  drifts from minute to minute; this separates the cost model's error from that drift).
Fully resident decode speed is printed first, as the compute-bound reference.
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from tests.support.budgets import ram_beside_weights
from tierflow import Engine
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.io.disk import DiskFile, aligned_buffer
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan.planner import make_plan
from tierflow.offload.plan.profile import cache_dir
from tierflow.runtime.loading.loader import model_profile
from tierflow.units import format_size, parse_size

CONTEXT = 256

PROMPT = "The history of the river valley is long, and the records that survive describe"


def model_file(size: int, weight_type: str) -> Path:
    from tests.support.make_model import spec_for_size, write_model

    path = cache_dir() / "bench" / f"llama-{format_size(size).replace(' ', '')}-{weight_type}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", file=sys.stderr)
        write_model(path.with_suffix(".tmp"), spec_for_size(size, weight_type=weight_type)).rename(path)
    return path


def disk_read_gbps(engine: Engine, repeats: int = 2) -> float:
    """The streamed extents of the engine's pack, read back to back: the disk-bound rate."""
    weights = engine.weights
    extents = [weights.packed.layers[i] for i in weights.streamed_layers]
    disk = DiskFile(weights.packed.path)
    buffer = aligned_buffer(max(extent.nbytes for extent in extents))
    best = 0.0
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            for extent in extents:
                disk.read_into(buffer, extent.offset, extent.nbytes)
            best = max(best, sum(e.nbytes for e in extents) / (time.perf_counter() - started) / 1e9)
    finally:
        disk.close()
    return best


def decode(engine: Engine, tokens: int) -> dict:
    streamer = engine.weights.streamer
    engine.generate(PROMPT, max_tokens=4, temperature=0)  # warm up: the ring and the caches
    before = (streamer.bytes_read, streamer.read_seconds, streamer.wait_seconds) if streamer else (0, 0, 0)
    started = time.perf_counter()
    result = engine.generate(PROMPT, max_tokens=tokens, temperature=0)
    wall = time.perf_counter() - started
    steps = result.stats.decode_steps + 1  # the prefill streams every layer once too
    row = {"decode_tok_s": result.stats.decode_tokens_per_s, "tokens": result.stats.generated_tokens}
    if streamer:
        read = streamer.bytes_read - before[0]
        reading, waiting = streamer.read_seconds - before[1], streamer.wait_seconds - before[2]
        computing = wall - waiting
        row |= {"bytes_per_token": read / steps, "read_s": reading, "wait_s": waiting, "compute_s": computing,
                "hidden": (reading - waiting) / min(reading, computing)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GB")
    parser.add_argument("--type", default="Q4_0", help="weight type of the generated model")
    parser.add_argument("--model", type=Path, help="a GGUF file instead of the generated model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--fractions", default="0.25,0.5", help="cpu_memory as fractions of the weights")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    path = args.model or model_file(parse_size(args.size), args.type)
    with open_model_file(path) as model:
        profile = model_profile(model, args.threads)
    rows = []
    with Engine.load(path, threads=args.threads, context_length=CONTEXT) as engine:
        weight_bytes = engine.weights.bytes_by_tier()["cpu"]
        rows.append({"budget": "all", "cpu_memory": weight_bytes} | decode(engine, args.tokens))
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget = int(weight_bytes * fraction) + ram_beside_weights(path, CONTEXT)
        with Engine.load(path, threads=args.threads, context_length=CONTEXT, cpu_memory=budget) as engine:
            row = {"budget": f"{fraction:.0%}", "cpu_memory": budget,
                   "streamed_layers": len(engine.weights.streamed_layers),
                   "layers": engine.config.num_layers, "depth": len(engine.weights.streamer.slots) - 1}
            row |= decode(engine, args.tokens)
            row["disk_gbps"] = disk_read_gbps(engine)
            row["limit_tok_s"] = row["disk_gbps"] * 1e9 / row["bytes_per_token"]
            row["of_limit"] = row["decode_tok_s"] / row["limit_tok_s"]
            with open_model_file(path) as model:
                same_disk = replace(profile, disk_read_gbps=row["disk_gbps"])
                for key, speeds in (("predicted_tok_s", profile), ("predicted_same_disk_tok_s", same_disk)):
                    plan = make_plan(model, pack_sizes(model), speeds, gpu_budget=0, cpu_budget=budget,
                                     context_length=CONTEXT, prompt_tokens=16)
                    row[key] = plan.predicted_decode_tps
            rows.append(row)

    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"model: {path.name} ({format_size(weight_bytes)} of packed weights), threads {args.threads}")
    print(f"{'budget':>7} {'cpu_memory':>11} {'streamed':>9} {'tok/s':>7} {'read/token':>11} "
          f"{'disk GB/s':>9} {'limit':>7} {'of limit':>8} {'I/O hidden':>10} {'predicted':>9} {'error':>6} "
          f"{'same disk':>9} {'error':>6}")
    for row in rows:
        if row["budget"] == "all":
            print(f"{'all':>7} {format_size(row['cpu_memory']):>11} {'0':>9} {row['decode_tok_s']:>7.2f}")
            continue
        print(f"{row['budget']:>7} {format_size(row['cpu_memory']):>11} "
              f"{row['streamed_layers']:>4}/{row['layers']:<4} {row['decode_tok_s']:>7.2f} "
              f"{format_size(row['bytes_per_token']):>11} {row['disk_gbps']:>9.2f} "
              f"{row['limit_tok_s']:>7.2f} {row['of_limit']:>8.0%} {row['hidden']:>10.0%} "
              f"{row['predicted_tok_s']:>9.2f} {row['predicted_tok_s'] / row['decode_tok_s'] - 1:>+6.0%} "
              f"{row['predicted_same_disk_tok_s']:>9.2f} "
              f"{row['predicted_same_disk_tok_s'] / row['decode_tok_s'] - 1:>+6.0%}")


if __name__ == "__main__":
    main()
