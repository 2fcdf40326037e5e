"""End-to-end decode tokens/s with layers on the GPU: tierflow against llama.cpp (n_gpu_layers), in one run.

Three placements of the same GGUF file: fully on the GPU, half on it, and half on it with most of
the rest streamed from disk.

    python -m benchmarks.gpu_decode [--model PATH | --size 2GB] [--weight-type Q4_0] [--threads N]
                                    [--prompt-tokens 128] [--decode-tokens 64] [--repeats 3] [--json]
    python -m benchmarks.gpu_decode --smoke     anywhere: a tiny model, once (Triton's interpreter
                                                without CUDA); proves the script runs, not speed

The model is --model, or a random-weight `llama` model of about --size written once by the
project's generator (tests/support/make_model.py) into the cache directory. Each case loads both systems
afresh:
- all on GPU: gpu_memory holds every layer and its share of the KV cache;
- half on GPU: gpu_memory holds the first num_layers // 2 layers and their KV cache, the rest
  stay in RAM;
- GPU + streamed: the same gpu_memory, and cpu_memory of the globals (embeddings, output head)
  plus a quarter of all layers' bytes (at least two streaming buffers), beside the RAM layers' KV
  cache and the activations, so that most of the rest
  streams from disk every token; the script checks that the planner did stream and reports how
  many layers it streamed.
Budgets are sized from the planner's own layer extents (offload/pack/extents.py), so the split is
exactly the one asked for; the globals and the output head stay in RAM and on the CPU in tierflow.

Baseline: llama.cpp (llama-cpp-python) with n_gpu_layers set to the number of layers tierflow put
on the GPU; in the all-on-GPU case n_gpu_layers=-1, llama.cpp's full offload (every layer and the
output head: with n_gpu_layers=num_layers, recent llama.cpp, which counts the output head as the
first layer to offload, would leave a repeating layer on the CPU). llama.cpp offloads layers from
the last one back (recent builds the output head first), tierflow from the first on and never the
head: the partial cases match in layer count, not in which tensors. llama.cpp cannot stream from
disk: in the streamed case it holds those layers in RAM (mmap). A llama-cpp-python built without GPU
support ignores n_gpu_layers; the script says so.

What is timed is decode.py's measurement, reused as is: the same prompt ids, thread count and
decode steps (greedy) for both; both warmed up once, then every repeat runs both, alternating
which goes first, and the median of the repeats is reported. Decode is `--decode-tokens`
single-token forward passes plus the argmax of each step's logits; tierflow's KV cache is float32,
llama.cpp's its default (F16).
"""

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import psutil
import torch

from benchmarks.decode import build_prompt, measure, positive_int, summarize
from benchmarks.streaming import model_file
from tierflow import Engine
from tierflow.gpu_kernels.launch import load_all_kernels
from tierflow.kv_types import kv_type
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan.budgets import kv_cache_bytes
from tierflow.offload.plan.profile import cache_dir
from tierflow.units import parse_size

SMOKE_PROMPT_TOKENS, SMOKE_DECODE_TOKENS = 8, 4


@dataclass(frozen=True)
class Case:
    name: str
    gpu_share: float  # the fraction of the layers asked for on the GPU (rounded down)
    streamed: bool  # cpu_memory small enough that most of the other layers stream from disk


CASES = (Case("all on GPU", 1.0, False), Case("half on GPU", 0.5, False), Case("GPU + streamed", 0.5, True))


