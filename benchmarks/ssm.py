"""State-space models (issue 53): a Mamba-2 hybrid of Granite-4.0-H-Micro's shape or a Jamba-shaped
MoE, tierflow against llama.cpp, and the prefill scan's forms against the token loop, in one run.

    python -m benchmarks.ssm [--shape granite|jamba] [--small] [--layers N] [--weight-type Q4_0]
                             [--prompt-tokens 2048] [--decode-tokens 32] [--repeats 1]
                             [--loop-tokens 128] [--threads 2] [--json]

--shape granite (the default) is a `granitehybrid` of ibm-granite/granite-4.0-h-micro's config.json:
hidden size 2048, 40 layers of which 5, 15, 25 and 35 are attention (32 query heads and 8 KV heads
of 64, no rotary) and the rest Mamba-2 (64 heads of 64: 4096 inner channels, a state of 128, one
group of B and C, a 4-tap convolution), a dense FFN of 8192 in every layer and Granite's
multipliers, with random weights of --weight-type and the bundled tokenizer's 49,152 tokens
(llama.cpp takes the embedding's rows from the tokenizer; Granite's has 100,352, a head twice as
wide), written once by the project's generator (tests/support/make_model.py) into the cache folder.
--small cuts it to 6 layers (the sixth attention) and a 512-token prompt, a quick check; --layers
cuts it to any count (attention every tenth layer from the sixth).

--shape jamba is a `jamba` of ai21labs/Jamba-v0.1's config.json cut to fit this machine: hidden size
4096, Mamba-1 layers of 8192 inner channels (a state of 16 each, time steps of rank 256, a 4-tap
convolution), attention (32 query heads and 8 KV heads of 128) in the fifth of every 8 layers and
16 experts (2 a token) in every other layer from the second, as Jamba's; cut to its first 8 layers
and an FFN (dense and each expert) of 3,584 rather than 14,336. --small keeps the 8 layers and
takes a 512-token prompt.

Both systems get the same prompt ids and thread count (llama.cpp through llama-cpp-python), are
warmed up on a short prompt, then each repeat runs both, alternating the order (medians reported):
- prefill: the whole prompt from an empty cache, and decode: --decode-tokens greedy steps
  (benchmarks/decode.py's runs; the ratio tierflow/llama.cpp of each; issue 53's goals are decode
  at least 1.0x and a 2,048-token prefill at least 1.5x);
- memory per sequence: what the planner counts for one sequence (offload/plan/budgets.py, every
  layer's kind of memory: the Mamba-2 layers' states, the same at any length, and the attention
  layers' rows) with contexts of 1k and 32k positions; and measured, the bytes tierflow's cache
  holds and the process's RSS after prefills of 1k positions and of the prompt, the RSS against
  one position's (llama.cpp closed by then). (RSS at 32k would
  take a 32k-token prefill, an hour on two cores: the planner's figure stands for it.)
- the scan: one Mamba-2 layer's scan over the prompt's tokens at this shape in its three forms: the
  C kernels' token loop that a CPU prefill runs (selective_scan.long_pass on the CPU), the
  state-space-duality blocks other devices run (selective_scan.chunked), and the torch token loop
  (selective_scan.steps_in_torch, run over --loop-tokens and scaled: its cost per token is the
  same at any length); their largest differences from the torch loop, and the bound: the recurrence
  reads and writes every state element once a token (4 H P N floating-point operations), which no
  form can run faster than this machine's float32 matrix-product rate (benchmarks/delta_rule.py's
  GEMM, measured here).
"""

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.decode import Sample, build_prompt, open_llama_cpp, run_llama_cpp, run_tierflow, summarize
from benchmarks.delta_rule import gemm_flops_per_s, seconds
from tests.support.make_model import write_model
from tests.support.model_spec import ModelSpec
from tierflow import Engine
from tierflow.kv_types import kv_type
from tierflow.offload.plan.budgets import layer_kv_bytes
from tierflow.offload.plan.profile import cache_dir
from tierflow.runtime.compute import selective_scan

