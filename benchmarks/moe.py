"""MoE expert cache, part (a): hit rate of each cache policy at several cache sizes, one run.

    python -m benchmarks.moe [--trace PATH.npy ...] [--no-synthetic] [--sizes 0.1,0.2,0.3,0.4,0.5,0.6]
                             [--seeds 0,1] [--tokens 384] [--warmup 64] [--half-life 32] [--json]

Each routing trace ([tokens, layers, top_k] expert ids, offload/experts/routing_trace.py) is replayed
through an ExpertCache holding a fraction of all layers x experts, once per policy, and the hit
rate counts the demand uses after --warmup tokens. Two tables per trace:

1. Demand only (an expert is fetched when its layer needs it): lru and lfu (the baselines),
   "h only" (the score without its layer-cycle term, an ablation), score
   (offload/experts/policy.py), and belady, the offline optimum (evict the expert used again furthest in
   the future): a bound no online policy reaches. Last column: score minus LRU, in points.
2. With prefetch: an AffinityPredictor (ExFlow-style, learned online on the trace) predicts the
   next layer's experts from this layer's; the cache is told, fetches them ahead, and cancels
   those the layer then does not use. A prefetched expert that is used counts as a hit, so the
   bytes fetched per token (in experts) are printed beside each hit rate: LRU admits every
   prediction, the score policy only those it ranks above the expert they would evict.

Without --trace the traces are, first, RECORDED from the engine (Engine.record_routing): the
routing of benchmarks/routing_text.txt (~1,300 tokens of prose, code, lists, dialogue, news),
token by token, through
- SmolLM2 MoEfied: the bundled SmolLM2-135M with each layer's FFN split into 8 experts of
  neurons that fire together and a router fit to their activity, top-2 (tests/
  make_moe_from_dense.py): a real model's neurons on real text, the nearest to a real MoE here;
- a random-weight Mixtral-style model (tests/support/make_model.py), whose routing follows its random
  routers: mostly the token's identity;
both written once into the cache directory. Then SYNTHETIC ones (make_synthetic_trace, unless
--no-synthetic): a Mixtral-like shape (32 layers, 8 experts, top-2) and an OLMoE-like one (16
layers, 64 experts, top-8) at two skews, with temporal locality, cross-layer affinity and topic
changes as the titles state, averaged over seeds. They show how the policies differ under those
assumptions, not how a real model routes. --trace replays saved traces instead; or call
policy_hit_rates(trace, sizes) from Python. The default run takes about ten minutes on two cores
(pure-Python replay); --seeds 0 --sizes 0.1,0.3,0.5 is a quick look. Part (b), decode speed
with experts streamed from disk, is benchmarks/moe_decode.py.
"""

import argparse
import heapq
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.support.make_model import ModelSpec, write_model
from tests.support.make_moe_from_dense import write_moe_from_dense
from tierflow import Engine
from tierflow.offload.experts.expert_cache import CacheStats, ExpertCache
from tierflow.offload.experts.next_layer import AffinityPredictor
from tierflow.offload.experts.policy import ExpertKey, make_policy
from tierflow.offload.experts.routing_trace import (
    SyntheticTraceSpec,
    check_trace,
    load_trace,
    make_synthetic_trace,
)
from tierflow.offload.plan.profile import cache_dir
from tierflow.offload.store.model_path import bundled_model_path

TEXT = Path(__file__).with_name("routing_text.txt")
RANDOM_MIXTRAL = ModelSpec(num_layers=32, hidden_size=256, ffn_size=512, num_heads=4, num_kv_heads=2,
                           num_experts=8, experts_used=2, context_length=2048, weight_type="Q4_0",
                           embedding_type="Q4_0", seed=11)

# column -> (policy, its options); "score" takes --half-life
DEMAND = {"lru": ("lru", {}), "lfu": ("lfu", {}), "h only": ("score", {"layer_cycle": False}),
          "score": ("score", {})}
PREFETCH = {"lru": ("lru", {}), "score": ("score", {})}
SHAPES = {"Mixtral-like": dict(num_layers=32, num_experts=8, top_k=2),
          "OLMoE-like": dict(num_layers=16, num_experts=64, top_k=8)}
SKEWS = (0.8, 1.2)


@dataclass(frozen=True)
class _Expert:
    nbytes: int = 1  # one unit per expert: "bytes" fetched per token are experts


