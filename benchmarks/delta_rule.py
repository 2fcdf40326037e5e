"""The prefill of a long prompt through one Gated DeltaNet layer's recurrence: the chunked form
against the token-by-token reference, both in the same run at Qwen3.5's layer shape (32 value heads
of 128, keys of 128).

    python -m benchmarks.delta_rule [--tokens 4096] [--heads 32] [--dim 128] [--reference-tokens 512]
                                    [--threads N] [--json]

The reference runs `--reference-tokens` tokens (its cost per token is the same at any length) and is
scaled to `--tokens`; the chunked form runs all of them; each the fastest of `--repeats` runs. Both
start from a random state and give the same outputs up to float rounding (printed). Goal (issue 19):
the chunked form at least 10x faster.
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F

from tierflow.runtime import delta_rule


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
    state, q, k, v, g, beta = inputs(args.tokens, args.heads, args.dim)
    with torch.inference_mode():
        chunked = seconds(lambda: delta_rule.chunked(state, q, k, v, g, beta), args.repeats)
        n = min(args.reference_tokens, args.tokens)
        reference = seconds(lambda: delta_rule.stepwise(state, q[:n], k[:n], v[:n], g[:n], beta[:n]),
                            args.repeats)
        reference *= args.tokens / n
        out_chunked, _ = delta_rule.chunked(state, q[:n], k[:n], v[:n], g[:n], beta[:n])
        out_reference, _ = delta_rule.stepwise(state, q[:n], k[:n], v[:n], g[:n], beta[:n])
    result = {"tokens": args.tokens, "heads": args.heads, "dim": args.dim, "threads": args.threads,
              "chunked_s": round(chunked, 4), "token_by_token_s": round(reference, 4),
              "speedup": round(reference / chunked, 2),
              "max_output_difference": float((out_chunked - out_reference).abs().max())}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.tokens} tokens x {args.heads} heads of {args.dim}, {args.threads} threads: chunked "
          f"{chunked * 1e3:.0f} ms ({args.tokens / chunked:.0f} tok/s), token by token "
          f"{reference * 1e3:.0f} ms "
          f"(from {n} tokens): {result['speedup']:.2f}x; outputs differ by at most "
          f"{result['max_output_difference']:.1e}")


if __name__ == "__main__":
    main()
