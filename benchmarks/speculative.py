"""Speculative decoding: greedy decode tokens/s with and without a draft, same prompts, one run.

    python -m benchmarks.speculative [--threads 2] [--tokens 96] [--cases resident,streamed,f32,fresh,real]

Five settings, each against the same target without a draft, in this run:
- resident: the bundled SmolLM2-135M-Instruct (Q4_1) in RAM; drafts: prompt lookup ("ngram"),
  its own 3-bit conversion (`tierflow convert --bits 3`, made here once) as a chain and a tree,
  and "auto" (prompt lookup or the self-draft).
- streamed: the same target with three quarters of its layers streamed from disk (a quarter of
  the layer bytes resident beside the embeddings), the draft resident beside it as extra memory
  (as a GPU-hosted draft's would be); also the target alone given that extra memory.
- f32: a bigger target, the same model dequantized to F32 (515 MiB, written here once by
  tests/support/make_model.py), streamed the same way, with the bundled Q4_1 model as its draft: the
  low-bit self-draft of an offloaded model, SpecExec's setting. Both streamed settings also run
  "self" (the target's own first layers, within the target's budget) and "auto:DRAFT".
- fresh: the f32 setting as a user meets it: each prompt on a freshly loaded engine, the first
  --first tokens and the --then tokens after them (a second generation continuing the first)
  reported apart, as the geometric mean over the prompts of the speed-up over the target alone,
  with tokens per pass, the draft's and the target's seconds and the share of the draft's time
  hidden under the target's reads. Before each load the pair's learned prior is removed (a first
  load ever) unless --keep-learned.
- real: a real pair, Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) with Qwen2.5-Coder-0.5B-Instruct (Q5_0,
  the same vocabulary) as its draft (tests/support/real_models.py fetches both), resident and with
  a third of the target's weights in RAM (the draft's memory beside it); each of three chat
  prompts (code, prose, a list) on a fresh engine per draft, whatever the pair learned before
  removed, its first --tokens greedy tokens; each draft's speed-up with the one the load predicted
  (its notice), tokens per pass, draft and verify seconds.
Every run's tokens are checked equal to the target's own. The figures of the first three are the
median of --repeats runs after two warm-up generations (from which the tree sizing starts
learning).
"""

import argparse
import math
import statistics
from pathlib import Path

from tests.support.budgets import ram_beside_weights
from tests.support.make_model import write_f32_copy
from tests.support.real_models import QWEN_CODER_05B, QWEN_CODER_15B, fetch
from tierflow import Engine
from tierflow.offload.gguf.convert import convert_model
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan.profile import cache_dir
from tierflow.offload.store.model_path import resolve_model_path
from tierflow.speculative.learned import LearnedStore
from tierflow.units import format_size

CONTEXT = 1024
PROMPTS = {
    "open prose": "The sky is blue because",
    "code": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "summary of a text": ("Summarise: The river valley was settled slowly over many generations. Farmers "
                          "cleared the lower terraces first, then built stone walls to hold the soil "
                          "against the spring floods.\nSummary: The river valley"),
}


def bench_files() -> tuple[Path, Path, Path]:
    """The bundled target, its 3-bit conversion and its F32 copy (made once, cached)."""
    folder = cache_dir() / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    target = resolve_model_path(None)
    three_bit = folder / "smollm2-3bit.gguf"
    if not three_bit.exists():
        convert_model(None, three_bit, 3, "search")
    f32 = folder / "smollm2-f32.gguf"
    if not f32.exists():
        write_f32_copy(target, f32)
    return target, three_bit, f32


def resident_share_budget(model: Path, share: float = 0.25) -> int:
    """cpu_memory that keeps the embeddings, `share` of the layer bytes and a streaming ring,
    beside the KV cache and activations of CONTEXT tokens."""
    with open_model_file(model) as opened:
        sizes = pack_sizes(opened)
    globals_, layers = sizes.globals, sizes.layers
    largest = max(layer.nbytes for layer in layers)
    weights = globals_.nbytes + int(sum(layer.nbytes for layer in layers) * share) + 3 * largest
    return weights + ram_beside_weights(model, CONTEXT)


def run(engine: Engine, prompt: str, tokens: int, repeats: int) -> tuple[float, float, list[int]]:
    rates, per_pass, output = [], [], None
    for _ in range(repeats):
        result = engine.generate(prompt, max_tokens=tokens, temperature=0)
        rates.append(result.stats.decode_tokens_per_s)
        per_pass.append(result.stats.tokens_per_pass)
        output = result.tokens
    return statistics.median(rates), statistics.median(per_pass), output


