"""The MoE families at their real shapes: decode and prefill tok/s resident against llama.cpp, and
with the experts streamed through the expert cache against the disk and clairvoyant-cache bounds.

    python -m benchmarks.moe_families [--family qwen3moe|moefied|...] [--layers N] [--cpu-memory 8GiB]
                                      [--prompt-tokens 64] [--decode-tokens 32] [--repeats 2]
                                      [--threads N] [--json]

Each family's model is written once by the project's generator (random weights, the SmolLM2
vocabulary) into the cache directory, at the real model's per-layer shape:
- qwen3moe: Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts of width 768, top-8, 32 query and
  4 KV heads of size 128), every matrix Q4_K;
- gpt-oss: gpt-oss-20b (24 layers, hidden 2880, 32 experts of width 2880, top-4, 64 query and 8 KV
  heads of size 64, every other layer a window of 128, YaRN), MXFP4 experts and Q8_0 elsewhere
  (llama.cpp's MXFP4_MOE mix; the released file keeps some of those in BF16);
- qwen35moe: Qwen3.5-35B-A3B (40 layers, hidden 2048, 256 experts of width 512, top-8, a shared
  expert of 512; every 4th layer full attention, 16 query and 2 KV heads of size 256 rotating 64
  dimensions; the others Gated DeltaNet, 16 query/key heads and 32 value heads of 128, a 4-tap
  convolution), every matrix Q4_K.

- moefied: real routing, the real Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, tests/support/real_models.py)
  MoEfied into a qwen2moe of 64 experts, top-8, and a shared expert (tests/support/make_moe_from_dense.py,
  about four minutes the first time): its routers follow real text through real weights, where the
  generated families' random routers spread tokens almost uniformly. --cpu-memory does not apply to
  it: its streamed run keeps a quarter of its experts in RAM.

`--layers N` keeps every per-layer shape and cuts the depth, for machines that cannot hold the
whole model twice; `--cpu-memory` is then scaled by the same fraction of the layers (printed), so
the streamed run keeps the real model's ratio of budget to experts. Three runs, each warmed up once
and then timed `--repeats` times (medians); the first two alternate repeat by repeat where the
resident engine and llama.cpp fit in RAM side by side (a cut depth), as benchmarks/decode.py does,
and run one after the other where they do not (the full depth; the report says which):
- tierflow resident and llama.cpp resident (in its own buffers, `--no-mmap`): decode and prefill tok/s;
- tierflow with `cpu_memory` = the budget: the experts on disk, read with O_DIRECT into the expert
  cache; against the decode rate the disk allows for what it read, and for what a clairvoyant cache
  of the same size would read (benchmarks/moe_decode.py's two bounds), and the hit rates of LRU, LFU
  and the score policy on the same routing. Each run decodes a window of its own of held-out text,
  cut from benchmarks/routing_text.txt and fed a token a step (benchmarks/forced_decode.py), so that
  no run replays the routing of another; the warm-up window's next tokens must agree with the
  resident engine's at every step.
Goals (issues 17 and 19): resident at least 1.0x llama.cpp in decode and in prefill; streamed at
least 0.5x resident.
"""

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import psutil
import torch

from benchmarks.decode import Sample, build_prompt, measure, run_llama_cpp, run_tierflow
from benchmarks.forced_decode import forced_decode, text_windows
from benchmarks.moe import uniform_belady_hit_rate
from benchmarks.moe_decode import (
    decode_hit_rate,
    disk_read_gbps,
    expert_budget,
    record_routing,
    replayed_hit_rates,
    run_streamed,
)
from tests.support.make_model import ModelSpec, write_model
from tests.support.make_moe_from_dense import write_moe_from_dense
from tests.support.real_models import QWEN_CODER_15B, fetch
from tierflow import Engine
from tierflow.offload.plan.profile import cache_dir
from tierflow.units import format_size, parse_size

CONTEXT = 512

