"""MoE expert cache, part (b): decode tokens/s with experts streamed from disk, in one run.

    python -m benchmarks.moe_decode [--size 2GB] [--weight-type Q4_0] [--fraction 0.333]
                                    [--tiers two|three] [--layers 4] [--model MOE.gguf]
                                    [--prompt-tokens 64] [--decode-tokens 48] [--repeats 3]
                                    [--threads N] [--policy score|lru|lfu] [--prefetch gated|all|none]
                                    [--expert-skip SHARE] [--verify-tokens T] [--union-cap N]
                                    [--json]

The model is a random-weight Mixtral-style `llama` of about --size with 8 experts per layer, top-2
routing, written once by the project's generator (tests/support/make_model.py) into the cache directory.
--model runs on a MoE file of your own instead, such as a real dense model MoEfied
(`python -m tests.support.make_moe_from_dense /tmp/qwen-64e8.gguf --source
~/.cache/tierflow-test-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --experts 64 --experts-used 8`):
routing by real text through real weights, which random routers' near-uniform spread is not.
Three systems decode the same held-out text, each repeat a window of its own cut from
benchmarks/routing_text.txt (the MoEfied models are fitted on tests/support/moe_calibration.txt):
a prompt, then the window's next tokens fed one a step (benchmarks/forced_decode.py), not the
model's own greedy guesses, which a MoEfied model soon repeats, replaying its routing:

- tierflow, experts streamed: cpu_memory = everything but the experts (globals, attention,
  routers, the KV cache and activations) + --fraction of the expert bytes; the experts are read
  from the pack with O_DIRECT (the page cache never holds them) into the expert cache
  (offload/experts/store.py); a fresh engine for each repeat, as a user's first request meets it;
- tierflow, fully resident (no budget);
- llama.cpp on the same file, fully resident (its own mmap), the same thread count.

The resident two are warmed up once; every repeat runs all three in a rotating order, and the
medians are reported. The goal is the streamed run at half the resident speed or better, with the
same next token as resident at every step (KL, top-1 agreement and perplexity against the exact
resident model are printed: options that trade accuracy for bytes show there). Beside the speeds:
the expert cache's hit rate, bytes read from disk per decode step, how often the early router's
pick of each rank is used, the same routing (recorded from the resident engine) replayed through a
fresh demand-only cache of the same size under LRU, LFU and the score policy, and two disk bounds at
this disk's measured read speed: the bytes the run read per step, and the least any cache of this
size could read, a clairvoyant one (Belady's optimum on the same routing): what no cache policy can
beat on this model, disk and budget.

--expert-skip SHARE runs the streamed engine with Engine.load's expert_skip (AdapMoE's skip of an
expert read from disk that its tokens weigh under SHARE, off by default): fewer bytes read, at a
cost the quality line measures against the exact resident model; the goal with it is 0.8x resident
at KL <= 0.02 nats a token and top-1 agreement >= 97%. Beside it, the share of expert uses skipped
per decode step, and the plan's prediction of it (from the routing recorded here, its shares).

--verify-tokens T feeds the text T tokens a pass, each a draft's chain the model verifies in one
pass with every guess accepted (speculative decoding's step; llama.cpp evaluates the same T at
once): its tokens fire the union of their experts, several times a decode token's. --union-cap N
runs the streamed engine with expert_union_cap N, which caps that union per layer (not exact);
the share of expert uses it left out is printed beside the quality line.

--prefetch says which of the early router's predictions are read ahead: those the prefetch gate
admits (offload/experts/prefetch_gate.py: a confidence threshold kept where decode tokens cost
least in bytes fetched and waited for; the default), every one, or none; run it with each to see
the bytes read per step and the speed with and without the gate.

--tiers three (issue 18) runs on the Qwen3-30B-A3B shape of benchmarks/moe_families.py cut to
--layers layers instead of the --size model, and adds a fourth system, MoE on three tiers:

- tierflow, three tiers: gpu_memory = 1/8 of the model's bytes: every layer (attention, norms,
  routers, shared experts) with its KV cache, and a cache of hot experts in the rest; cpu_memory =
  the globals and the activations beside a cache of --fraction of the expert bytes, the same RAM
  for experts as the streamed run's; the rest on disk. Each step, an expert not cached on the GPU
  runs on the CPU or is copied up, as the schedule says (offload/experts/hybrid.py).

Beside its speed against resident and against the streamed run (the same two tiers without the
GPU): the expert uses each tier served per decode step and their bytes (a use read ahead from disk
is the disk's, whose bytes are all it read, unused read-ahead included), next to the plan's
predicted shares and bytes (offload/plan/expert_plan.py); the schedule's runs per step (on the GPU
from its cache, copied up, on the CPU); and two bounds: the rate the disk allows for what it read,
and the copies up for their bytes at the host-to-device speed the schedule assumes. The GPU is a
CUDA one where torch has one, else the CPU standing in for it (gpu_device="cpu"): both devices'
shares then compute on the same cores, so the stand-in's figures check the schedule, not the speed.
"""

