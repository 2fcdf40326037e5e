"""Speculative decoding: greedy decode tokens/s with and without a draft, same prompts, one run.

    python benchmarks/speculative.py [--model PATH] [--threads 2] [--tokens 128] [--repeats 3]

For each prompt, the target alone and the target with prompt-lookup guesses (draft="ngram")
generate the same greedy tokens (checked); the script prints the speed-up and the tokens per
target pass (1 + accepted guesses per pass). The runs alternate and the median is reported.
Draft models (another GGUF or a low-bit conversion) are not supported yet.
"""

import argparse
import statistics

from tierflow import Engine

PROMPTS = {
    "open prose": "The sky is blue because",
    "repeats itself": "The capital of France is",
    "code": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "summary of a text": ("Summarise: The river valley was settled slowly over many generations. Farmers "
                          "cleared the lower terraces first, then built stone walls to hold the soil "
                          "against the spring floods.\nSummary: The river valley"),
}


def decode_rate(engine: Engine, prompt: str, tokens: int) -> tuple[float, list[int], float]:
    stats = (result := engine.generate(prompt, max_tokens=tokens, temperature=0)).stats
    passes = stats.decode_steps
    return stats.decode_tokens_per_s, result.tokens, (passes + stats.accepted_tokens) / max(passes, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    options = dict(threads=args.threads, context_length=1024)
    with Engine.load(args.model, **options) as target, \
            Engine.load(args.model, draft="ngram", **options) as speculating:
        target.generate("warm up", max_tokens=4, temperature=0)
        speculating.generate("warm up", max_tokens=4, temperature=0)
        print(f"{'prompt':<20} {'target tok/s':>12} {'+ ngram tok/s':>13} {'speed-up':>8} "
              f"{'tokens/pass':>11}")
        for name, prompt in PROMPTS.items():
            plain, fast, per_pass = [], [], 0.0
            for _ in range(args.repeats):
                rate, expected, _ = decode_rate(target, prompt, args.tokens)
                plain.append(rate)
                rate, tokens, per_pass = decode_rate(speculating, prompt, args.tokens)
                fast.append(rate)
                assert tokens == expected, f"{name}: speculation changed the output"
            base, sped = statistics.median(plain), statistics.median(fast)
            ratio = f"{sped / base:>7.2f}x" if base else f"{'-':>8}"  # ended at the first token
            print(f"{name:<20} {base:>12.1f} {sped:>13.1f} {ratio} {per_pass:>11.2f}")


if __name__ == "__main__":
    main()
