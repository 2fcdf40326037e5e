"""The real GGUF files people download (tests/support/real_models.py): tierflow against llama.cpp on
each, in one run: decode and prefill tok/s, load time and a chat answer's time to first token.

    python -m benchmarks.real_models [--models qwen2.5-coder-0.5b ...] [--threads 2]
                                     [--prompt-tokens 512] [--decode-tokens 64] [--repeats 3]
                                     [--load-repeats 2] [--json]

Each file is fetched on first use (and kept in the test models' folder). Both systems run on the
same file, at the same thread count and context; llama.cpp at its best: the weights read into its
own buffers (`--no-mmap`), repacking on, its default f16 KV cache (tierflow's default is f16 too).
Every figure is shown against llama.cpp's, measured in the same run:
- load: the wall time of `Engine.load` and of llama.cpp's `Llama(...)` until each is ready to
  generate: the first load of the process (the page cache as the machine had it), then the median
  of --load-repeats later ones (the file now in the page cache), the two systems alternating;
- chat: the time to the first text piece of a greedy chat answer to a short user message, from
  the messages (the template rendered, the prompt tokenized and prefilled, the first token sampled
  and detokenized): `Engine.chat_stream` against llama-cpp-python's streamed
  `create_chat_completion` with the file's own template. The first chat after the load, then the
  median of --repeats with nothing reused from an earlier call's KV cache, alternating;
- decode and prefill: benchmarks/decode.py's `measure` on a --prompt-tokens prompt and
  --decode-tokens greedy decode steps (both warmed up, medians of --repeats, alternating).
A file without a chat template (Gemma 3 270M) chats with the built-in template named in
CHAT_TEMPLATES: `Engine.load(chat_template=NAME)` and llama-cpp-python's chat_format of that name.
Speed ratios are tierflow's over llama.cpp's (above 1: tierflow is faster); time ratios too
(above 1: tierflow is slower).
"""

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import torch

from benchmarks.decode import build_prompt, measure, open_llama_cpp, positive_int, summarize
from tests.support.real_models import REAL_MODELS, RealModel, fetch
from tierflow import Engine

# A file without a chat template: the built-in template to chat with, by tierflow's name and by
# llama-cpp-python's chat_format (the same name for both).
CHAT_TEMPLATES = {"gemma-3-270m": "gemma"}
CHAT_MESSAGES = [{"role": "user", "content": "Write a Python function that tells whether a number is prime."}]
CHAT_TOKENS = 8  # the most either system may generate for the chat figure; only the first piece is timed


def load_tierflow(path: Path, threads: int, context_length: int,
                  chat_template: str | None) -> tuple[Engine, float]:
    gc.collect()  # the previous load's memory back first (an engine's objects hold cycles)
    options = {"chat_template": chat_template} if chat_template else {}
    started = time.perf_counter()
    engine = Engine.load(path, threads=threads, context_length=context_length, **options)
    return engine, time.perf_counter() - started


def load_llama_cpp(path: Path, threads: int, context_length: int,
                   chat_template: str | None) -> tuple[llama_cpp.Llama, float]:
    gc.collect()
    started = time.perf_counter()
    llama = open_llama_cpp(path, threads, context_length, use_mmap=False)
    load_s = time.perf_counter() - started
    if chat_template:
        llama.chat_format = chat_template  # read by create_chat_completion at each call
    return llama, load_s


def measure_loads(path: Path, threads: int, context_length: int, chat_template: str | None,
                  repeats: int) -> tuple[Engine, llama_cpp.Llama, dict]:
    """Each system's first load, then `repeats` later ones alternating which goes first; the last
    of each is kept, every other closed before the next load."""
    loaders = {"tierflow": load_tierflow, "llama.cpp": load_llama_cpp}
    kept: dict = {}
    times: dict[str, list[float]] = {name: [] for name in loaders}
    order = list(loaders)
    for _ in range(1 + repeats):
        for name in order:
            if name in kept:
                kept.pop(name).close()
            kept[name], load_s = loaders[name](path, threads, context_length, chat_template)
            times[name].append(load_s)
        order.reverse()
    figures = {name: {"first_s": runs[0], "later_s": statistics.median(runs[1:]),
                      "later_runs_s": runs[1:]} for name, runs in times.items()}
    return kept["tierflow"], kept["llama.cpp"], figures