@dataclass(frozen=True)
class Sizes:
    """The planner's view of the model: what each budget has to hold."""

    globals_bytes: int
    layer_bytes: list[int]
    kv_per_layer_bytes: int  # each layer's share of the KV cache (the default type)

    def gpu_budget(self, num_gpu: int) -> int:
        return sum(self.layer_bytes[:num_gpu]) + num_gpu * self.kv_per_layer_bytes

    def streaming_cpu_budget(self) -> int:
        ring = 2 * max(self.layer_bytes)  # the smallest ring the streamer runs with
        return self.globals_bytes + max(sum(self.layer_bytes) // 4, ring)


def read_sizes(path: Path, context_length: int) -> Sizes:
    with open_model_file(path) as model:
        config, sizes = model.config, pack_sizes(model)
    globals_, layers = sizes.globals, sizes.layers
    kv = kv_cache_bytes(config, context_length, kv_type(None)) // config.num_layers  # the default type
    return Sizes(globals_.nbytes, [layer.nbytes for layer in layers], kv)


def smoke_model() -> Path:
    """A tiny model, cached so that its pack is built once: 6 layers, so that 3 are left off the
    GPU and the planner can stream them (it never streams fewer than a two-slot ring plus one)."""
    from tests.support.make_model import ModelSpec, write_model

    path = cache_dir() / "bench" / "llama-smoke-6x64-Q8_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path.with_suffix(".tmp"), ModelSpec(num_layers=6, hidden_size=64)).rename(path)
    return path


def run_case(case: Case, path: Path, sizes: Sizes, args: argparse.Namespace) -> dict:
    num_layers = len(sizes.layer_bytes)
    num_gpu = int(num_layers * case.gpu_share)
    from tests.support.budgets import ram_beside_weights

    beside = ram_beside_weights(path, args.context_length, gpu_layers=tuple(range(num_gpu)))
    budgets = {"gpu_memory": sizes.gpu_budget(num_gpu),
               "cpu_memory": sizes.streaming_cpu_budget() + beside if case.streamed else None}
    with Engine.load(path, threads=args.threads, context_length=args.context_length,
                     gpu_device=args.gpu_device, **budgets) as engine:
        weights = engine.weights
        if weights.gpu_layers != list(range(num_gpu)):
            raise RuntimeError(f"{case.name}: asked for layers 0-{num_gpu - 1} on the GPU, the planner "
                               f"put {weights.gpu_layers} there")
        if case.streamed and not weights.streamed_layers:
            raise RuntimeError(f"{case.name}: cpu_memory {budgets['cpu_memory']} streamed no layer")
        n_gpu_layers = -1 if num_gpu == num_layers else num_gpu
        llama = llama_cpp.Llama(str(path), n_gpu_layers=n_gpu_layers, n_ctx=args.context_length,
                                n_batch=512, n_threads=engine.threads, n_threads_batch=engine.threads,
                                verbose=False)
        try:
            prompt_ids = build_prompt(engine, args.prompt_tokens)
            samples = measure(engine, llama, prompt_ids, args.decode_tokens, args.repeats)
        finally:
            llama.close()
        held = set(weights.gpu_layers) | set(weights.streamed_layers)
        return {"case": case.name, **budgets, "gpu_layers": weights.gpu_layers,
                "ram_layers": [i for i in range(num_layers) if i not in held],
                "streamed_layers": weights.streamed_layers,
                "prefetch_depth": len(weights.streamer.slots) - 1 if weights.streamer else 0,
                "bytes_by_tier": weights.bytes_by_tier(), "llama_n_gpu_layers": n_gpu_layers,
                **summarize(samples, args.decode_tokens)}


def device_name(args: argparse.Namespace) -> str:
    if args.gpu_device == "interpret":
        return "none: Triton's interpreter on the CPU standing in for the GPU"
    return torch.cuda.get_device_name()


def print_table(report: dict) -> None:
    if report["smoke"]:
        print("SMOKE RUN: a tiny model, once, in Triton's interpreter where there is no CUDA; the "
              "figures say nothing about speed")
    print(f"GPU: {report['device']}")
    print(f"model: {report['model']} ({report['model_file_bytes'] / 2**20:.0f} MiB file, "
          f"{report['num_layers']} layers)")
    print(f"threads: {report['threads']}; prompt {report['prompt_tokens']} tokens, "
          f"{report['decode_tokens']} decode steps; median of {report['repeats']} repeat"
          f"{'s' if report['repeats'] > 1 else ''} after a warm-up")
    header = (f"{'case':<16}{'tierflow GPU/RAM/disk':>23}{'llama.cpp n_gpu_layers':>30}"
              f"{'tierflow tok/s':>16}{'llama.cpp tok/s':>17}{'ratio':>8}")
    print(header)
    print("-" * len(header))
    for row in report["cases"]:
        split = "/".join(str(len(row[key])) for key in ("gpu_layers", "ram_layers", "streamed_layers"))
        ngl = row["llama_n_gpu_layers"]
        ngl = "-1 (all + output head)" if ngl == -1 else f"{ngl}, rest in RAM"
        if row["streamed_layers"]:
            ngl += " (no disk)"
        decode = {name: figures["decode_tokens_per_s"] for name, figures in row["systems"].items()}
        print(f"{row['case']:<16}{split:>23}{ngl:>30}{decode['tierflow']:>16.2f}"
              f"{decode['llama.cpp']:>17.2f}{row['ratio']['decode_tokens_per_s']:>7.2f}x")
    for row in report["cases"]:
        for note in row["notes"]:
            print(f"note ({row['case']}): {note}")
    for note in report["notes"]:
        print(f"note: {note}")


def report_notes(report: dict) -> list[str]:
    notes = []
    streamed = [row for row in report["cases"] if row["streamed_layers"]]
    for row in streamed:
        notes.append(f"{row['case']}: tierflow streams {len(row['streamed_layers'])} of "
                     f"{report['num_layers']} layers from disk (prefetch depth {row['prefetch_depth']}); "
                     f"llama.cpp cannot stream and holds them in RAM")
    if not llama_cpp.llama_supports_gpu_offload():
        notes.append("this llama-cpp-python is a CPU build: n_gpu_layers has no effect, its figures "
                     "are all-CPU ones")
    notes.append("llama.cpp offloads from the last layer back, tierflow from the first on; tierflow "
                 "keeps the output head on the CPU")
    return notes


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="a GGUF file instead of the generated model")
    source.add_argument("--size", default="2GB", help="size of the generated model")
    parser.add_argument("--weight-type", default="Q4_0", help="weight type of the generated model")
    parser.add_argument("--threads", type=positive_int, default=None, help="default: physical cores")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128)
    parser.add_argument("--decode-tokens", type=positive_int, default=64,
                        help="decode steps after the first generated token")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model, every case once (in Triton's interpreter without CUDA)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    say = sys.stderr if args.json else sys.stdout  # what is not the figures keeps --json's output JSON
    if importlib.util.find_spec("triton") is None:
        print("Triton is not installed (pip install 'triton>=3.2'): tierflow has no GPU path to benchmark",
              file=say)
        return
    args.gpu_device = None
    if not torch.cuda.is_available():
        print("No CUDA GPU here: these figures need one (run with --smoke to check that the script "
              "runs, in Triton's interpreter).", file=say)
        if not args.smoke:
            return
        load_all_kernels(interpret=True)  # before anything imports triton
        args.gpu_device = "interpret"
    args.threads = args.threads or psutil.cpu_count(logical=False) or 1
    if args.smoke:
        path = smoke_model()
        args.prompt_tokens, args.decode_tokens, args.repeats = SMOKE_PROMPT_TOKENS, SMOKE_DECODE_TOKENS, 1
    else:
        path = args.model or model_file(parse_size(args.size), args.weight_type)
    # Room for the prompt, the first token and every decode step, identical for both systems.
    args.context_length = args.prompt_tokens + args.decode_tokens + 2
    sizes = read_sizes(path, args.context_length)
    report = {"smoke": args.smoke, "device": device_name(args), "model": path.name,
              "model_file_bytes": path.stat().st_size, "num_layers": len(sizes.layer_bytes),
              "threads": args.threads, "prompt_tokens": args.prompt_tokens,
              "decode_tokens": args.decode_tokens, "repeats": args.repeats, "statistic": "median",
              "llama_cpp_gpu_offload": llama_cpp.llama_supports_gpu_offload(),
              "cases": [run_case(case, path, sizes, args) for case in CASES]}
    report["notes"] = report_notes(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
