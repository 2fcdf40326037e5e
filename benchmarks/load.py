"""Load time and disk cost: tierflow's first and later loads of a GGUF file against llama.cpp's, in one run.

    python -m benchmarks.load --model PATH [--cpu-memory 6GiB] [--threads 2] [--context 512]
                              [--prompt-tokens 16] [--repeats 3] [--profile FILE] [--json]

The pack (offload/pack/), where the load writes one (a plan that streams, or a type packed by
numpy; else the extents are built in RAM at every load and no pack is written), is built into a
fresh temporary cache folder (TIERFLOW_CACHE points there, and it is deleted at the end), so the
first load really builds it. The hardware profile cached for
this thread count is copied in first, so that a load whose plan needs the machine's speeds (a budget
that streams) does not time a probe of the machine as well. Measured:
- disk: the GGUF file's size, the pack's (0 when none is written), and the bytes added: every byte
  the first load left in the cache folder (the pack, its use record);
- tierflow's first load (the pack absent: `Engine.load` builds it), once, and its later load (the
  pack present), the median of --repeats: each the wall time of `Engine.load` until the engine is
  ready to generate, then the time to the first token of a --prompt-tokens prompt (its prefill);
  the first load's time is split by the phases its progress reports name (each from its first
  report to its last; the rest is opening the file, the tokenizer, planning and the KV cache);
- llama.cpp's load of the same file through llama-cpp-python (`Llama`, its mmap), the median of
  --repeats, and the first token of the same prompt ids, at the same thread count and context.
Ratios are tierflow's over llama.cpp's (above 1: tierflow is slower).

The GGUF file is read into the page cache before the first load and before each llama.cpp load, so
neither pays for reading it from disk (llama.cpp's mmap would otherwise page it in as it goes). The
pack is read with O_DIRECT (offload/io/disk.py), so tierflow's later loads read it from the disk
whatever the page cache holds: the disk's speed is part of that figure.
By default cpu_memory is tierflow's default (the available RAM less a margin), which holds the whole
model in RAM when the machine has room; the table says how many layers were streamed instead.
Each engine is closed and each llama.cpp model freed before the next load; peak memory is about the
file (cached) plus twice the pack (cached while written, and loaded).
"""

import argparse
import contextlib
import cProfile
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp

from benchmarks.decode import build_prompt, positive_int, run_llama_cpp
from tierflow import Engine, LoadPhase
from tierflow.offload.plan.profile import profile_path
from tierflow.units import format_size


@dataclass
class PhaseClock:
    """A load's progress callback: when each phase first and last reported, from `started`."""

    started: float = field(default_factory=time.perf_counter)
    spans: dict[str, list[float]] = field(default_factory=dict)

    def __call__(self, phase: LoadPhase, done: int, total: int) -> None:
        now = time.perf_counter() - self.started
        self.spans.setdefault(phase.value, [now, now])[1] = now

    def seconds(self) -> dict[str, float]:
        return {phase: end - start for phase, (start, end) in self.spans.items()}


@dataclass
class LoadRun:
    """One load of one system."""

    load_s: float  # until the model is ready to generate
    first_token_s: float  # then the prompt's prefill and its first token


@dataclass
class TierflowLoad(LoadRun):
    pack: Path | None = None  # where the loaded pack lives; None: built in RAM, none written
    streamed_layers: int = 0
    num_layers: int = 0
    prompt_ids: list[int] = field(default_factory=list)


def load_tierflow(path: Path, args: argparse.Namespace, clock: PhaseClock | None = None,
                  profiler: cProfile.Profile | None = None) -> TierflowLoad:
    """Times Engine.load (under `profiler` if given), then the first token of the prompt; closes the
    engine before returning."""
    gc.collect()  # the previous load's memory back first (an engine's objects hold cycles)
    started = time.perf_counter()
    if clock is not None:
        clock.started = started
    with profiler or contextlib.nullcontext():
        engine = Engine.load(path, threads=args.threads, context_length=args.context,
                             cpu_memory=args.cpu_memory, progress=clock)
    load_s = time.perf_counter() - started
    with engine:
        prompt_ids = build_prompt(engine, args.prompt_tokens)
        started = time.perf_counter()
        engine.generate(prompt_ids, max_tokens=1, temperature=0)
        first_token_s = time.perf_counter() - started
        return TierflowLoad(load_s, first_token_s, engine.weights.packed.path,
                            len(engine.weights.streamed_layers), engine.config.num_layers, prompt_ids)


def read_into_page_cache(path: Path) -> None:
    """Reads the whole file once, so that both loads read it from RAM, not from whatever of it the
    disk's cache happens to hold."""
    with open(path, "rb", buffering=0) as file:
        while file.read(64 << 20):
            pass


def load_llama_cpp(path: Path, args: argparse.Namespace, prompt_ids: list[int]) -> LoadRun:
    """Times llama.cpp's load of the cached file, then the first token of the same prompt ids."""
    gc.collect()
    read_into_page_cache(path)
    started = time.perf_counter()
    llama = llama_cpp.Llama(str(path), n_ctx=args.context, n_threads=args.threads,
                            n_threads_batch=args.threads, verbose=False)
    load_s = time.perf_counter() - started
    try:
        started = time.perf_counter()
        run_llama_cpp(llama, prompt_ids, decode_steps=0)
        return LoadRun(load_s, time.perf_counter() - started)
    finally:
        llama.close()


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def first_load(path: Path, cache: Path, args: argparse.Namespace) -> dict:
    """The load that builds the pack into the empty cache folder, its phases and what it added."""
    read_into_page_cache(path)
    before = folder_bytes(cache)
    clock = PhaseClock()
    profiler = cProfile.Profile() if args.profile else None
    run = load_tierflow(path, args, clock, profiler)
    if profiler is not None:
        profiler.dump_stats(args.profile)
    if run.pack is not None and not run.pack.exists():
        raise RuntimeError(f"the first load left no pack in {cache}")
    return {"run": run, "phases_s": clock.seconds(),
            "pack_bytes": 0 if run.pack is None else run.pack.stat().st_size,
            "added_bytes": folder_bytes(cache) - before}


