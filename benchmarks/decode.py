"""Prefill and decode tokens/s: tierflow against llama.cpp on the same GGUF file, in one run.

    python -m benchmarks.decode [--model PATH] [--threads 2] [--prompt-tokens 512]
                                [--decode-tokens 64] [--repeats 3] [--json]

Both systems get the same prompt ids, the same thread count and the same number of decode steps
(greedy). Both models are loaded and warmed up once before anything is timed; each repeat then
runs both, alternating which goes first so that machine noise hits both, and the median of the
repeats is reported.

What is timed, for both:
- prefill: the forward pass over the whole prompt, with nothing reused from an earlier call;
- decode: `--decode-tokens` single-token forward passes plus the argmax of each step's logits
  (the first generated token comes from the prefill pass and is not counted as a decode step).
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import torch

from tierflow import Engine

# Prose that does not come to a natural end: the prompt is cut mid-sentence and the model keeps
# writing, so greedy decoding rarely meets an end-of-generation token within the decode budget.
PROMPT_PARAGRAPH = (
    "Section {index}. The river valley was settled slowly over many generations. Farmers cleared "
    "the lower terraces first, then built stone walls to hold the soil against the spring floods. "
    "Each village kept careful records of its harvests, its weather and its disputes, and the "
    "archives that survive describe markets, festivals, droughts, new roads and the long trade "
    "with the towns on the coast, where salt, wool and iron tools changed hands every autumn and "
)


@dataclass
class Sample:
    """One timed run of one system."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_steps: int  # single-token forward passes actually timed
    tokens: list[int]  # generated ids, the first one from the prefill pass


def build_prompt(engine: Engine, num_tokens: int) -> list[int]:
    """Exactly num_tokens prompt ids, cut from as many numbered paragraphs as it takes."""
    ids: list[int] = []
    index = 1
    while len(ids) < num_tokens:
        text = "".join(PROMPT_PARAGRAPH.format(index=i) for i in range(1, index + 1))
        ids = engine.tokenize(text)
        index *= 2
    return ids[:num_tokens]


def run_tierflow(engine: Engine, prompt_ids: list[int], decode_steps: int) -> Sample:
    # Feeding one token that differs from the prompt's first leaves no shared prefix in the KV
    # cache, so the whole prompt is prefilled again.
    engine.logits([1 if prompt_ids[0] == 0 else 0])
    result = engine.generate(prompt_ids, max_tokens=decode_steps + 1, temperature=0)
    stats = result.stats
    if stats.cached_prompt_tokens:
        raise RuntimeError(f"tierflow reused {stats.cached_prompt_tokens} cached prompt tokens")
    # Ending on an end-of-generation token still ran a forward pass for the token that produced
    # it; stats.decode_tokens_per_s counts generated tokens only, so count the passes here.
    steps = stats.generated_tokens if result.finish_reason == "stop" else stats.generated_tokens - 1
    return Sample(
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        decode_tokens_per_s=steps / stats.decode_seconds if stats.decode_seconds else 0.0,
        decode_steps=steps,
        tokens=list(result.tokens),
    )


def open_llama_cpp(path: Path, threads: int, context_length: int, *,
                   use_mmap: bool = True) -> llama_cpp.Llama:
    """llama.cpp on the file with `threads` threads for single tokens and prompt batches alike,
    512-token batches, its default f16 KV cache and weight repacking; use_mmap=False reads the
    weights into its own buffers (`--no-mmap`) instead of mapping the file."""
    return llama_cpp.Llama(str(path), n_ctx=context_length, n_batch=512, n_threads=threads,
                           n_threads_batch=threads, verbose=False, use_mmap=use_mmap)


def run_llama_cpp(llama: llama_cpp.Llama, prompt_ids: list[int], decode_steps: int) -> Sample:
    llama.reset()  # eval() then overwrites the KV cache from position 0
    started = time.perf_counter()
    llama.eval(prompt_ids)
    prefill_seconds = time.perf_counter() - started
    # End-of-generation tokens are not special here: the argmax is fed back whatever it is, so
    # exactly decode_steps passes run.
    started = time.perf_counter()
    tokens = [_argmax_last(llama)]
    for _ in range(decode_steps):
        llama.eval(tokens[-1:])
        tokens.append(_argmax_last(llama))
    decode_seconds = time.perf_counter() - started
    return Sample(
        prefill_tokens_per_s=len(prompt_ids) / prefill_seconds,
        decode_tokens_per_s=decode_steps / decode_seconds,
        decode_steps=decode_steps,
        tokens=tokens,  # decode_steps + 1 ids, the last never fed back, as in tierflow
    )