def tierflow_first_piece(engine: Engine, reset_id: int | None) -> dict:
    """The seconds from the messages to the first non-empty piece of a greedy chat answer; with
    reset_id, one pass over that token first so the KV cache shares no prefix with the prompt."""
    if reset_id is not None:
        engine.logits([reset_id])
    started = time.perf_counter()
    stream = engine.chat_stream(CHAT_MESSAGES, max_tokens=CHAT_TOKENS, temperature=0)
    try:
        piece = next((p for p in stream if p), "")
        seconds = time.perf_counter() - started
        stats = stream.stats
        if stats.cached_prompt_tokens:
            raise RuntimeError(f"tierflow reused {stats.cached_prompt_tokens} cached prompt tokens")
        return {"seconds": seconds, "prompt_tokens": stats.prompt_tokens, "piece": piece,
                "first_id": stream.prompt_ids[0]}
    finally:
        stream.close()


def llama_cpp_first_piece(llama: llama_cpp.Llama) -> dict:
    """The same for llama.cpp's streamed chat completion, its KV cache emptied first; the tokens it
    had evaluated when the piece came (the prompt's, if it came with the first generated token)."""
    llama.reset()  # nothing of an earlier prompt is reused
    started = time.perf_counter()
    chunks = llama.create_chat_completion(CHAT_MESSAGES, max_tokens=CHAT_TOKENS, temperature=0, stream=True)
    try:
        piece = next((c["choices"][0]["delta"].get("content") for c in chunks
                      if c["choices"][0]["delta"].get("content")), "")
        return {"seconds": time.perf_counter() - started, "prompt_tokens": llama.n_tokens, "piece": piece}
    finally:
        chunks.close()


def measure_chat(engine: Engine, llama: llama_cpp.Llama, repeats: int) -> dict:
    """The first chat after the load (nothing in either KV cache yet), then `repeats` cold chats
    alternating which system goes first."""
    ours = [tierflow_first_piece(engine, None)]
    first_id = ours[0]["first_id"]
    runners: dict[str, Callable[[], dict]] = {
        "tierflow": lambda: tierflow_first_piece(engine, 1 if first_id == 0 else 0),
        "llama.cpp": lambda: llama_cpp_first_piece(llama),
    }
    runs = {"tierflow": ours, "llama.cpp": [runners["llama.cpp"]()]}
    order = list(runners)
    for _ in range(repeats):
        for name in order:
            runs[name].append(runners[name]())
        order.reverse()
    return {name: {"first_s": samples[0]["seconds"],
                   "later_s": statistics.median(s["seconds"] for s in samples[1:]),
                   "later_runs_s": [s["seconds"] for s in samples[1:]],
                   "prompt_tokens": samples[-1]["prompt_tokens"], "first_piece": samples[-1]["piece"]}
            for name, samples in runs.items()}


def measure_model(model: RealModel, args: argparse.Namespace) -> dict:
    path = fetch(model)
    chat_template = CHAT_TEMPLATES.get(model.name)
    # Room for the prompt, the first token and every decode step (decode.py's), and for the chat.
    context_length = max(args.prompt_tokens + args.decode_tokens + 2, 256)
    engine, llama, loads = measure_loads(path, args.threads, context_length, chat_template, args.load_repeats)
    try:
        chat = measure_chat(engine, llama, args.repeats)
        prompt_ids = build_prompt(engine, args.prompt_tokens)
        speed = summarize(measure(engine, llama, prompt_ids, args.decode_tokens, args.repeats),
                          args.decode_tokens)
        weight_bytes = sum(engine.weights.bytes_by_tier().values())
    finally:
        engine.close()
        llama.close()
    notes = list(speed.pop("notes"))
    if chat_template:
        notes.append(f"the file has no chat template: both chat with the built-in {chat_template!r}")
    if chat["tierflow"]["prompt_tokens"] != chat["llama.cpp"]["prompt_tokens"]:
        notes.append(f"chat prompts differ: tierflow {chat['tierflow']['prompt_tokens']} tokens, llama.cpp "
                     f"had evaluated {chat['llama.cpp']['prompt_tokens']} at its first piece")
    return {
        "model": model.name, "file": path.name, "file_bytes": path.stat().st_size,
        "tierflow_weight_bytes": weight_bytes, "context_length": context_length,
        "chat_template": chat_template or "the file's", **speed,
        "load": loads, "chat": chat,
        "load_ratio": _ratio(loads, "later_s"), "chat_ratio": _ratio(chat, "later_s"),
        "notes": notes,
    }


