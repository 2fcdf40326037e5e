"""MoE expert cache, part (b): decode tokens/s with experts streamed from disk, in one run.

    python -m benchmarks.moe_decode [--size 2GB] [--weight-type Q4_0] [--fraction 0.333]
                                    [--prompt-tokens 64] [--decode-tokens 48] [--repeats 3]
                                    [--threads N] [--policy score|lru|lfu] [--prefetch gated|all|none]
                                    [--json]

The model is a random-weight Mixtral-style `llama` of about --size with 8 experts per layer, top-2
routing, written once by the project's generator (tests/support/make_model.py) into the cache directory.
Three systems decode the same prompt ids greedily, loaded side by side:

- tierflow, experts streamed: cpu_memory = everything but the experts (globals, attention,
  routers, the KV cache and activations) + --fraction of the expert bytes; the experts are read
  from the pack with O_DIRECT (the page cache never holds them) into the expert cache
  (offload/experts/store.py);
- tierflow, fully resident (no budget);
- llama.cpp on the same file, fully resident (its own mmap), the same thread count.

Each is warmed up once, then every repeat runs all three in a rotating order, and the medians are
reported (decode: single-token passes plus the argmax, as benchmarks/decode.py times them). The
goal is the streamed run at half the resident speed or better. Beside the speeds: the expert
cache's hit rate, bytes read from disk per decode step, the early router's prediction precision,
and two disk bounds at this disk's measured read speed: the bytes the run read per step, and the
least any cache of this size could read, a clairvoyant one (Belady's optimum on the routing the
run recorded): what no cache policy can beat on this model, disk and budget.

--prefetch says which of the early router's predictions are read ahead: those the prefetch gate
admits (offload/experts/prefetch_gate.py: a confidence threshold kept where decode tokens come
fastest; the default), every one, or none; run it with each to see the bytes read per step and
the speed with and without the gate.
"""

import argparse
import json
import queue
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llama_cpp
import numpy as np
import psutil
import torch

from benchmarks.decode import Sample, build_prompt, run_llama_cpp, run_tierflow
from benchmarks.moe import belady_hit_rate
from tests.support.budgets import ram_beside_weights
from tests.support.make_model import spec_for_size, write_model
from tierflow import Engine
from tierflow.offload.experts.policy import make_policy  # noqa: E402
from tierflow.offload.experts.prefetch_gate import PrefetchGate  # noqa: E402
from tierflow.offload.experts.store import READERS  # noqa: E402
from tierflow.offload.io.disk import DiskFile, aligned_buffer  # noqa: E402
from tierflow.offload.plan.profile import cache_dir  # noqa: E402
from tierflow.units import format_size, parse_size  # noqa: E402

CONTEXT = 2048  # tokens each engine holds: --prompt-tokens plus --decode-tokens must fit
PREFETCH = {"gated": "prefetch gated by measured speed", "all": "every prediction prefetched",
            "none": "demand reads only"}

EXPERTS, USED = 8, 2


def model_file(size: int, weight_type: str) -> Path:
    name = f"moe-{EXPERTS}x{USED}-{format_size(size).replace(' ', '')}-{weight_type}.gguf"
    path = cache_dir() / "bench" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", file=sys.stderr)
        spec = spec_for_size(size, weight_type=weight_type, num_experts=EXPERTS, experts_used=USED)
        write_model(path.with_suffix(".tmp"), spec).rename(path)
    return path


def expert_budget(path: Path, threads: int, fraction: float) -> tuple[int, int]:
    """(cpu_memory that leaves `fraction` of the expert bytes to the cache beside the rest of the
    weights, the KV cache and the activations; all expert bytes)."""
    with Engine.load(path, threads=threads, context_length=CONTEXT) as engine:  # builds the pack once
        packed = engine.weights.packed
    base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
    experts = sum(x.nbytes for layer in packed.experts for x in layer)
    return base + ram_beside_weights(path, CONTEXT) + int(fraction * experts), experts