def replay_trace(trace: np.ndarray, policy: str, size_fraction: float, warmup: int = 0,
                 prefetch: bool = False, **options: float | bool) -> CacheStats:
    """Replays `trace` [T, L, K] through an ExpertCache of size_fraction x L x E experts, in
    decode order; with `prefetch`, affinity predictions for the next layer are fetched ahead.
    Stats count from token `warmup` on."""
    trace = check_trace(trace)
    num_tokens, num_layers, top_k = trace.shape
    num_experts = int(trace.max()) + 1
    capacity = max(1, round(size_fraction * num_layers * num_experts))
    cache = ExpertCache(capacity, 1, lambda key: _Expert(), make_policy(policy, **options))
    predictor = AffinityPredictor(num_layers, num_experts) if prefetch and num_layers > 1 else None
    for t, routing in enumerate(trace.tolist()):
        if t == warmup:
            cache.reset_stats()
        for layer_idx, expert_ids in enumerate(routing):
            if predictor is not None and layer_idx + 1 < num_layers:
                cache.predict(layer_idx + 1, *predictor.predict(layer_idx, expert_ids, top_k))
            cache.get(layer_idx, expert_ids)
            if predictor is not None:
                cache.prefetch(layer_idx + 1)
            cache.release()
        if predictor is not None:
            predictor.observe_token(trace[t])
        cache.next_token()
    return cache.stats