FAMILIES = {
    "qwen3moe": ModelSpec(arch="qwen3moe", num_layers=48, hidden_size=2048, ffn_size=6144, num_heads=32,
                          num_kv_heads=4, head_size=128, num_experts=128, experts_used=8,
                          expert_ffn_size=768, context_length=40960, rope_theta=1e6,
                          weight_type="Q4_K", embedding_type="Q4_K"),
    "gpt-oss": ModelSpec(arch="gpt-oss", num_layers=24, hidden_size=2880, ffn_size=2880, num_heads=64,
                         num_kv_heads=8, head_size=64, num_experts=32, experts_used=4, sliding_window=128,
                         context_length=131072, rope_theta=150000.0, rope_scaling="yarn",
                         rope_scaling_factor=32.0, weight_type="Q8_0", embedding_type="Q8_0",
                         expert_type="MXFP4"),
    "qwen35moe": ModelSpec(arch="qwen35moe", num_layers=40, hidden_size=2048, ffn_size=512, num_heads=16,
                           num_kv_heads=2, head_size=256, rope_dim=64, num_experts=256, experts_used=8,
                           expert_ffn_size=512, shared_expert_ffn_size=512, ssm_state=128, ssm_key_heads=16,
                           ssm_value_heads=32, context_length=262144, rope_theta=1e7,
                           weight_type="Q4_K", embedding_type="Q4_K"),
}


MOEFIED = "moefied"  # the real Qwen2.5-Coder-1.5B, MoEfied: 64 experts, top-8
MOEFIED_CACHE = 0.25  # of its experts, its streamed run's cache


def model_file(family: str, layers: int | None) -> tuple[Path, float]:
    """The family's file at `layers` layers (all when None; the MoEfied model is always whole),
    written once; the fraction of the real model's layers it holds."""
    if family == MOEFIED:
        path = cache_dir() / "bench" / "qwen2.5-coder-1.5b-moefied-64x8.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            print(f"writing {path} (about four minutes) ...", file=sys.stderr)
            write_moe_from_dense(fetch(QWEN_CODER_15B), path.with_suffix(".tmp"), 64, 8, threads=2
                                 ).rename(path)
        return path, 1.0
    spec = FAMILIES[family]
    depth = layers or spec.num_layers
    types = spec.weight_type + (f"-{spec.expert_type}-experts" if spec.expert_type else "")
    path = cache_dir() / "bench" / f"{family}-{depth}-layers-{types}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", file=sys.stderr)
        shallow = ModelSpec(**(spec.__dict__ | {"num_layers": depth}))
        write_model(path.with_suffix(".tmp"), shallow).rename(path)
    return path, depth / spec.num_layers


def timed(run: Callable[[], Sample], repeats: int) -> list[Sample]:
    run()  # warm-up
    return [run() for _ in range(repeats)]


