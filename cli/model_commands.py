"""The commands about models and the machine, not generation: info, list, plan, probe, convert."""

import json
import warnings
from pathlib import Path
from typing import Annotated, Optional

from rich.markup import escape
from rich.table import Column, Table

from tierflow.cli.display import err, model_name, out, progress_bar, status
from tierflow.cli.options import (
    CpuMoeOpt,
    CpuOpt,
    CtxOpt,
    ExpertSkipOpt,
    ExpertUnionCapOpt,
    ExtendOpt,
    GpuOpt,
    KvOnCpuOpt,
    KvTypeOpt,
    ModelArg,
    ModelOpt,
    NCpuMoeOpt,
    ParallelOpt,
    ThreadsOpt,
    expert_options,
    option,
)
from tierflow.units import format_size


def info(model: ModelArg = None, model_opt: ModelOpt = None) -> None:
    """Show a model's architecture, sizes, tensor types and bytes per tier (loads no weights)."""
    from tierflow.runtime.api.model_info import describe_model

    summary = describe_model(model or model_opt)
    table = Table(title=str(summary.path), show_header=False)
    for key, value in summary.rows():
        table.add_row(key, str(value))
    out.print(table)
    types = Table("tensor type", "tensors", "bytes in file")
    for type_name, (count, nbytes) in sorted(summary.tensor_types.items()):
        types.add_row(type_name, str(count), format_size(nbytes))
    out.print(types)


def list_command(as_json: Annotated[bool, option("--json", help="print the list as JSON")] = False
                 ) -> None:
    """List the models ollama, the Hugging Face cache and LM Studio hold on this machine, by the name
    -m takes (reads headers only), and the presets."""
    from tierflow.offload.store.model_list import list_models

    models = list_models()
    if as_json:
        print(json.dumps([model.as_dict() for model in models]))
        return
    table = Table(Column("name", no_wrap=True), "source", "size", "architecture", "weights",
                  Column("path", overflow="fold"))
    for model in models:
        size = format_size(model.size_bytes) if model.size_bytes is not None else ""
        details = (model.architecture or "", model.weight_type or "") if model.error is None else (
            f"[red]{escape(model.error)}[/red]", "")
        table.add_row(model.name, model.source, size, *details, model.path or "")
    out.print(table if models else "no models found in ollama, the Hugging Face cache or LM Studio, and no "
              "presets")


def plan(model: ModelArg = None, model_opt: ModelOpt = None, gpu_memory: GpuOpt = None,
         cpu_memory: CpuOpt = None,
         threads: ThreadsOpt = None, ctx: CtxOpt = None, kv_type: KvTypeOpt = None,
         kv_on_cpu: KvOnCpuOpt = False, allow_context_extension: ExtendOpt = False,
         parallel: ParallelOpt = None, cpu_moe: CpuMoeOpt = False, n_cpu_moe: NCpuMoeOpt = None,
         expert_skip: ExpertSkipOpt = 0.0, expert_union_cap: ExpertUnionCapOpt = 0,
         prompt_tokens: Annotated[Optional[int], option(
             "--prompt-tokens", help="prompt length of the prefill prediction (default: 512, at most the "
             "context); decode is predicted with the context full")] = None,
         as_json: Annotated[bool, option("--json", help="print the plan as JSON")] = False) -> None:
    """Show where each layer would live and compute, the memory it and its KV cache take, the
    context and the predicted tokens/s, before anything loads (reads the header and the cached
    hardware profile). --parallel N plans N sequences' KV caches, as `tierflow serve --parallel N`
    loads them (default here: one)."""
    from tierflow.arguments import check_parallel
    from tierflow.offload.plan.probe import announcement, will_probe
    from tierflow.runtime.loading.loader import CacheOptions, plan_file, thread_count
    from tierflow.units import parse_size

    experts = expert_options(cpu_moe, n_cpu_moe, expert_skip, expert_union_cap)
    threads = thread_count(threads)
    probing = will_probe(threads, memory_bytes=None if cpu_memory is None else parse_size(cpu_memory))
    if probing is not None:
        err.print(announcement(probing), soft_wrap=True)
    sequences = check_parallel(1 if parallel is None else parallel)
    cache = CacheOptions(ctx, kv_type, kv_on_cpu, allow_context_extension, sequences)
    result = plan_file(model or model_opt, threads=threads, gpu_memory=gpu_memory, cpu_memory=cpu_memory,
                       cache=cache, prompt_tokens=prompt_tokens,
                       **experts)
    if as_json:
        print(json.dumps(result.as_dict()))
        return
    groups = Table("group", "bytes", "home", "compute", title=f"{result.model}: placement")
    for label, nbytes, home, compute in result.rows():
        groups.add_row(label, format_size(nbytes), home, compute)
    out.print(groups)
    summary = Table(show_header=False)
    for key, value in result.summary():
        summary.add_row(key, value)
    out.print(summary)


