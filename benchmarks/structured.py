"""What structured output costs: decode tok/s constrained by a JSON schema against unconstrained.

    python -m benchmarks.structured [--model PATH] [--rounds 5] [--threads 2]

Each round generates twice, alternating: a list of people constrained by SCHEMA (about 165
tokens), then a story unconstrained for as many tokens (a prompt of about the same length whose
answer runs longer: the same positions decoded), so a busy machine slows both alike. Printed: each
setting's median decode tok/s over the rounds, their ratio (the goal: constrained within 10%), and
the grammar's own time per token (mask and matcher, measured around GrammarMatcher.mask) against
a decode step.
"""

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tierflow import Engine
from tierflow.runtime.sampling.structured import GrammarMatcher

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "city": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 8, "maxItems": 8}},
    "required": ["people"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "List eight people with their city and age, as JSON."}]
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA, "strict": True}}


@contextmanager
def timed_masks() -> Iterator[list[float]]:
    """The seconds each GrammarMatcher.mask call takes, while the block runs."""
    seconds, mask = [], GrammarMatcher.mask

    def timed(self, logits, history) -> None:
        started = time.perf_counter()
        mask(self, logits, history)
        seconds.append(time.perf_counter() - started)

    GrammarMatcher.mask = timed
    try:
        yield seconds
    finally:
        GrammarMatcher.mask = mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with Engine.load(args.model, threads=args.threads, context_length=1024) as engine:
        engine.chat(ASK, max_tokens=8, response_format=FORMAT, temperature=0)  # builds the token table
        constrained, free, step_seconds = [], [], []
        with timed_masks() as mask_seconds:
            for _ in range(args.rounds):
                shaped = engine.chat(ASK, max_tokens=400, response_format=FORMAT, temperature=0)
                plain = engine.chat(STORY, max_tokens=len(shaped.tokens), temperature=0)
                assert len(plain.tokens) == len(shaped.tokens), "the story ended early: compare fewer tokens"
                constrained.append(shaped.stats.decode_tokens_per_s)
                free.append(plain.stats.decode_tokens_per_s)
                step_seconds.append(plain.stats.decode_seconds / max(plain.stats.decode_steps, 1))
        report(len(shaped.tokens), statistics.median(constrained), statistics.median(free),
               statistics.median(mask_seconds), statistics.median(step_seconds))


def report(num_tokens: int, constrained: float, free: float, mask_s: float, step_s: float) -> None:
    print(f"{num_tokens} tokens per answer, median of the rounds")
    print(f"unconstrained  {free:7.1f} tok/s")
    print(f"json_schema    {constrained:7.1f} tok/s")
    print(f"ratio          {constrained / free:7.3f} (goal >= 0.90)")
    print(f"grammar        {mask_s * 1e3:7.3f} ms per token, {mask_s / step_s:.1%} of a "
          f"{step_s * 1e3:.1f} ms decode step")


if __name__ == "__main__":
    main()