import argparse
import json
import queue
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llama_cpp
import numpy as np
import psutil
import torch

from benchmarks.forced_decode import ForcedRun, forced_decode, forced_decode_llama_cpp, text_windows
from benchmarks.moe import belady_hit_rate, replay_trace, uniform_belady_hit_rate
from benchmarks.quality import compare
from tests.support.budgets import moe_bytes, ram_beside_weights
from tests.support.make_model import spec_for_size, write_model
from tests.support.oracle import perplexity
from tierflow import Engine
from tierflow.offload.experts.expert_cache import CacheStats
from tierflow.offload.experts.hybrid import HybridExperts
from tierflow.offload.experts.policy import make_policy
from tierflow.offload.experts.prefetch_gate import PrefetchGate
from tierflow.offload.experts.routing_trace import NOT_PREDICTED, Routing
from tierflow.offload.experts.store import READERS
from tierflow.offload.io.disk import DiskFile, aligned_buffer
from tierflow.offload.plan.expert_plan import TIERS
from tierflow.offload.plan.plan_result import Plan
from tierflow.offload.plan.profile import cache_dir
from tierflow.units import format_size, parse_size

CONTEXT = 2048  # tokens each engine holds: --prompt-tokens plus --decode-tokens must fit
PREFETCH = {"gated": "prefetch gated by counted cost", "all": "every prediction prefetched",
            "none": "demand reads only"}

EXPERTS, USED = 8, 2
GPU_SHARE = 8  # --tiers three: gpu_memory is 1/GPU_SHARE of the model's bytes


def model_file(size: int, weight_type: str) -> Path:
    name = f"moe-{EXPERTS}x{USED}-{format_size(size).replace(' ', '')}-{weight_type}-ctx{CONTEXT}.gguf"
    path = cache_dir() / "bench" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", file=sys.stderr)
        spec = spec_for_size(size, weight_type=weight_type, num_experts=EXPERTS, experts_used=USED,
                             context_length=CONTEXT)  # trained on the context the engines load with
        write_model(path.with_suffix(".tmp"), spec).rename(path)
    return path


def qwen3_file(layers: int) -> Path:
    """benchmarks/moe_families.py's Qwen3-30B-A3B shape at `layers` layers, written once."""
    from benchmarks.moe_families import model_file as family_file  # not above: it imports this module

    return family_file("qwen3moe", layers)[0]


def expert_budget(path: Path, threads: int, fraction: float, context: int = CONTEXT) -> tuple[int, int]:
    """(cpu_memory that leaves `fraction` of the expert bytes to the cache beside the rest of the
    weights, the KV cache of `context` tokens and the activations; all expert bytes)."""
    with Engine.load(path, threads=threads, context_length=context) as engine:  # builds the pack once
        packed = engine.weights.packed
    base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
    experts = sum(x.nbytes for layer in packed.experts for x in layer)
    return base + ram_beside_weights(path, context) + int(fraction * experts), experts