def belady_hit_rate(trace: np.ndarray, size_fraction: float, warmup: int = 0) -> float:
    """Hit rate of the offline optimum at the same size: on a miss with the cache full, evict
    the resident expert whose next use is furthest away."""
    trace = check_trace(trace)
    num_tokens, num_layers, _ = trace.shape
    capacity = max(1, round(size_fraction * num_layers * (int(trace.max()) + 1)))
    uses = [(layer_idx, e) for row in trace.tolist() for layer_idx, ids in enumerate(row) for e in ids]
    next_use, last_seen = [0] * len(uses), {}
    for i in range(len(uses) - 1, -1, -1):
        next_use[i] = last_seen.get(uses[i], len(uses))
        last_seen[uses[i]] = i
    resident: dict[ExpertKey, int] = {}  # key -> its next use
    furthest: list[tuple[int, ExpertKey]] = []  # max-heap of (-next use, key), stale entries skipped
    hits, first = 0, warmup * (len(uses) // num_tokens)
    for i, key in enumerate(uses):
        if key in resident:
            hits += i >= first
        elif len(resident) >= capacity:
            while resident.get((victim := heapq.heappop(furthest))[1]) != -victim[0]:
                pass
            del resident[victim[1]]
        resident[key] = next_use[i]
        heapq.heappush(furthest, (-next_use[i], key))
    return hits / max(len(uses) - first, 1)


def warm_belady_hit_rate(traces: list[np.ndarray], size_fraction: float) -> float:
    """belady_hit_rate over runs of one engine in turn (each [steps, layers, k]), hits counted after
    the first: the optimum of a cache as warm as the engine's is after its warm-up run. Replaying
    each run on an empty cache counts every expert's first use a miss, and reads more than the
    engine's own cache does."""
    return belady_hit_rate(np.concatenate(traces), size_fraction, warmup=len(traces[0]))


def uniform_belady_hit_rate(traces: list[np.ndarray], size_fraction: float, num_experts: int,
                            seed: int = 0) -> float:
    """warm_belady_hit_rate on routing of the traces' shapes drawn uniformly at random (k distinct
    experts of num_experts per layer step): how much of the clairvoyant bound is clairvoyance alone.
    On such routing no online cache hits more than size_fraction on average; Belady hits far more."""
    rng = np.random.default_rng(seed)
    uniform = [np.argsort(rng.random((*trace.shape[:2], num_experts)), axis=-1)[..., :trace.shape[2]]
               for trace in traces]
    return warm_belady_hit_rate(uniform, size_fraction)


def policy_hit_rates(trace: np.ndarray, sizes: list[float], warmup: int = 0,
                     half_life: float = 32.0) -> dict[str, dict[str, list[float]]]:
    """Both tables' numbers for one trace: the hook for traces recorded from the engine.

    {"demand": {column: [hit rate per size]}, "prefetch": {column: [...], column + " fetched":
    [experts fetched per token per size], "predictions right": [fraction per size]}}."""
    def run(policy: str, options: dict, size: float, prefetch: bool) -> CacheStats:
        options = {**options, "half_life_tokens": half_life} if policy == "score" else options
        return replay_trace(trace, policy, size, warmup, prefetch, **options)

    demand = {c: [run(*DEMAND[c], size, False).hit_rate for size in sizes] for c in DEMAND}
    demand["belady"] = [belady_hit_rate(trace, size, warmup) for size in sizes]
    prefetch: dict[str, list[float]] = {}
    for column, (policy, options) in PREFETCH.items():
        stats = [run(policy, options, size, True) for size in sizes]
        prefetch[column] = [s.hit_rate for s in stats]
        prefetch[f"{column} fetched"] = [s.bytes_per_token for s in stats]
    prefetch["predictions right"] = [s.prediction_precision for s in stats]  # the same for every policy
    return {"demand": demand, "prefetch": prefetch}


def print_tables(title: str, sizes: list[float], rates: dict[str, dict[str, list[float]]]) -> None:
    demand, prefetch = rates["demand"], rates["prefetch"]
    print(f"\n{title}\ndemand only: hit rate\n{'cache':>6}" + "".join(f"{c:>9}" for c in demand)
          + f"{'score-lru':>11}")
    for i, size in enumerate(sizes):
        print(f"{size:6.0%}" + "".join(f"{demand[c][i]:9.1%}" for c in demand)
              + f"{100 * (demand['score'][i] - demand['lru'][i]):+7.1f} pts")
    print(f"with affinity prefetch ({np.mean(prefetch['predictions right']):.0%} of predictions right): "
          f"hit rate (experts fetched per token)\n{'cache':>6}"
          + "".join(f"{c:>18}" for c in PREFETCH) + f"{'score-lru':>11}")
    for i, size in enumerate(sizes):
        print(f"{size:6.0%}" + "".join(f"{prefetch[c][i]:10.1%} ({prefetch[c + ' fetched'][i]:5.1f})"
                                       for c in PREFETCH)
              + f"{100 * (prefetch['score'][i] - prefetch['lru'][i]):+7.1f} pts")


def recorded_models() -> dict[str, Path]:
    """The MoE models whose routing is recorded, written once into the cache directory."""
    folder = cache_dir() / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    moefied, random = folder / "smollm2-moefied-8x2.gguf", folder / "random-mixtral-32x8x2.gguf"
    if not moefied.exists():
        print(f"writing {moefied} (about a minute) ...", file=sys.stderr)
        write_moe_from_dense(bundled_model_path(), moefied.with_suffix(".tmp"), 8, 2).rename(moefied)
    if not random.exists():
        write_model(random.with_suffix(".tmp"), RANDOM_MIXTRAL).rename(random)
    return {"SmolLM2 MoEfied (30 layers, 8 experts, top-2)": moefied,
            "random-weight Mixtral-style (32 layers, 8 experts, top-2)": random}


def record_trace(model: Path, text: str) -> np.ndarray:
    """The routing of `text` through `model`, token by token ([tokens, layers, top_k]); one
    forward pass, since each token routes as it would if decoded alone (test_moe checks it)."""
    with Engine.load(model, threads=2) as engine:
        ids = engine.tokenize(text)[:engine.context_length]
        with engine.record_routing() as recorder:
            engine.logits(ids)
    return recorder.trace()


def _mean(runs: list[dict]) -> dict:
    return {table: {c: np.mean([r[table][c] for r in runs], axis=0).tolist() for c in runs[0][table]}
            for table in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", nargs="*", default=[], help="saved traces (.npy) to replay, instead of "
                        "recording and synthetic ones")
    parser.add_argument("--no-synthetic", action="store_true", help="recorded traces only")
    parser.add_argument("--sizes", default="0.1,0.2,0.3,0.4,0.5,0.6", help="fractions of all experts")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--half-life", type=float, default=32.0, help="the score policy's, in tokens")
    parser.add_argument("--reuse", type=float, default=0.3)
    parser.add_argument("--affinity", type=float, default=0.3)
    parser.add_argument("--phase-tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    results = {}
    for path in args.trace:
        trace = load_trace(path)
        results[f"SAVED trace {path}, {trace.shape}"] = policy_hit_rates(trace, sizes, args.warmup,
                                                                         args.half_life)
    for name, model in ({} if args.trace else recorded_models()).items():
        trace = record_trace(model, TEXT.read_text())
        title = f"RECORDED from the engine: {name}, {TEXT.name}, {trace.shape[0]} tokens"
        results[title] = policy_hit_rates(trace, sizes, args.warmup, args.half_life)
    for shape, dims in ({} if args.trace or args.no_synthetic else SHAPES).items():
        for skew in SKEWS:
            traces = [make_synthetic_trace(SyntheticTraceSpec(
                num_tokens=args.tokens, zipf_s=skew, reuse=args.reuse, affinity=args.affinity,
                phase_tokens=args.phase_tokens, seed=int(seed), **dims)) for seed in args.seeds.split(",")]
            title = (f"SYNTHETIC {shape} ({dims['num_layers']} layers, {dims['num_experts']} experts, "
                     f"top-{dims['top_k']}): zipf {skew}, reuse {args.reuse}, affinity {args.affinity}, "
                     f"topic change every {args.phase_tokens} tokens; {args.tokens} tokens, "
                     f"mean of {len(traces)} seeds")
            results[title] = _mean([policy_hit_rates(t, sizes, args.warmup, args.half_life) for t in traces])
    if args.json:
        print(json.dumps({"sizes": sizes, "results": results}, indent=1))
        return
    for title, rates in results.items():
        print_tables(title, sizes, rates)


if __name__ == "__main__":
    main()