def run_streamed(engine: Engine, prompt_ids: list[int], decode_steps: int
                 ) -> tuple[Sample, float, np.ndarray]:
    """run_tierflow's sample, the expert bytes read from disk per decode step (counted from the
    first token on: the prefill reads most of every layer's experts), and the decode steps'
    routing [steps, layers, top_k]."""
    stats = engine.expert_stats
    engine.logits([1 if prompt_ids[0] == 0 else 0])  # nothing of the prompt stays cached
    with engine.record_routing() as recorder:
        stream = engine.stream(prompt_ids, max_tokens=decode_steps + 1, temperature=0)
        after_prefill = None
        for _ in stream:
            if after_prefill is None:
                after_prefill = stats.fetched_bytes, len(stream.tokens)
    result, timed = stream.result, stream.result.stats
    steps = timed.generated_tokens if result.finish_reason == "stop" else timed.generated_tokens - 1
    sample = Sample(timed.prefill_tokens_per_s, steps / timed.decode_seconds, steps, list(result.tokens))
    counted = len(result.tokens) - after_prefill[1]
    per_step = (stats.fetched_bytes - after_prefill[0]) / counted if counted else 0.0
    return sample, per_step, recorder.trace()[len(prompt_ids):]


def disk_read_gbps(engine: Engine, count: int = 96) -> float:
    """Expert extents of the pack read as the expert store reads them (O_DIRECT, READERS reads in
    flight, in a shuffled order): what streaming can reach on this disk now."""
    packed = engine.weights.packed
    extents = [x for layer in packed.experts for x in layer]
    extents = [extents[i] for i in np.random.default_rng(0).permutation(len(extents))[:count]]
    disk = DiskFile(packed.path)
    buffers = queue.SimpleQueue()
    for _ in range(READERS):
        buffers.put(aligned_buffer(max(x.nbytes for x in extents)))

    def read(extent) -> None:
        buffer = buffers.get()
        disk.read_into(buffer, extent.offset, extent.nbytes)
        buffers.put(buffer)

    try:
        with ThreadPoolExecutor(READERS) as readers:
            started = time.perf_counter()
            list(readers.map(read, extents))
            return sum(x.nbytes for x in extents) / (time.perf_counter() - started) / 1e9
    finally:
        disk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GB")
    parser.add_argument("--weight-type", default="Q4_0")
    parser.add_argument("--fraction", type=float, default=1 / 3, help="of the expert bytes, for the cache")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=psutil.cpu_count(logical=False) or 1)
    parser.add_argument("--policy", default="score", choices=["score", "lru", "lfu"])
    parser.add_argument("--prefetch", default="gated", choices=list(PREFETCH),
                        help="gated: the predictions the prefetch gate admits; all: every prediction; "
                             "none: demand reads only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = model_file(parse_size(args.size), args.weight_type)
    cpu_memory, expert_bytes = expert_budget(path, args.threads, args.fraction)
    streamed = Engine.load(path, threads=args.threads, context_length=CONTEXT, cpu_memory=cpu_memory)
    streamed.weights.experts.cache.policy = make_policy(args.policy)  # before any expert is cached
    streamed.weights.experts.prefetch = args.prefetch != "none"
    streamed.weights.experts.gate = PrefetchGate(fixed=args.prefetch == "all")
    resident = Engine.load(path, threads=args.threads, context_length=CONTEXT)
    llama = llama_cpp.Llama(str(path), n_ctx=args.prompt_tokens + args.decode_tokens + 8, n_batch=512,
                            n_threads=args.threads, verbose=False)
    prompt = build_prompt(resident, args.prompt_tokens)
    decode_bytes: list[float] = []
    routing: list[np.ndarray] = []

    def streamed_run() -> Sample:
        sample, per_step, trace = run_streamed(streamed, prompt, args.decode_tokens)
        decode_bytes.append(per_step)
        routing.append(trace)
        return sample

    runners = {"tierflow streamed": streamed_run,
               "tierflow resident": lambda: run_tierflow(resident, prompt, args.decode_tokens),
               "llama.cpp resident": lambda: run_llama_cpp(llama, prompt, args.decode_tokens)}
    for run in runners.values():  # warm-up
        run()
    streamed.weights.experts.cache.reset_stats()
    samples = {name: [] for name in runners}
    order = list(runners)
    for _ in range(args.repeats):
        for name in order:
            samples[name].append(runners[name]())
        order = order[1:] + order[:1]
    stats = streamed.expert_stats
    gbps = disk_read_gbps(streamed)
    decode = {name: statistics.median(s.decode_tokens_per_s for s in runs) for name, runs in samples.items()}
    per_token = statistics.median(decode_bytes[1:])  # after the warm-up
    # The least a cache of this size must read per step: the uses a clairvoyant cache misses.
    config = streamed.config
    uses_per_step = expert_bytes * config.experts_used / config.num_experts  # k of every layer's E experts
    optimum = statistics.median(belady_hit_rate(trace, args.fraction) for trace in routing[1:])
    least_per_token = (1 - optimum) * uses_per_step
    report = {
        "model": path.name, "file_bytes": path.stat().st_size, "expert_bytes": expert_bytes,
        "cpu_memory": cpu_memory, "expert_cache_bytes": streamed.weights.experts.nbytes,
        "policy": args.policy, "prefetch": args.prefetch, "threads": args.threads,
        "prefetch_threshold": streamed.weights.experts.gate.best,
        "prompt_tokens": len(prompt),
        "decode_tokens": args.decode_tokens, "decode_tokens_per_s": decode,
        "streamed_vs_resident": decode["tierflow streamed"] / decode["tierflow resident"],
        "resident_vs_llama_cpp": decode["tierflow resident"] / decode["llama.cpp resident"],
        "hit_rate": stats.hit_rate,
        "layer_hit_rates": {i: layer.hit_rate for i, layer in sorted(stats.layers.items())},
        "decode_bytes_read_per_token": per_token, "prediction_precision": stats.prediction_precision,
        "disk_read_gbps": gbps, "disk_bound_tokens_per_s": gbps * 1e9 / per_token if per_token else None,
        "clairvoyant_hit_rate": optimum, "clairvoyant_bytes_read_per_token": least_per_token,
        "clairvoyant_bound_tokens_per_s": gbps * 1e9 / least_per_token if least_per_token else None,
        "tokens_agree": samples["tierflow streamed"][0].tokens == samples["tierflow resident"][0].tokens,
    }
    for engine in (streamed, resident):
        engine.close()
    llama.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['model']}: {format_size(report['file_bytes'])}, experts {format_size(expert_bytes)}; "
          f"cpu_memory {format_size(cpu_memory)} (expert cache {format_size(report['expert_cache_bytes'])}, "
          f"{args.fraction:.0%} of the experts, policy {args.policy}, "
          f"{PREFETCH[args.prefetch]}); {args.threads} threads, "
          f"prompt {len(prompt)}, {args.decode_tokens} decode steps, median of {args.repeats}")
    for name, rate in decode.items():
        print(f"  {name:<20} {rate:7.2f} tok/s")
    print(f"streamed / resident: {report['streamed_vs_resident']:.2f}x (goal >= 0.5); "
          f"resident / llama.cpp: {report['resident_vs_llama_cpp']:.2f}x")
    print(f"expert cache: hit rate {stats.hit_rate:.1%}, {format_size(int(per_token))} read per decode step, "
          f"early-router predictions {stats.prediction_precision:.1%} right (fetched ahead from confidence "
          f"{report['prefetch_threshold']:.2f}); disk {gbps:.2f} GB/s, so "
          f"reads alone allow {report['disk_bound_tokens_per_s'] or 0:.1f} tok/s; streamed tokens "
          f"{'agree' if report['tokens_agree'] else 'DIFFER'} with resident")
    bound = report["clairvoyant_bound_tokens_per_s"] or 0
    print(f"a clairvoyant cache of this size (Belady, on this run's routing) would hit {optimum:.1%} and "
          f"read {format_size(int(least_per_token))} per step: at most {bound:.1f} tok/s from this disk, "
          f"{bound / decode['tierflow resident']:.2f}x resident")


if __name__ == "__main__":
    main()
