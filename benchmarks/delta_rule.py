"""The prefill of a long prompt through one Gated DeltaNet layer's recurrence at Qwen3.5's layer shape
(32 value heads of 128, keys of 128): what a prefill chunk runs on the CPU (`delta_rule.long_pass`:
the C kernels' token loop) and the chunked form of torch matrix products (what it runs on a GPU),
each against the token-by-token reference in torch (`step_in_torch` per token), all in the same run.

    python -m benchmarks.delta_rule [--tokens 4096] [--heads 32] [--dim 128] [--reference-tokens 512]
                                    [--threads N] [--json]

The reference runs `--reference-tokens` tokens (its cost per token is the same at any length) and is
scaled to `--tokens`; the others run all of them; each the fastest of `--repeats` runs. All start from
a random state and give the same outputs up to float rounding (printed). Goal (issue 19): a long
prompt's recurrence at least 10x faster than the token-by-token reference.

The bound: every form does at least 6 Dk Dv floating-point operations per token and head (two reads
of the state, k^T S and q^T S, and its rank-one update; the chunked form does more, its triangular
solves and in-chunk products besides), so none can beat those operations at the machine's float32
matrix-product rate, measured in the same run (torch's GEMM of two 2048 x 2048 matrices at
`--threads`). Where that bound is under 10x the reference, the goal is out of this machine's reach.
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F

from tierflow.cpu_kernels.matmul import set_threads
from tierflow.runtime.compute import delta_rule


def inputs(tokens: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """A prompt's queries, keys (L2-normed), values, decays and strengths, and a starting state."""
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    q, k = (F.normalize(normal(tokens, heads, dim), dim=-1) for _ in range(2))
    v = normal(tokens, heads, dim)
    g = -torch.rand(tokens, heads, generator=generator) * 0.5
    beta = torch.rand(tokens, heads, generator=generator)
    return normal(heads, dim, dim) * 0.1, q, k, v, g, beta


def seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def gemm_flops_per_s(repeats: int, size: int = 2048) -> float:
    """torch's float32 matrix-product rate: the fastest of `repeats` products of two size x size matrices."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size ** 3 / seconds(lambda: a @ b, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reference-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_threads(args.threads)
    state, q, k, v, g, beta = inputs(args.tokens, args.heads, args.dim)
    n = min(args.reference_tokens, args.tokens)

    def reference_loop(tokens: int) -> torch.Tensor:
        s, outs = state, []
        for t in range(tokens):
            out, s = delta_rule.step_in_torch(s, q[t], k[t], v[t], g[t], beta[t])
            outs.append(out)
        return torch.stack(outs)

    with torch.inference_mode():
        times = {"kernels": seconds(lambda: delta_rule.stepwise(state, q, k, v, g, beta), args.repeats),
                 "chunked": seconds(lambda: delta_rule.chunked(state, q, k, v, g, beta), args.repeats),
                 "reference": seconds(lambda: reference_loop(n), args.repeats) * args.tokens / n}
        expected, first = reference_loop(n), (state, q[:n], k[:n], v[:n], g[:n], beta[:n])
        differences = {name: float((run(*first)[0] - expected).abs().max())
                       for name, run in (("kernels", delta_rule.stepwise), ("chunked", delta_rule.chunked))}
    peak = gemm_flops_per_s(args.repeats)
    times["bound"] = 6 * args.dim * args.dim * args.heads * args.tokens / peak
    result = {"tokens": args.tokens, "heads": args.heads, "dim": args.dim, "threads": args.threads,
              "gemm_gflops": round(peak / 1e9, 1), **{f"{name}_s": round(t, 4) for name, t in times.items()},
              **{f"{name}_speedup": round(times["reference"] / times[name], 2)
                 for name in [*differences, "bound"]},
              **{f"{name}_max_output_difference": d for name, d in differences.items()}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.tokens} tokens x {args.heads} heads of {args.dim}, {args.threads} threads; token by token "
          f"in torch {times['reference'] * 1e3:.0f} ms (from {n} tokens)")
    labels = {"kernels": "C kernels' token loop (CPU prefill)", "chunked": "chunked form (torch)"}
    for name, label in labels.items():
        print(f"  {label:<38} {times[name] * 1e3:6.0f} ms ({args.tokens / times[name]:.0f} tok/s): "
              f"{result[name + '_speedup']:.2f}x the reference; outputs differ by at most "
              f"{differences[name]:.1e}")
    print(f"  bound at {peak / 1e9:.0f} GFLOP/s (torch's float32 GEMM) {times['bound'] * 1e3:6.0f} ms: "
          f"{result['bound_speedup']:.2f}x the reference; no form can do better on this machine")


if __name__ == "__main__":
    main()