CONTEXTS = (1024, 32768)  # the planner's count per sequence at these lengths


@dataclass(frozen=True)
class ScanLayer:
    """One state-space layer's scan: heads of head_dim channels, a state of state_size each, B and C
    in groups; Mamba-1's decays per state element (heads of one channel), Mamba-2's per head."""

    heads: int
    head_dim: int
    state_size: int
    groups: int
    per_element: bool

    def describe(self) -> str:
        if self.per_element:
            return f"Mamba-1: {self.heads} channels, state {self.state_size}"
        return f"Mamba-2: {self.heads} heads of {self.head_dim}, state {self.state_size}"


@dataclass(frozen=True)
class Shape:
    stem: str  # the generated file's name before its layer count and weight type
    spec: dict  # ModelSpec's keywords but the layer count, pattern and expert layers
    layers: int  # the default count, and --small's
    small_layers: int
    attention_layers: Callable[[int], list[int]]
    expert_layers: Callable[[int], tuple[int, ...]]
    scan: ScanLayer


# ibm-granite/granite-4.0-h-micro's config.json (with its layer_types: attention at 5, 15, 25, 35)
GRANITE = Shape(
    "granite-4.0-h-micro-shape",
    dict(arch="granitehybrid", hidden_size=2048, ffn_size=8192, num_heads=32, num_kv_heads=8, head_size=64,
         ssm_inner_size=4096, ssm_state=128, ssm_value_heads=64, ssm_key_heads=1, ssm_conv_kernel=4,
         rope=False, embedding_scale=12.0, residual_scale=0.22, logit_scale=8.0, attention_scale=0.015625),
    layers=40, small_layers=6, attention_layers=lambda n: [i for i in range(n) if i % 10 == 5],
    expert_layers=lambda n: (), scan=ScanLayer(64, 64, 128, 1, False))
# ai21labs/Jamba-v0.1's config.json (attn_layer_period 8, offset 4; expert_layer_period 2, offset 1),
# its FFN a quarter as wide
JAMBA = Shape(
    "jamba-v0.1-shape-ffn3584",
    dict(arch="jamba", hidden_size=4096, ffn_size=3584, num_heads=32, num_kv_heads=8, ssm_inner_size=8192,
         ssm_state=16, ssm_value_heads=256, ssm_conv_kernel=4, num_experts=16, experts_used=2),
    layers=8, small_layers=8, attention_layers=lambda n: [i for i in range(n) if i % 8 == 4],
    expert_layers=lambda n: tuple(range(1, n, 2)), scan=ScanLayer(8192, 1, 16, 1, True))
SHAPES = {"granite": GRANITE, "jamba": JAMBA}


def model_path(shape: Shape, layers: int, weight_type: str) -> Path:
    """The generated model, written on first use into the cache folder."""
    path = cache_dir() / "bench" / f"{shape.stem}-{layers}l-{weight_type}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path.name} ...", file=sys.stderr)
        attention = shape.attention_layers(layers)
        pattern = "".join("*" if i in attention else "M" for i in range(layers))
        spec = ModelSpec(**shape.spec, num_layers=layers, layer_pattern=pattern,
                         expert_layers=shape.expert_layers(layers), weight_type=weight_type,
                         context_length=max(CONTEXTS))
        write_model(path.with_suffix(".tmp"), spec).rename(path)
    return path