def three_tier_budgets(path: Path, fraction: float) -> tuple[int, int]:
    """(gpu_memory: every layer with its KV cache, and a cache of experts up to 1/GPU_SHARE of the
    model's bytes in all; cpu_memory: the globals and the activations beside `fraction` of the expert
    bytes, expert_budget's RAM for experts)."""
    size = moe_bytes(path, CONTEXT)
    share = (size.globals + size.layers + size.experts) // GPU_SHARE
    return size.on_gpu((share - size.on_gpu(0)) // size.expert), size.in_ram(0) + int(fraction * size.experts)


def set_expert_options(engine: Engine, args: argparse.Namespace) -> None:
    """--policy for the engine's expert caches (before any expert is cached), --prefetch for its reads
    ahead."""
    experts = engine.weights.experts
    for cache in {experts.cache, experts.streamed.cache}:  # one streamed, two on three tiers (GPU, RAM)
        cache.policy = make_policy(args.policy)
    experts.prefetch = args.prefetch != "none"
    if args.prefetch == "all":
        experts.gate = PrefetchGate(start=0, fixed=True)


def run_counted(engine: Engine, prompt: list[int], text: list[int], counts: Callable[[], dict[str, int]],
                log_probs: bool = False, tokens_per_pass: int = 1) -> tuple[ForcedRun, dict[str, float]]:
    """forced_decode's run, and how much each of `counts` grew per fed token, counted from the first
    fed token on (the prefill uses most of every layer's experts)."""
    before: dict[str, int] = {}
    run = forced_decode(engine, prompt, text, log_probs, after_prefill=lambda: before.update(counts()),
                        tokens_per_pass=tokens_per_pass)
    after = counts()
    return run, {key: (after[key] - before.get(key, 0)) / len(text) for key in after}


def run_streamed(engine: Engine, prompt: list[int], text: list[int], tokens_per_pass: int = 1
                 ) -> tuple[ForcedRun, dict[str, float]]:
    """run_counted with the expert cache's counts: bytes read ("read"), hits, misses, reads skipped
    and experts the union cap left out."""
    experts = engine.weights.experts

    def counts() -> dict[str, int]:
        return cache_counts(experts.stats) | {"skipped": experts.skipped, "capped": experts.capped}

    return run_counted(engine, prompt, text, counts, log_probs=True, tokens_per_pass=tokens_per_pass)


def record_routing(engine: Engine, prompt: list[int], text: list[int]) -> Routing:
    """The routing of prompt + text, with the early router's picks: one pass, as each token routes as
    it would decoded alone (test_moe checks it), and an exact streamed engine routes as this one."""
    with engine.record_routing() as recorder:
        engine.logits(prompt + text)
    return recorder.routing()


def cache_counts(stats: CacheStats) -> dict[str, int]:
    """The expert cache's bytes read, hits and misses so far, the last two also per layer ("hits.3")."""
    counts = {"read": stats.fetched_bytes, "hits": stats.hits, "misses": stats.misses}
    for index, layer in stats.layers.items():
        counts[f"hits.{index}"], counts[f"misses.{index}"] = layer.hits, layer.misses
    return counts


def decode_hit_rate(steps: list[dict[str, float]], layer: int | None = None) -> float:
    """The hit rate of decode steps only (run_streamed's counts of several runs), of every layer or
    of one: the prefill uses most of every layer's experts, and the stats count its uses too."""
    suffix = "" if layer is None else f".{layer}"
    hits = sum(step.get("hits" + suffix, 0) for step in steps)
    return hits / max(hits + sum(step.get("misses" + suffix, 0) for step in steps), 1)


def tier_counts(experts: HybridExperts) -> dict[str, int]:
    """Three tiers' counts so far: the expert uses each tier served (one read ahead from disk into
    RAM is the disk's), the bytes read from disk and copied to the GPU, and the schedule's runs."""
    gpu, ram, runs = experts.stats, experts.ram_stats, experts.schedules
    return {"gpu": gpu.hits, "cpu": ram.hits - ram.prefetch_used, "disk": ram.misses + ram.prefetch_used,
            "read_ahead": ram.prefetch_used, "disk_bytes": ram.fetched_bytes,
            "copied_bytes": gpu.fetched_bytes, "on_gpu": runs.on_gpu, "fetched": runs.fetched,
            "on_cpu": runs.on_cpu}


def run_three_tiers(engine: Engine, prompt: list[int], text: list[int]) -> tuple[ForcedRun, dict[str, float]]:
    """run_counted with tier_counts."""
    return run_counted(engine, prompt, text, lambda: tier_counts(engine.weights.experts))


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


def load_three_tiers(path: Path, args: argparse.Namespace) -> Engine:
    """The engine on three tiers (three_tier_budgets), on a CUDA GPU, else the CPU standing in."""
    gpu_memory, cpu_memory = three_tier_budgets(path, args.fraction)
    engine = Engine.load(path, threads=args.threads, context_length=CONTEXT, gpu_memory=gpu_memory,
                         cpu_memory=cpu_memory, gpu_device=None if torch.cuda.is_available() else "cpu")
    set_expert_options(engine, args)
    return engine


def three_tier_report(plan: Plan, steps: list[dict[str, float]], decode: dict[str, float],
                      gbps: float, tokens_agree: bool) -> dict:
    """The three-tier run's budgets, its speed against resident and two tiers, what each tier served
    per decode step (means over the timed runs) beside the plan's predictions, the schedule's runs
    per step, and the rates the disk's reads and the copies to the GPU allow (the copies at the
    speed the schedule assumes)."""
    experts = plan.experts
    per_step = {key: statistics.fmean(step[key] for step in steps) for key in steps[0]}
    uses = sum(per_step[tier] for tier in TIERS)
    served_bytes = {tier: per_step[tier] * experts.expert_bytes for tier in ("gpu", "cpu")}
    served_bytes["disk"] = per_step["disk_bytes"]  # all it read
    rate = decode["tierflow three tiers"]
    return {
        "stand_in": not torch.cuda.is_available(),  # the CPU for the GPU: the figures check the schedule
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpu_memory": plan.budget_bytes["gpu"], "cpu_memory": plan.budget_bytes["cpu"],
        "gpu_cache_bytes": experts.gpu_cache_bytes, "gpu_cached_experts": experts.gpu_cached_experts,
        "ram_cache_bytes": experts.ram_cache_bytes, "decode_tokens_per_s": rate,
        "predicted_decode_tokens_per_s": plan.predicted_decode_tps,
        "vs_resident": rate / decode["tierflow resident"], "vs_two_tiers": rate / decode["tierflow streamed"],
        "served": {tier: per_step[tier] / uses for tier in TIERS}, "predicted_served": experts.served,
        "bytes_per_token": served_bytes, "predicted_bytes_per_token": experts.bytes_per_token,
        "predicted_from": experts.routing,
        "read_ahead": per_step["read_ahead"] / per_step["disk"] if per_step["disk"] else 0.0,
        "predicted_read_ahead": experts.read_ahead,
        "read_ahead_source": "the recorded predictions" if experts.read_ahead_measured else "assumed",
        "schedule_per_token": {run: per_step[run] for run in ("on_gpu", "fetched", "on_cpu")},
        "disk_bound_tokens_per_s": gbps * 1e9 / served_bytes["disk"] if served_bytes["disk"] else None,
        "copied_bytes_per_token": per_step["copied_bytes"], "copy_gbps": experts.scheduler.copy_gbps,
        "copy_bound_tokens_per_s": (experts.scheduler.copy_gbps * 1e9 / per_step["copied_bytes"]
                                    if per_step["copied_bytes"] else None),
        "tokens_agree": tokens_agree,
    }


def print_three_tiers(report: dict) -> None:
    r = report["three_tiers"]
    gpu = ("the CPU standing in for a GPU, so these figures check the schedule, not the speed"
           if r["stand_in"] else r["gpu"])
    print(f"three tiers on {gpu}:")
    print(f"  gpu_memory {format_size(r['gpu_memory'])} (1/{GPU_SHARE} of the model: every layer, its KV "
          f"cache and a cache of {r['gpu_cached_experts']} experts, {format_size(r['gpu_cache_bytes'])}); "
          f"cpu_memory {format_size(r['cpu_memory'])} (a cache of {format_size(r['ram_cache_bytes'])}, the "
          f"streamed run's {format_size(report['expert_cache_bytes'])}); the rest on disk")
    predicted = r["predicted_decode_tokens_per_s"] or 0
    print(f"  {r['decode_tokens_per_s']:.2f} tok/s: {r['vs_resident']:.2f}x resident, "
          f"{r['vs_two_tiers']:.2f}x the same two tiers without the GPU (the plan predicts {predicted:.2f} "
          f"at a full context); tokens {'agree' if r['tokens_agree'] else 'DIFFER'} with resident")
    print(f"  per decode step   share of uses (plan)   bytes served (plan, from {r['predicted_from']})")
    for tier in TIERS:
        print(f"    {tier:<4}            {r['served'][tier]:6.1%} ({r['predicted_served'][tier]:6.1%})"
              f"    {format_size(int(r['bytes_per_token'][tier])):>10} "
              f"({format_size(int(r['predicted_bytes_per_token'][tier]))})")
    print(f"  uses served by disk that were read a layer early: {r['read_ahead']:.1%} (plan: "
          f"{r['predicted_read_ahead']:.1%}, {r['read_ahead_source']})")
    runs = r["schedule_per_token"]
    print(f"  schedule per decode step: {runs['on_gpu']:.1f} experts on the GPU from its cache, "
          f"{runs['fetched']:.1f} copied up, {runs['on_cpu']:.1f} on the CPU")
    print(f"  bounds: the disk's reads (read-ahead included) at {report['disk_read_gbps']:.2f} GB/s allow "
          f"{r['disk_bound_tokens_per_s'] or 0:.1f} tok/s; the copies up, "
          f"{format_size(int(r['copied_bytes_per_token']))} per step at {r['copy_gbps']:.1f} GB/s (the "
          f"schedule's speed), {r['copy_bound_tokens_per_s'] or 0:.1f} tok/s")


def replayed_hit_rates(routings: list[Routing], prompt_tokens: int, fraction: float) -> dict[str, float]:
    """Each run's routing replayed through a fresh demand-only cache of `fraction` of the experts, as
    each run's engine is fresh, hits counted from its first decode step: LRU, LFU, the engine's
    score policy, and Belady's clairvoyant optimum. Means over the runs."""
    rates = {policy: statistics.fmean(replay_trace(r.trace, policy, fraction, warmup=prompt_tokens).hit_rate
                                      for r in routings) for policy in ("lru", "lfu", "score")}
    rates["clairvoyant"] = statistics.fmean(belady_hit_rate(r.trace, fraction, warmup=prompt_tokens)
                                            for r in routings)
    return rates


def precision_per_rank(routings: list[Routing], prompt_tokens: int) -> list[float]:
    """How often the early router's j-th pick for a layer (from the stream entering the layer before)
    is among the experts the layer then uses, over the decode steps of every run."""
    picks = np.concatenate([r.predicted[prompt_tokens:] for r in routings])  # [T, L, K]
    used = np.concatenate([r.trace[prompt_tokens:] for r in routings])
    right = (picks[..., :, None] == used[..., None, :]).any(axis=-1)
    made = picks != NOT_PREDICTED
    return [float(right[..., j][made[..., j]].mean()) for j in range(picks.shape[-1])]


def quality(reference: list[ForcedRun], runs: list[ForcedRun], texts: list[list[int]]) -> dict[str, float]:
    """Runs' next-token distributions against the exact resident model's on the same text: mean KL
    in nats per token, top-1 agreement, and the text's perplexity under each."""
    kls, agreements = zip(*(compare(ref.log_probs, run.log_probs) for ref, run in zip(reference, runs)))
    return {"kl": statistics.fmean(kls), "top1": statistics.fmean(agreements),
            "perplexity": statistics.fmean(perplexity(run.log_probs, text) for run, text in zip(runs, texts)),
            "resident_perplexity": statistics.fmean(perplexity(ref.log_probs, text)
                                                    for ref, text in zip(reference, texts))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GB")
    parser.add_argument("--weight-type", default="Q4_0")
    parser.add_argument("--fraction", type=float, default=1 / 3, help="of the expert bytes, for the cache")
    parser.add_argument("--tiers", default="two", choices=["two", "three"],
                        help="three: the Qwen3-30B-A3B shape, with a run on three tiers (GPU, RAM, disk)")
    parser.add_argument("--layers", type=int, default=4, help="with --tiers three: the shape's depth")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=psutil.cpu_count(logical=False) or 1)
    parser.add_argument("--policy", default="score", choices=["score", "lru", "lfu"])
    parser.add_argument("--prefetch", default="gated", choices=list(PREFETCH),
                        help="gated: the predictions the prefetch gate admits; all: every prediction; "
                             "none: demand reads only")
    parser.add_argument("--model", type=Path, help="a MoE GGUF to run instead of the generated one")
    parser.add_argument("--expert-skip", type=float, default=0.0,
                        help="the streamed engine's expert_skip (0: exact)")
    parser.add_argument("--verify-tokens", type=int, default=1,
                        help="tokens fed a pass, as a verified chain (1: decode steps)")
    parser.add_argument("--union-cap", type=int, default=0,
                        help="the streamed engine's expert_union_cap (0: exact)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    three_tiers = args.tiers == "three"
    path = args.model or (qwen3_file(args.layers) if three_tiers
                          else model_file(parse_size(args.size), args.weight_type))
    cpu_memory, expert_bytes = expert_budget(path, args.threads, args.fraction)
    resident = Engine.load(path, threads=args.threads, context_length=CONTEXT)
    llama = llama_cpp.Llama(str(path), n_ctx=args.prompt_tokens + args.decode_tokens + 8, n_batch=512,
                            n_threads=args.threads, verbose=False)
    # the warm-up's window, then one for each repeat: no run replays the routing of another
    warm_up, *windows = text_windows(resident, args.repeats + 1, args.prompt_tokens, args.decode_tokens)
    routings = [record_routing(resident, *window) for window in windows]
    forced_decode(resident, *warm_up)
    forced_decode_llama_cpp(llama, *warm_up)
    decode_steps: list[dict[str, float]] = []  # the streamed runs' counts per decode step
    tier_steps: list[dict[str, float]] = []
    seen: dict[str, object] = {}  # from a streamed engine before it closes: its cache, gate and disk

    def streamed_run(prompt: list[int], text: list[int]) -> ForcedRun:
        with Engine.load(path, threads=args.threads, context_length=CONTEXT, cpu_memory=cpu_memory,
                         expert_skip=args.expert_skip, expert_union_cap=args.union_cap) as engine:
            set_expert_options(engine, args)
            run, per_step = run_streamed(engine, prompt, text, args.verify_tokens)
            seen.update(cache_bytes=engine.weights.experts.nbytes, gate=engine.weights.experts.gate.best,
                        gbps=seen.get("gbps") or disk_read_gbps(engine), config=engine.config,
                        predicted_skipped=engine.plan.experts.skipped)
        decode_steps.append(per_step)
        return run

    def three_tier_run(prompt: list[int], text: list[int]) -> ForcedRun:
        with load_three_tiers(path, args) as engine:
            run, per_step = run_three_tiers(engine, prompt, text)
            seen["three"] = engine.plan
        tier_steps.append(per_step)
        return run

    runners: dict[str, Callable[[list[int], list[int]], ForcedRun]] = {
        "tierflow streamed": streamed_run,
        "tierflow resident": lambda prompt, text: forced_decode(resident, prompt, text, log_probs=True,
                                                                tokens_per_pass=args.verify_tokens),
        "llama.cpp resident": lambda prompt, text: forced_decode_llama_cpp(llama, prompt, text,
                                                                           args.verify_tokens)}
    if three_tiers:
        runners["tierflow three tiers"] = three_tier_run
    samples: dict[str, list[ForcedRun]] = {name: [] for name in runners}
    order = list(runners)
    for window in windows:
        for name in order:
            samples[name].append(runners[name](*window))
        order = order[1:] + order[:1]
    resident.close()
    llama.close()
    config, gbps = seen["config"], seen["gbps"]
    decode = {name: statistics.median(run.tokens_per_s for run in runs) for name, runs in samples.items()}
    per_token = statistics.median(step["read"] for step in decode_steps)
    replayed = replayed_hit_rates(routings, args.prompt_tokens, args.fraction)
    uses_per_step = expert_bytes * config.experts_used / config.num_experts  # k of every layer's E experts
    least_per_token = (1 - replayed["clairvoyant"]) * uses_per_step
    texts = [text for _, text in windows]
    report = {
        "model": path.name, "file_bytes": path.stat().st_size, "expert_bytes": expert_bytes,
        "cpu_memory": cpu_memory, "expert_cache_bytes": seen["cache_bytes"],
        "policy": args.policy, "prefetch": args.prefetch, "threads": args.threads,
        "expert_skip": args.expert_skip, "predicted_skipped": seen["predicted_skipped"],
        "skipped": statistics.fmean(step["skipped"] for step in decode_steps) / (
            len(config.moe_layers) * config.experts_used),
        "verify_tokens": args.verify_tokens, "union_cap": args.union_cap,
        "capped_per_token": statistics.fmean(step["capped"] for step in decode_steps),
        "prefetch_threshold": seen["gate"], "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens, "decode_tokens_per_s": decode,
        "streamed_vs_resident": decode["tierflow streamed"] / decode["tierflow resident"],
        "resident_vs_llama_cpp": decode["tierflow resident"] / decode["llama.cpp resident"],
        "hit_rate": decode_hit_rate(decode_steps), "cache_fraction": args.fraction,
        "layer_hit_rates": {i: decode_hit_rate(decode_steps, i) for i in config.moe_layers},
        "decode_bytes_read_per_token": per_token,
        "precision_per_rank": precision_per_rank(routings, args.prompt_tokens),
        "disk_read_gbps": gbps, "disk_bound_tokens_per_s": gbps * 1e9 / per_token if per_token else None,
        "replayed_hit_rates": replayed, "clairvoyant_bytes_read_per_token": least_per_token,
        "clairvoyant_uniform_hit_rate": uniform_belady_hit_rate([r.trace for r in routings], args.fraction,
                                                                config.num_experts),
        "clairvoyant_bound_tokens_per_s": gbps * 1e9 / least_per_token if least_per_token else None,
        "quality": quality(samples["tierflow resident"], samples["tierflow streamed"], texts),
        "tokens_agree": all(s.argmax == r.argmax for s, r in zip(samples["tierflow streamed"],
                                                                  samples["tierflow resident"])),
    }
    if three_tiers:
        agree = all(t.argmax == r.argmax for t, r in zip(samples["tierflow three tiers"],
                                                         samples["tierflow resident"]))
        report["three_tiers"] = three_tier_report(seen["three"], tier_steps, decode, gbps, agree)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print_report(report, args)


def print_report(report: dict, args: argparse.Namespace) -> None:
    fed = "one a step" if args.verify_tokens == 1 else f"{args.verify_tokens} a verify pass"
    decode, replayed, q = report["decode_tokens_per_s"], report["replayed_hit_rates"], report["quality"]
    print(f"{report['model']}: {format_size(report['file_bytes'])}, experts "
          f"{format_size(report['expert_bytes'])}; cpu_memory {format_size(report['cpu_memory'])} (expert "
          f"cache {format_size(report['expert_cache_bytes'])}, {args.fraction:.0%} of the experts, policy "
          f"{args.policy}, {PREFETCH[args.prefetch]}); {args.threads} threads; {args.repeats} runs, each a "
          f"fresh streamed engine on its own window of held-out text: prompt {args.prompt_tokens}, "
          f"{args.decode_tokens} fed tokens, {fed}; medians")
    for name, rate in decode.items():
        print(f"  {name:<20} {rate:7.2f} tok/s")
    goal = "0.5" if not report["expert_skip"] else "0.8 at KL <= 0.02 and top-1 >= 97%"
    print(f"streamed / resident: {report['streamed_vs_resident']:.2f}x (goal >= {goal}); "
          f"resident / llama.cpp: {report['resident_vs_llama_cpp']:.2f}x; streamed next tokens "
          f"{'agree' if report['tokens_agree'] else 'DIFFER'} with resident at every step (KL "
          f"{q['kl']:.4f} nats, top-1 {q['top1']:.1%}; perplexity {q['perplexity']:.1f} against "
          f"{q['resident_perplexity']:.1f})")
    if report["verify_tokens"] > 1:
        print(f"text fed {report['verify_tokens']} tokens a pass, each a verified chain (the hit rate below "
              f"counts an expert once a pass, the replays once a token); expert_union_cap "
              f"{report['union_cap']}: {report['capped_per_token']:.2f} experts left out per token")
    if report["expert_skip"]:
        print(f"expert_skip {report['expert_skip']:g}: {report['skipped']:.1%} of decode expert uses skipped "
              f"(the plan predicted {report['predicted_skipped']:.1%})")
    gbps, per_token = report["disk_read_gbps"], report["decode_bytes_read_per_token"]
    print(f"expert cache: decode hit rate {report['hit_rate']:.1%} (read-ahead ones counted), "
          f"{format_size(int(per_token))} read per decode step; prefetched from confidence "
          f"{report['prefetch_threshold']:.2f}; disk {gbps:.2f} GB/s, so reads alone allow "
          f"{report['disk_bound_tokens_per_s'] or 0:.1f} tok/s")
    ranks = ", ".join(f"{p:.0%}" for p in report["precision_per_rank"])
    print(f"early router's picks used by their layer, by rank: {ranks}")
    over = 100 * (report["hit_rate"] - max(replayed["lru"], replayed["lfu"]))
    print(f"the same routing through a fresh demand-only cache of this size: LRU {replayed['lru']:.1%}, "
          f"LFU {replayed['lfu']:.1%}, score {replayed['score']:.1%}; the engine ({args.policy}, with its "
          f"reads ahead) {report['hit_rate']:.1%}, {over:+.1f} points over the better of LRU and LFU "
          f"(goal >= +5)")
    bound = report["clairvoyant_bound_tokens_per_s"] or 0
    print(f"a clairvoyant cache of this size (Belady) would hit {replayed['clairvoyant']:.1%} and read "
          f"{format_size(int(report['clairvoyant_bytes_read_per_token']))} per step: at most {bound:.1f} "
          f"tok/s from this disk, {bound / decode['tierflow resident']:.2f}x resident; on uniformly random "
          f"routing of this shape it would hit {report['clairvoyant_uniform_hit_rate']:.1%}")
    if "three_tiers" in report:
        print_three_tiers(report)


if __name__ == "__main__":
    main()