def compare(title: str, target: Path, variants: dict, prompts: dict, args) -> None:
    """variants: name -> Engine.load keywords; the first is the baseline."""
    print(f"\n## {title}\n")
    print(f"| prompt | {' | '.join(variants)} |")
    print("|---|" + "---|" * len(variants))
    engines = {}
    try:
        for name, options in variants.items():
            engines[name] = Engine.load(target, threads=args.threads, context_length=CONTEXT, **options)
            for warm_up in ("Tell me about the ocean.", "List the planets of the solar system."):
                engines[name].generate(warm_up, max_tokens=args.tokens, temperature=0)
        for label, prompt in prompts.items():
            cells, base, expected = [], None, None
            for name, engine in engines.items():
                rate, per_pass, output = run(engine, prompt, args.tokens, args.repeats)
                if base is None:
                    base, expected = rate, output
                    cells.append(f"{rate:.2f} tok/s")
                else:
                    assert output == expected, f"{label}, {name}: the draft changed the output"
                    cells.append(f"{rate:.2f} tok/s, **{rate / base:.2f}x**, {per_pass:.2f}/pass")
            print(f"| {label} | {' | '.join(cells)} |", flush=True)
    finally:
        for engine in engines.values():
            engine.close()


def segment(stats) -> str:
    """A generation's tokens per pass, draft and verify seconds and the share of the draft's time
    hidden under the target's reads."""
    hidden = stats.draft_hidden_seconds / stats.draft_seconds if stats.draft_seconds else 0.0
    return (f"{stats.tokens_per_pass:.1f}/pass, draft {stats.draft_seconds:.2f} s, "
            f"verify {stats.verify_seconds:.2f} s, {hidden:.0%} hidden")


def forget_learned(model: Path, draft: Path) -> None:
    """Removes what loads of this pair (a tree) learned: the next load is the pair's first."""
    LearnedStore(model, draft, "tree", "").path.unlink(missing_ok=True)


def fresh_engines(model: Path, draft: Path, prompts: dict, args) -> None:
    """Each prompt on a fresh engine: the first args.first tokens, then args.then more, against
    the target alone (whose streamed step costs the same per token, one sweep of the disk, so 16
    tokens measure it), run just before it: a shared machine's load then weighs on both alike.
    Three drafts: the draft file, the target's own first layers ("self", within the target's
    budget) and "auto:" the file."""
    budget, extra = resident_share_budget(model), draft_bytes(model, draft)
    with Engine.load(model, threads=args.threads, context_length=CONTEXT) as resident:
        expected = {label: resident.generate(prompt, max_tokens=args.first + args.then, temperature=0).tokens
                    for label, prompt in prompts.items()}
    settings = {f"draft {draft.name}": (budget + extra, draft), "self": (budget, "self"),
                "auto": (budget + extra, f"auto:{draft}")}
    for name, (memory, asked) in settings.items():
        print(f"\n## {model.name} streamed, {format_size(budget)} resident, fresh engines; {name} "
              f"({format_size(memory - budget)} beside it)\n")
        print(f"| prompt | target alone | first {args.first} | next {args.then} |")
        print("|---|---|---|---|")
        speedups = ([], [])
        with Engine.load(model, threads=args.threads, context_length=CONTEXT, cpu_memory=budget) as alone:
            for label, prompt in prompts.items():
                base = alone.generate(prompt, max_tokens=16, temperature=0).stats.decode_tokens_per_s
                if not args.keep_learned:
                    forget_learned(model, draft)
                with Engine.load(model, threads=args.threads, context_length=CONTEXT, cpu_memory=memory,
                                 draft=asked) as engine:
                    first = engine.generate(prompt, max_tokens=args.first, temperature=0)
                    continued = engine.tokenize(prompt) + first.tokens
                    then = engine.generate(continued, max_tokens=args.then, temperature=0)
                assert first.tokens + then.tokens == expected[label], f"{label}: the draft changed the output"
                cells = []
                for result, gains in zip((first, then), speedups):
                    gains.append(result.stats.decode_tokens_per_s / base)
                    cells.append(f"**{gains[-1]:.2f}x**, {segment(result.stats)}")
                print(f"| {label} | {base:.2f} tok/s | {' | '.join(cells)} |", flush=True)
        means = [f"**{math.exp(statistics.fmean(map(math.log, gains))):.2f}x**" for gains in speedups]
        print(f"| geometric mean | | {' | '.join(means)} |")


REAL_PROMPTS = {
    "code": "Write a Python function that merges two sorted lists into one sorted list, with type hints "
            "and a docstring.",
    "prose": "Explain in one paragraph why the sky is blue.",
    "a list": "List ten common Linux shell commands, one per line, each with a short description.",
}