def rss_bytes() -> int:
    """This process's resident set, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(engine: Engine, llama, prompt: list[int], decode_steps: int, repeats: int
            ) -> dict[str, list[Sample]]:
    """Both systems warmed up on the prompt's first 32 tokens, then `repeats` runs of each, the
    order alternating."""
    runners = {"tierflow": lambda ids, steps: run_tierflow(engine, ids, steps),
               "llama.cpp": lambda ids, steps: run_llama_cpp(llama, ids, steps)}
    for run in runners.values():
        run(prompt[:32], 2)
    samples: dict[str, list[Sample]] = {name: [] for name in runners}
    order = list(runners)
    for _ in range(repeats):
        for name in order:
            samples[name].append(runners[name](prompt, decode_steps))
        order.reverse()
    return samples


def memory(engine: Engine, prompt: list[int]) -> dict:
    """The planner's count per sequence at CONTEXTS (Mamba-2 layers and attention layers apart), and
    the cache's bytes and the RSS after prefills of one position, 1k and the whole prompt."""
    config, kv = engine.config, kv_type(None)
    planned = {}
    for context in CONTEXTS:
        per_layer = [layer_kv_bytes(config, i, context, kv) for i in range(config.num_layers)]
        recurrent = sum(b for b, r in zip(per_layer, config.recurrent_layers) if r)
        planned[context] = {"recurrent_bytes": recurrent, "attention_bytes": sum(per_layer) - recurrent}
    engine.logits(prompt[:1])
    measured = {"one_position_rss_bytes": rss_bytes()}
    for positions in sorted({min(CONTEXTS[0], len(prompt)), len(prompt)}):
        engine.logits(prompt[:positions])
        measured[positions] = {"cache_bytes": engine.kv_cache_bytes, "rss_bytes": rss_bytes()}
    return {"planned": planned, "measured": measured}


def scan_inputs(layer: ScanLayer, tokens: int) -> tuple[torch.Tensor, ...]:
    """One layer's scan: a, D, a nonzero state, and the tokens' x, B, C and time steps (dt a between
    -0.4 and 0 a token)."""
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    heads, state = layer.heads, layer.state_size
    a = -torch.rand(heads, 1, state if layer.per_element else 1, generator=generator) * 8 - 0.5
    dt = torch.rand(tokens, heads, generator=generator) * 0.05
    x = normal(tokens, heads, layer.head_dim)
    b, c = normal(tokens, layer.groups, state), normal(tokens, layer.groups, state)
    return a, normal(heads), normal(heads, layer.head_dim, state) * 0.1, x, b, c, dt


def scan(layer: ScanLayer, tokens: int, loop_tokens: int, repeats: int) -> dict:
    """The kernels' loop, the chunked form and the torch loop over one layer's `tokens`, and the bound."""
    inputs, n = scan_inputs(layer, tokens), min(loop_tokens, tokens)
    first = tuple(x[:n] if x.dim() >= 2 and x.shape[0] == tokens else x for x in inputs)
    with torch.inference_mode():
        kernels_s = seconds(lambda: selective_scan.long_pass(*inputs), repeats)
        chunked_s = seconds(lambda: selective_scan.chunked(*inputs), repeats)
        loop_s = seconds(lambda: selective_scan.steps_in_torch(*first), repeats) * tokens / n
        looped = selective_scan.steps_in_torch(*first)[0]
        forms = {"kernels": selective_scan.long_pass, "chunked": selective_scan.chunked}
        differences = {name: float((form(*first)[0] - looped).abs().max()) for name, form in forms.items()}
    peak = gemm_flops_per_s(repeats)
    bound_s = 4 * layer.heads * layer.head_dim * layer.state_size * tokens / peak
    return {"layer": layer.describe(), "tokens": tokens, "kernels_s": kernels_s, "chunked_s": chunked_s,
            "token_loop_s": loop_s, "loop_tokens": n, "max_output_difference": differences,
            "gemm_gflops": peak / 1e9, "bound_s": bound_s}


