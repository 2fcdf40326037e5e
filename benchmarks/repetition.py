"""Does a sampling setting make the model repeat itself? Chat answers under several settings.

    python -m benchmarks.repetition [--model PATH] [--tokens 256] [--seeds 3] [--threads 2]

Each setting answers the same chat prompts (PROMPTS) once per seed, up to --tokens tokens. An
answer's repetition is the share of its 4-token sequences that already occurred earlier in it
(0 for fresh text; a loop drives it towards 1); an answer is degenerate when more than half of
its last 64 tokens repeat an earlier 4-gram. The table gives, per setting, the mean repetition
and how many answers degenerated, to choose the default sampling of models whose file
recommends none (`general.sampling.*`).
"""

import argparse
import statistics

from tierflow import Engine

PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how a refrigerator works.",
    "Write a short poem about autumn.",
    "What are the benefits of learning a second language?",
    "Describe your ideal weekend.",
    "Give me some tips for staying focused while studying.",
]
SETTINGS = {
    "0.8 k40 p.95 m.05": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0),
    "0.8 k40 p.95 m.1": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.1, repeat_penalty=1.0),
    "0.8 k40 p.9 m.1": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.1, repeat_penalty=1.0),
    "0.7 k40 p.9 m.1": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.1, repeat_penalty=1.0),
    "0.8 k40 p.95 m.05 rp1.1": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1),
    "greedy": dict(temperature=0.0),
}
NGRAM = 4
TAIL = 64


def repeated_share(tokens: list[int]) -> float:
    """The share of 4-grams in `tokens` that occurred earlier in it."""
    seen, repeats, total = set(), 0, 0
    for i in range(len(tokens) - NGRAM + 1):
        gram = tuple(tokens[i:i + NGRAM])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else 0.0


def degenerate(tokens: list[int]) -> bool:
    """Whether most of the answer's last TAIL tokens repeat 4-grams seen before them."""
    if len(tokens) < 2 * TAIL:
        return False
    earlier = {tuple(tokens[i:i + NGRAM]) for i in range(len(tokens) - TAIL - NGRAM + 1)}
    tail = [tuple(tokens[i:i + NGRAM]) for i in range(len(tokens) - TAIL, len(tokens) - NGRAM + 1)]
    return sum(gram in earlier for gram in tail) > len(tail) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with Engine.load(args.model, threads=args.threads) as engine:
        print(f"{len(PROMPTS)} prompts x {args.seeds} seeds, up to {args.tokens} tokens each")
        print(f"{'setting':22} {'repetition':>10} {'degenerate':>10} {'tokens':>7}")
        for name, settings in SETTINGS.items():
            seeds = range(1 if settings["temperature"] == 0 else args.seeds)
            answers = [engine.chat([{"role": "user", "content": prompt}], max_tokens=args.tokens, seed=seed,
                                   **settings).tokens for prompt in PROMPTS for seed in seeds]
            print(f"{name:22} {statistics.mean(map(repeated_share, answers)):10.3f} "
                  f"{sum(map(degenerate, answers)):>5} / {len(answers):<3} "
                  f"{statistics.mean(map(len, answers)):7.0f}")


if __name__ == "__main__":
    main()