def forget_everything_learned(target: Path) -> None:
    """Removes what any load of `target` with any draft learned: the next load is a first one."""
    for learned in cache_dir("speculation").glob(f"{target.stem}.*.json"):
        learned.unlink()


def real_pair(args) -> None:
    """The real pair (see the module docstring), resident and streamed: a table per setting."""
    target, draft = fetch(QWEN_CODER_15B), fetch(QWEN_CODER_05B)
    streamed, extra = resident_share_budget(target, 1 / 3), draft_bytes(target, draft)
    drafts = {draft.name: draft, "ngram": "ngram", "auto": f"auto:{draft}"}
    for setting, memory in (("resident", None), (f"{format_size(streamed)} resident, the rest streamed",
                                                 streamed)):
        print(f"\n## {target.name}, {setting}; draft {draft.name} ({format_size(extra)} beside it), "
              f"fresh engines, {args.tokens} greedy tokens\n")
        print(f"| prompt | target alone | {' | '.join(drafts)} |")
        print("|---|---|" + "---|" * len(drafts))
        for label, text in REAL_PROMPTS.items():
            messages = [{"role": "user", "content": text}]
            with Engine.load(target, threads=args.threads, context_length=CONTEXT,
                             cpu_memory=memory) as alone:
                expected = alone.chat(messages, max_tokens=args.tokens, temperature=0)
            base, cells = expected.stats.decode_tokens_per_s, []
            for name, asked in drafts.items():
                forget_everything_learned(target)
                beside = 0 if asked == "ngram" else extra
                with Engine.load(target, threads=args.threads, context_length=CONTEXT, draft=asked,
                                 cpu_memory=memory and memory + beside) as engine:
                    result = engine.chat(messages, max_tokens=args.tokens, temperature=0)
                    speedup = engine.speculator.predicted_speedup()  # what the load's notice says
                    predicted = "none" if speedup is None else f"{speedup:.2f}x"
                assert result.tokens == expected.tokens, f"{label}, {name}: the draft changed the output"
                cells.append(f"**{result.stats.decode_tokens_per_s / base:.2f}x** (predicted {predicted}), "
                             f"{segment(result.stats)}")
            print(f"| {label} | {base:.2f} tok/s | {' | '.join(cells)} |", flush=True)


def draft_bytes(target: Path, draft: Path) -> int:
    """The draft's weights in RAM and what its cache and activations keep beside them."""
    with Engine.load(target, threads=1, context_length=CONTEXT, draft=draft) as engine:
        return engine.draft.bytes_by_tier()["cpu"] + ram_beside_weights(draft, CONTEXT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cases", default="resident,streamed,f32,fresh,real")
    parser.add_argument("--first", type=int, default=64)
    parser.add_argument("--then", type=int, default=256)
    parser.add_argument("--keep-learned", action="store_true")
    args = parser.parse_args()
    cases = args.cases.split(",")
    if "real" in cases:
        real_pair(args)
    if not set(cases) & {"resident", "streamed", "f32", "fresh"}:
        return
    target, three_bit, f32 = bench_files()
    if "resident" in cases:
        compare("target in RAM", target, {
            "target alone": {}, "+ ngram": {"draft": "ngram"},
            "+ 3-bit chain": {"draft": three_bit, "draft_shape": "chain"},
            "+ 3-bit tree": {"draft": three_bit}, "+ auto": {"draft": "auto"}}, PROMPTS, args)
    prose = {k: PROMPTS[k] for k in ("open prose", "summary of a text")}
    for case, model, draft in (("streamed", target, three_bit), ("f32", f32, target)):
        if case not in cases:
            continue
        budget, extra = resident_share_budget(model), draft_bytes(model, draft)
        compare(f"{model.name} streamed, {format_size(budget)} resident; draft {draft.name} "
                f"({format_size(extra)}) beside it", model, {
                    "target alone": {"cpu_memory": budget},
                    "alone, + the draft's memory": {"cpu_memory": budget + extra},
                    "+ ngram": {"cpu_memory": budget, "draft": "ngram"},
                    "+ draft chain": {"cpu_memory": budget + extra, "draft": draft, "draft_shape": "chain"},
                    "+ draft tree": {"cpu_memory": budget + extra, "draft": draft},
                    "+ self": {"cpu_memory": budget, "draft": "self"},
                    "+ auto (ngram, self, draft)": {"cpu_memory": budget + extra, "draft": f"auto:{draft}"}},
                prose, args)
    if "fresh" in cases:
        fresh_engines(f32, target, PROMPTS, args)
    print("\nA draft on a GPU (Dovetail's setting) needs the GPU tier's engine path (issue 5); "
          "this machine has no GPU.")


if __name__ == "__main__":
    main()