def print_report(report: dict) -> None:
    print(f"model: {report['model']} ({report['model_file_bytes'] / 2**30:.2f} GiB), {report['threads']} "
          f"threads; prompt {report['prompt_tokens']} tokens, {report['decode_tokens']} decode steps, "
          f"median of {report['repeats']}")
    systems, ratio = report["systems"], report["ratio"]
    print(f"{'':<22}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, figures in systems.items():
        print(f"{name:<22}{figures['prefill_tokens_per_s']:>15.2f}{figures['decode_tokens_per_s']:>15.2f}")
    print(f"{'tierflow/llama.cpp':<22}{ratio['prefill_tokens_per_s']:>14.2f}x{ratio['decode_tokens_per_s']:>14.2f}x"
          f"   (goals: prefill 1.5x, decode 1.0x)")
    for note in report["notes"]:
        print(f"note: {note}")
    mib = 2 ** 20
    print("memory per sequence, as the planner counts it:")
    for context, figures in report["memory"]["planned"].items():
        print(f"  {context:>6} positions: Mamba states {figures['recurrent_bytes'] / mib:8.1f} MiB, "
              f"attention rows {figures['attention_bytes'] / mib:8.1f} MiB")
    measured = dict(report["memory"]["measured"])
    loaded = measured.pop("one_position_rss_bytes")
    print(f"measured (RSS with one position held {loaded / mib:.0f} MiB):")
    for positions, figures in measured.items():
        print(f"  {positions:>6} positions: the cache holds {figures['cache_bytes'] / mib:8.1f} MiB; RSS "
              f"{figures['rss_bytes'] / mib:.0f} MiB (+{(figures['rss_bytes'] - loaded) / mib:.0f})")
    s = report["scan"]
    print(f"one layer's scan over {s['tokens']} tokens ({s['layer']}), and its largest output difference "
          f"from the torch loop:")
    print(f"  torch loop  {s['token_loop_s'] * 1e3:8.0f} ms (from {s['loop_tokens']} tokens)")
    for name, label in (("chunked", "chunked"), ("kernels", "C loop")):
        seconds_taken = s[f"{name}_s"]
        print(f"  {label:<10}{seconds_taken * 1e3:8.0f} ms: {s['token_loop_s'] / seconds_taken:.1f}x the "
              f"torch loop; {s['max_output_difference'][name]:.1e}")
    print(f"  bound       {s['bound_s'] * 1e3:8.0f} ms at {s['gemm_gflops']:.0f} GFLOP/s (torch's float32 "
          f"GEMM): the C loop takes {s['kernels_s'] / s['bound_s']:.1f}x the bound")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="granite")
    parser.add_argument("--small", action="store_true", help="granite: 6 layers; and a 512-token prompt")
    parser.add_argument("--layers", type=int, default=None,
                        help="granite: default 40 (--small: 6), at least 6; jamba: 8, at least 5 (one of "
                             "them attention)")
    parser.add_argument("--weight-type", default="Q4_0")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 2048 (--small: 512)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--loop-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    fewest = max(shape.attention_layers(64)[0] + 1, 2)
    args.layers = max(fewest, args.layers or (shape.small_layers if args.small else shape.layers))
    args.prompt_tokens = args.prompt_tokens or (512 if args.small else 2048)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    path = model_path(shape, args.layers, args.weight_type)
    context = args.prompt_tokens + args.decode_tokens + 2
    started = time.perf_counter()
    engine = Engine.load(path, threads=args.threads, context_length=context)
    llama = open_llama_cpp(path, args.threads, context)
    prompt = build_prompt(engine, args.prompt_tokens)
    samples = measure(engine, llama, prompt, args.decode_tokens, args.repeats)
    llama.close()  # its weights and buffers out of the RSS measured next
    report = {"model": path.name, "model_file_bytes": path.stat().st_size, "threads": args.threads,
              "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
              "repeats": args.repeats, **summarize(samples, args.decode_tokens),
              "memory": memory(engine, prompt)}
    engine.close()
    report["scan"] = scan(shape.scan, args.prompt_tokens, args.loop_tokens, 3)
    report["seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return
    print_report(report)
    print(f"({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