def probe(threads: ThreadsOpt = None,
          refresh: Annotated[bool, option("--refresh", help="measure again, replacing the "
                                                "cached profile")] = False,
          cpu_memory: Annotated[Optional[str], option(
              "--cpu-memory", help="RAM the measurement may take, e.g. 512MiB (default and at most: 10% "
              "of the available RAM)")] = None,
          as_json: Annotated[bool, option("--json", help="print the profile as JSON")] = False) -> None:
    """Measure disk, RAM and kernel speeds: the hardware profile the planner predicts with.

    Measured once (about 10 s, said before it starts) and cached; --refresh measures again."""
    from tierflow.offload.plan.probe import ProbeWarning, announcement, load_profile, will_probe
    from tierflow.offload.plan.profile import profile_path
    from tierflow.runtime.loading.loader import thread_count
    from tierflow.units import parse_size

    threads = thread_count(threads)
    memory = None if cpu_memory is None else parse_size(cpu_memory)
    probing = will_probe(threads, refresh, memory)
    if probing is not None:
        err.print(announcement(probing), soft_wrap=True)
    with warnings.catch_warnings(record=True) as caught, status("measuring") as progress:
        warnings.simplefilter("always", ProbeWarning)
        profile = load_profile(threads, refresh=refresh, progress=progress, memory_bytes=memory)
    for warning in caught:
        if issubclass(warning.category, ProbeWarning):
            err.print(f"[yellow]warning:[/yellow] {warning.message}", soft_wrap=True)
    if as_json:
        print(profile.to_json())
        return
    _print_profile(profile)
    out.print(f"cached in {profile_path(threads)} (--refresh measures again)", soft_wrap=True)


def _print_profile(profile) -> None:
    gbps = "{:.1f} GB/s".format
    table = Table(title=f"hardware profile, {profile.threads} threads", show_header=False)
    table.add_row("CPU", profile.cpu_name)
    table.add_row("disk read", f"{gbps(profile.disk_read_gbps)} "
                  f"({'O_DIRECT' if profile.disk_direct_io else 'buffered, page cache dropped'})")
    table.add_row("RAM read", gbps(profile.ram_read_gbps) + (
        " (rough: measured in less RAM than twice the L3 cache, so partly the cache's speed; a probe "
        "allowed more measures again)" if profile.rough else ""))
    for shape, seconds in sorted(profile.overhead_by_shape.items()):
        table.add_row("decode overhead", f"{seconds * 1e6:.1f} µs per layer per token ({shape})")
    gpu = profile.gpu
    table.add_row("GPU", "none" if gpu is None else
                  f"{gpu.name}, {format_size(gpu.memory_bytes)}, host to device {gbps(gpu.h2d_gbps)}")
    out.print(table)
    kernels = Table("bits", "decode GB/s", "of RAM read", "prefill GB/s per token", title="CPU kernels",
                    caption="packed weight bytes per second: 1-token products, and 32-token products "
                            "x 32 per token")
    for bits, rate in sorted(profile.kernel_gbps.items()):
        kernels.add_row(str(bits), f"{rate:.1f}", f"{rate / profile.ram_read_gbps:.0%}",
                        f"{profile.kernel_batch_gbps.get(bits, 0.0):.1f}")
    out.print(kernels)
    if gpu is not None and not gpu.kernel_gbps:
        out.print("GPU kernels: not measured (none exist yet)")


def convert(model: ModelArg = None,
            bits: Annotated[int, option("--bits", "-b", help="4 (Q4_1, which llama.cpp loads "
                                              "too), 3 or 2 (tierflow's TQ3_1, TQ2_1)")] = 4,
            output: Annotated[Optional[Path], option("--output", "-o", help="file to write")] = None,
            method: Annotated[str, option("--method", help="search (lower error) or rtn "
                                                "(round to nearest, fast)")] = "search",
            weight_type: Annotated[Optional[str], option("--type", "-t", help="Q2_K, Q3_K or IQ4_XS "
                                                          "instead of --bits: ggml's types, which "
                                                          "llama.cpp loads")] = None,
            force: Annotated[bool, option("--force", help="replace OUT if it exists")] = False,
            model_opt: ModelOpt = None) -> None:
    """Requantize a model's layer weights to 4, 3 or 2 bits (or a --type) and write them to OUT (-o)."""
    from tierflow.errors import InvalidArgumentError
    from tierflow.offload.gguf.convert import convert_model

    if output is None:
        raise InvalidArgumentError("give the file to write with -o/--output")
    source = model or model_opt
    with progress_bar(f"converting {model_name(source)}") as progress:
        report = convert_model(source, output, bits, method, progress, force=force, weight_type=weight_type)
    out.print(f"wrote {report.path}: {format_size(report.file_bytes)}, "
              f"{report.bits_per_weight:.2f} bits per weight overall; {report.num_requantized} "
              f"layer weights as {report.quant_type} ({report.requantized_bits_per_weight:.1f} bits "
              f"per weight, {report.method}), {report.num_copied} tensors copied; "
              f"{report.seconds:.1f} s", soft_wrap=True)