def median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def measure_family(family: str, args: argparse.Namespace) -> dict:
    path, depth_fraction = model_file(family, args.layers)
    cpu_memory = (expert_budget(path, args.threads, MOEFIED_CACHE, CONTEXT)[0] if family == MOEFIED
                  else int(parse_size(args.cpu_memory) * depth_fraction))
    side_by_side = fits_side_by_side(path)
    with Engine.load(path, threads=args.threads, context_length=CONTEXT) as resident:
        prompt = build_prompt(resident, args.prompt_tokens)
        windows = text_windows(resident, args.repeats + 1, args.prompt_tokens, args.decode_tokens)
        routings = [record_routing(resident, *window) for window in windows[1:]]
        expected = forced_decode(resident, *windows[0]).argmax  # the warm-up window's next tokens
        # the streamed runs' measure: the same windows, fed a token a step
        fed = statistics.median(forced_decode(resident, *window).tokens_per_s for window in windows[1:])
        packed = resident.weights.packed
        expert_bytes = sum(x.nbytes for layer in packed.experts for x in layer)
        config = resident.config
        if side_by_side:
            with llama_cpp_model(path, args.threads) as llama:
                samples = measure(resident, llama, prompt, args.decode_tokens, args.repeats)
            ours, theirs = samples["tierflow"], samples["llama.cpp"]
        else:
            ours = timed(lambda: run_tierflow(resident, prompt, args.decode_tokens), args.repeats)
    if not side_by_side:
        with llama_cpp_model(path, args.threads) as llama:
            theirs = timed(lambda: run_llama_cpp(llama, prompt, args.decode_tokens), args.repeats)
    streamed = measure_streamed(path, cpu_memory, windows, routings, expert_bytes, config, args)
    decode, prefill = median(ours, "decode_tokens_per_s"), median(ours, "prefill_tokens_per_s")
    llama_decode = median(theirs, "decode_tokens_per_s")
    llama_prefill = median(theirs, "prefill_tokens_per_s")
    return {
        "family": family, "model": path.name, "file_bytes": path.stat().st_size, "layers": config.num_layers,
        "expert_bytes": expert_bytes, "threads": args.threads, "prompt_tokens": len(prompt),
        "decode_tokens": args.decode_tokens, "repeats": args.repeats, "alternated": side_by_side,
        "resident": {"decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill},
        "llama_cpp": {"decode_tokens_per_s": llama_decode, "prefill_tokens_per_s": llama_prefill},
        "decode_vs_llama_cpp": decode / llama_decode, "prefill_vs_llama_cpp": prefill / llama_prefill,
        "resident_fed_tokens_per_s": fed,
        "streamed": streamed, "streamed_vs_resident": streamed["decode_tokens_per_s"] / fed,
        "tokens_agree": streamed["warm_up_argmax"] == expected,
    }


def fits_side_by_side(path: Path) -> bool:
    """Whether the resident engine and llama.cpp's copy of the weights fit in RAM together, with a
    quarter to spare: then their repeats alternate (benchmarks/decode.py's `measure`), so that the phases of a
    shared machine hit both alike; else they run one after the other."""
    return 2 * path.stat().st_size < 0.75 * psutil.virtual_memory().available


@contextlib.contextmanager
def llama_cpp_model(path: Path, threads: int) -> Iterator[llama_cpp.Llama]:
    """llama.cpp with the weights read into its own buffers (`--no-mmap`), resident as tierflow's are.
    Its default maps the file instead, and at full depth its decode then depends on the page cache
    (on the 48-layer Qwen3-30B-A3B shape here: 17 tok/s mapped, 20 in its own buffers)."""
    llama = llama_cpp.Llama(str(path), n_ctx=CONTEXT, n_batch=512, n_threads=threads, verbose=False,
                            use_mmap=False)
    try:
        yield llama
    finally:
        llama.close()


def measure_streamed(path: Path, cpu_memory: int, windows: list[tuple[list[int], list[int]]],
                     routings: list, expert_bytes: int, config, args: argparse.Namespace) -> dict:
    """One streamed engine: the first window warms it up, each of the others is a timed run."""
    with Engine.load(path, threads=args.threads, context_length=CONTEXT, cpu_memory=cpu_memory) as engine:
        if engine.weights.experts is None:
            sys.exit(f"cpu_memory {format_size(cpu_memory)} holds every expert: nothing streams; "
                     "give a smaller --cpu-memory")
        cache_bytes = engine.weights.experts.nbytes
        fraction = cache_bytes / expert_bytes
        warm_up, *runs = [run_streamed(engine, *window) for window in windows]
        gbps = disk_read_gbps(engine)
    per_step = statistics.median(r[1]["read"] for r in runs)
    uses_per_step = expert_bytes * config.experts_used / config.num_experts
    replayed = replayed_hit_rates(routings, args.prompt_tokens, fraction)
    least = (1 - replayed["clairvoyant"]) * uses_per_step
    return {
        "cpu_memory": cpu_memory, "expert_cache_bytes": cache_bytes, "cache_fraction": fraction,
        "hit_rate": decode_hit_rate([r[1] for r in runs]), "replayed_hit_rates": replayed,
        "decode_tokens_per_s": statistics.median(r[0].tokens_per_s for r in runs),
        "bytes_read_per_token": per_step, "disk_read_gbps": gbps,
        "disk_bound_tokens_per_s": gbps * 1e9 / per_step if per_step else None,
        "clairvoyant_hit_rate": replayed["clairvoyant"],
        "clairvoyant_uniform_hit_rate": uniform_belady_hit_rate([r.trace for r in routings], fraction,
                                                                config.num_experts),
        "clairvoyant_bound_tokens_per_s": gbps * 1e9 / least if least else None,
        "warm_up_argmax": warm_up[0].argmax,
    }


def print_report(r: dict, scaled: bool) -> None:
    s = r["streamed"]
    print(f"{r['family']}: {r['model']}, {format_size(r['file_bytes'])} ({r['layers']} layers), experts "
          f"{format_size(r['expert_bytes'])}; {r['threads']} threads, prompt {r['prompt_tokens']}, "
          f"{r['decode_tokens']} decode steps, median of {r['repeats']} "
          f"({'alternating with' if r['alternated'] else 'one after the other from'} llama.cpp's)")
    for name in ("resident", "llama_cpp"):
        print(f"  {name:<10} decode {r[name]['decode_tokens_per_s']:7.2f} tok/s   "
              f"prefill {r[name]['prefill_tokens_per_s']:8.2f} tok/s")
    print(f"  resident / llama.cpp: decode {r['decode_vs_llama_cpp']:.2f}x, prefill "
          f"{r['prefill_vs_llama_cpp']:.2f}x (goals >= 1.0)")
    budget = f"cpu_memory {format_size(s['cpu_memory'])}" + (" (scaled with the depth)" if scaled else "")
    print(f"  streamed   decode {s['decode_tokens_per_s']:7.2f} tok/s with {budget}, expert cache "
          f"{format_size(s['expert_cache_bytes'])} ({s['cache_fraction']:.0%} of the experts), decode hit "
          f"rate {s['hit_rate']:.1%} (read-ahead ones counted): "
          f"{r['streamed_vs_resident']:.2f}x resident's {r['resident_fed_tokens_per_s']:.2f} on the same "
          f"held-out windows (goal >= 0.5); "
          f"tokens {'agree' if r['tokens_agree'] else 'DIFFER'}")
    read = format_size(int(s['bytes_read_per_token']))
    replayed = s["replayed_hit_rates"]
    print(f"  the same routing through a fresh demand-only cache of this size: LRU {replayed['lru']:.1%}, "
          f"LFU {replayed['lfu']:.1%}, score {replayed['score']:.1%}")
    print(f"  disk {s['disk_read_gbps']:.2f} GB/s, {read} read per step: reads allow "
          f"{s['disk_bound_tokens_per_s'] or 0:.2f} tok/s; a clairvoyant cache of the same size "
          f"hits {s['clairvoyant_hit_rate']:.1%}, allowing "
          f"{s['clairvoyant_bound_tokens_per_s'] or 0:.2f} tok/s; on uniformly random routing of the same "
          f"shape it would hit {s['clairvoyant_uniform_hit_rate']:.1%}, where no online cache beats "
          f"{s['cache_fraction']:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=[*FAMILIES, MOEFIED, "all"], default="all")
    parser.add_argument("--layers", type=int, help="cut the depth (every per-layer shape kept)")
    parser.add_argument("--cpu-memory", default="8GiB", help="the streamed run's budget at full depth")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=psutil.cpu_count(logical=False) or 1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    families = [*FAMILIES, MOEFIED] if args.family == "all" else [args.family]
    reports = [measure_family(family, args) for family in families]
    if args.json:
        print(json.dumps(reports, indent=2))
        return
    for report in reports:
        print_report(report, scaled=args.layers is not None)


if __name__ == "__main__":
    main()