def _argmax_last(llama: llama_cpp.Llama) -> int:
    # Without logits_all, llama-cpp-python's eval() keeps no scores; read the context's last row.
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama.ctx, -1),
                                   shape=(llama.n_vocab(),))
    return int(np.argmax(logits))


def measure(engine: Engine, llama: llama_cpp.Llama, prompt_ids: list[int], decode_steps: int,
            repeats: int) -> dict[str, list[Sample]]:
    """Warms both systems up once, then runs both in every repeat, alternating the order."""
    runners = {
        "tierflow": lambda: run_tierflow(engine, prompt_ids, decode_steps),
        "llama.cpp": lambda: run_llama_cpp(llama, prompt_ids, decode_steps),
    }
    for run in runners.values():
        run()
    samples: dict[str, list[Sample]] = {name: [] for name in runners}
    order = list(runners)
    for _ in range(repeats):
        for name in order:
            samples[name].append(runners[name]())
        order.reverse()
    return samples


def summarize(samples: dict[str, list[Sample]], decode_steps: int) -> dict:
    """Medians per system, the tierflow/llama.cpp ratios, and notes on anything uneven."""
    systems = {}
    for name, runs in samples.items():
        systems[name] = {
            "prefill_tokens_per_s": statistics.median(s.prefill_tokens_per_s for s in runs),
            "decode_tokens_per_s": statistics.median(s.decode_tokens_per_s for s in runs),
            "runs": [{k: v for k, v in asdict(s).items() if k != "tokens"} for s in runs],
        }
    ours, theirs = systems["tierflow"], systems["llama.cpp"]
    ratio = {key: ours[key] / theirs[key] if theirs[key] else float("nan")
             for key in ("prefill_tokens_per_s", "decode_tokens_per_s")}
    notes = []
    short = min(s.decode_steps for s in samples["tierflow"])
    if short < decode_steps:
        notes.append(f"tierflow stopped early on an end-of-generation token after {short} of "
                     f"{decode_steps} decode steps; its decode tok/s is over the steps it ran")
    agree = _common_prefix(samples["tierflow"][-1].tokens, samples["llama.cpp"][-1].tokens)
    notes.append(f"greedy tokens agree for the first {agree} of {decode_steps + 1} generated")
    return {"systems": systems, "ratio": ratio, "notes": notes}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_table(report: dict) -> None:
    print(f"model: {report['model']} ({report['model_file_bytes'] / 2**20:.0f} MiB file; tierflow "
          f"holds {report['tierflow_weight_bytes'] / 2**20:.0f} MiB of weights)")
    print(f"threads: {report['threads']} (torch threads: {report['torch_threads']}); prompt "
          f"{report['prompt_tokens']} tokens, {report['decode_tokens']} decode steps; "
          f"median of {report['repeats']} repeats")
    print(f"{'system':<20}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, figures in report["systems"].items():
        print(f"{name:<20}{figures['prefill_tokens_per_s']:>15.1f}"
              f"{figures['decode_tokens_per_s']:>15.1f}")
    ratio = report["ratio"]
    print(f"{'tierflow/llama.cpp':<20}{ratio['prefill_tokens_per_s']:>14.2f}x"
          f"{ratio['decode_tokens_per_s']:>14.2f}x")
    for note in report["notes"]:
        print(f"note: {note}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: bundled SmolLM2-135M)")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--prompt-tokens", type=positive_int, default=512)
    parser.add_argument("--decode-tokens", type=positive_int, default=64,
                        help="decode steps after the first generated token")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Room for the prompt, the first token and every decode step, identical for both systems.
    context_length = args.prompt_tokens + args.decode_tokens + 2
    engine = Engine.load(args.model, threads=args.threads, context_length=context_length)
    llama = open_llama_cpp(engine.path, args.threads, context_length)
    prompt_ids = build_prompt(engine, args.prompt_tokens)
    samples = measure(engine, llama, prompt_ids, args.decode_tokens, args.repeats)
    report = {
        "model": engine.path.name,
        "model_file_bytes": engine.path.stat().st_size,
        "tierflow_weight_bytes": sum(engine.weights.bytes_by_tier().values()),
        "threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "statistic": "median",
        **summarize(samples, args.decode_tokens),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