def later_loads(path: Path, args: argparse.Namespace, prompt_ids: list[int]
                ) -> tuple[list[TierflowLoad], list[LoadRun]]:
    """--repeats later loads of tierflow and loads of llama.cpp, alternating which goes first so
    that machine noise hits both."""
    runners = {"tierflow": lambda: load_tierflow(path, args),
               "llama.cpp": lambda: load_llama_cpp(path, args, prompt_ids)}
    samples: dict[str, list] = {name: [] for name in runners}
    order = list(runners)
    for _ in range(args.repeats):
        for name in order:
            samples[name].append(runners[name]())
        order.reverse()
    return samples["tierflow"], samples["llama.cpp"]


def measure(path: Path, args: argparse.Namespace) -> dict:
    saved_profile = profile_path(args.threads)  # in the user's cache folder, before it is redirected
    previous = os.environ.get("TIERFLOW_CACHE")
    with tempfile.TemporaryDirectory(prefix="tierflow-load-", dir=args.scratch) as folder:
        cache = Path(folder)
        if saved_profile.exists():
            shutil.copy2(saved_profile, cache / saved_profile.name)
        os.environ["TIERFLOW_CACHE"] = str(cache)
        try:
            first = first_load(path, cache, args)
            ours, theirs = later_loads(path, args, first["run"].prompt_ids)
        finally:
            if previous is None:
                os.environ.pop("TIERFLOW_CACHE", None)
            else:
                os.environ["TIERFLOW_CACHE"] = previous
    return summarize(path, args, first, ours, theirs)


def median_run(runs: list[LoadRun]) -> dict:
    return {"load_s": statistics.median(r.load_s for r in runs),
            "first_token_s": statistics.median(r.first_token_s for r in runs),
            "runs": [{"load_s": r.load_s, "first_token_s": r.first_token_s} for r in runs]}


def summarize(path: Path, args: argparse.Namespace, first: dict, ours: list[TierflowLoad],
              theirs: list[LoadRun]) -> dict:
    run: TierflowLoad = first["run"]
    systems = {"tierflow first load": {"load_s": run.load_s, "first_token_s": run.first_token_s},
               "tierflow later load": median_run(ours), "llama.cpp": median_run(theirs)}
    baseline = systems["llama.cpp"]
    for figures in systems.values():
        figures["load_ratio"] = figures["load_s"] / baseline["load_s"]
        figures["ready_ratio"] = ((figures["load_s"] + figures["first_token_s"])
                                  / (baseline["load_s"] + baseline["first_token_s"]))
    file_bytes = path.stat().st_size
    phases = first["phases_s"]
    return {
        "model": path.name, "threads": args.threads, "context": args.context,
        "prompt_tokens": len(run.prompt_ids), "repeats": args.repeats, "statistic": "median",
        "cpu_memory": args.cpu_memory or "default", "streamed_layers": run.streamed_layers,
        "num_layers": run.num_layers, "file_bytes": file_bytes, "pack_bytes": first["pack_bytes"],
        "added_bytes": first["added_bytes"], "pack_ratio": first["pack_bytes"] / file_bytes,
        "first_load_phases_s": phases | {"rest": run.load_s - sum(phases.values())},
        "systems": systems,
    }


def print_table(report: dict) -> None:
    print(f"model: {report['model']}; threads {report['threads']}, context {report['context']}, prompt "
          f"{report['prompt_tokens']} tokens; cpu_memory {report['cpu_memory']}: "
          f"{report['streamed_layers']}/{report['num_layers']} layers streamed; later loads and "
          f"llama.cpp: median of {report['repeats']}")
    print(f"file {format_size(report['file_bytes'])}, pack {format_size(report['pack_bytes'])} "
          f"({report['pack_ratio']:.2f}x the file), bytes added {format_size(report['added_bytes'])} "
          f"({report['added_bytes']:,} B)")
    print(f"{'system':<22}{'load s':>9}{'first token s':>15}{'load/llama.cpp':>16}"
          f"{'to token/llama.cpp':>20}")
    for name, figures in report["systems"].items():
        print(f"{name:<22}{figures['load_s']:>9.2f}{figures['first_token_s']:>15.2f}"
              f"{figures['load_ratio']:>15.2f}x{figures['ready_ratio']:>19.2f}x")
    phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in report["first_load_phases_s"].items())
    print(f"first load phases: {phases}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the GGUF file")
    parser.add_argument("--cpu-memory", default=None,
                        help="tierflow's cpu_memory, e.g. 6GiB (default: tierflow's, the available RAM "
                             "less a margin)")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--context", type=positive_int, default=512, help="KV cache positions, both systems")
    parser.add_argument("--prompt-tokens", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--scratch", type=Path, default=None,
                        help="where the temporary cache folder goes (default: the system's temp folder)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write cProfile stats of the first Engine.load to this file (read them with "
                             "python -m pstats); that load's time then includes the profiler's overhead")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if not args.model.is_file():
        parser.error(f"--model: no such file: {args.model}")
    if args.prompt_tokens >= args.context:
        parser.error(f"--prompt-tokens ({args.prompt_tokens}) must be below --context ({args.context})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = measure(args.model, args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