def _ratio(figures: dict, key: str) -> float:
    theirs = figures["llama.cpp"][key]
    return figures["tierflow"][key] / theirs if theirs else float("nan")


def print_report(report: dict) -> None:
    print(f"{report['model']}: {report['file']} ({report['file_bytes'] / 2**20:.0f} MiB file; tierflow "
          f"holds {report['tierflow_weight_bytes'] / 2**20:.0f} MiB of weights), context "
          f"{report['context_length']}, chat template: {report['chat_template']}")
    print(f"{'system':<20}{'prefill tok/s':>14}{'decode tok/s':>14}{'load s':>9}{'1st load':>10}"
          f"{'chat TTFT s':>13}{'1st chat':>10}{'chat prompt':>13}")
    for name in ("tierflow", "llama.cpp"):
        speed, load, chat = report["systems"][name], report["load"][name], report["chat"][name]
        print(f"{name:<20}{speed['prefill_tokens_per_s']:>14.1f}{speed['decode_tokens_per_s']:>14.1f}"
              f"{load['later_s']:>9.3f}{load['first_s']:>10.3f}{chat['later_s']:>13.3f}"
              f"{chat['first_s']:>10.3f}{chat['prompt_tokens']:>13}")
    ratio = report["ratio"]
    print(f"{'tierflow/llama.cpp':<20}{ratio['prefill_tokens_per_s']:>13.2f}x"
          f"{ratio['decode_tokens_per_s']:>13.2f}x{report['load_ratio']:>8.2f}x{'':>10}"
          f"{report['chat_ratio']:>12.2f}x")
    for note in report["notes"]:
        print(f"  note: {note}")


def print_summary(reports: list[dict]) -> None:
    print("tierflow/llama.cpp (speeds above 1: tierflow faster; times above 1: tierflow slower)")
    print(f"{'model':<22}{'prefill':>9}{'decode':>9}{'load':>9}{'chat TTFT':>11}")
    for r in reports:
        print(f"{r['model']:<22}{r['ratio']['prefill_tokens_per_s']:>8.2f}x{r['ratio']['decode_tokens_per_s']:>8.2f}x"
              f"{r['load_ratio']:>8.2f}x{r['chat_ratio']:>10.2f}x")


def parse_args(argv: list[str]) -> argparse.Namespace:
    names = [m.name for m in REAL_MODELS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=names, default=names, metavar="NAME",
                        help=f"the files to run (default: all of {', '.join(names)})")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--prompt-tokens", type=positive_int, default=512)
    parser.add_argument("--decode-tokens", type=positive_int, default=64,
                        help="decode steps after the first generated token")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs of prefill, decode, chat")
    parser.add_argument("--load-repeats", type=positive_int, default=2, help="loads after the first, each")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    models = [m for m in REAL_MODELS if m.name in args.models]
    settings = {"threads": args.threads, "torch_threads": torch.get_num_threads(),
                "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                "repeats": args.repeats, "load_repeats": args.load_repeats, "statistic": "median"}
    if not args.json:
        print(f"threads: {args.threads} (torch threads: {settings['torch_threads']}); prompt "
              f"{args.prompt_tokens} tokens, {args.decode_tokens} decode steps, median of {args.repeats} "
              f"(loads: the first, then the median of {args.load_repeats} more); llama.cpp --no-mmap, "
              f"repacking on, f16 KV cache as tierflow's", flush=True)
    reports = []
    for model in models:
        reports.append(measure_model(model, args))
        if not args.json:
            print_report(reports[-1])
            print(flush=True)
    if args.json:
        print(json.dumps({**settings, "models": reports}, indent=2))
    else:
        print_summary(reports)


if __name__ == "__main__":
    main()
