"""The `tierflow` command: thin wrappers that parse arguments and call the Python API."""

import importlib.metadata
import io
import json
import logging
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from tierflow.cli.cache_commands import cache_app
from tierflow.cli.options import option
from tierflow.errors import TierflowError
from tierflow.units import format_size

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)
app.add_typer(cache_app, name="cache")

ModelOpt = Annotated[Optional[str], option(
    "--model", "-m", help="GGUF file, or a model name from ollama (llama3:8b), the Hugging Face cache or "
    "LM Studio (Org/Model[:Q4_K_M]); see `tierflow list` (default: bundled SmolLM2-135M-Instruct)")]
ModelArg = Annotated[Optional[str], typer.Argument(help="GGUF file or model name (default: bundled)")]
GpuOpt = Annotated[Optional[str], option("--gpu-memory", help="GPU weight budget, e.g. 4GiB")]
CpuOpt = Annotated[Optional[str], option("--cpu-memory", help="RAM weight budget, e.g. 8GiB")]
ThreadsOpt = Annotated[Optional[int], option("--threads", "-t", help="CPU threads")]
CtxOpt = Annotated[Optional[int], option("--ctx", help="context length (KV cache size)")]
DraftOpt = Annotated[Optional[str], option(
    "--draft", help="speculative decoding: 'ngram' (prompt lookup) or a smaller GGUF with the same "
    "vocabulary (e.g. this model converted to 3 bits); the output follows the model's own")]
DraftShapeOpt = Annotated[str, option("--draft-shape", help="a draft model's guesses: tree or chain")]
DraftTokensOpt = Annotated[Optional[int], option(
    "--draft-tokens", help="guesses per pass (default: sized by measured speed)")]
MaxTokensOpt = Annotated[int, option("--max-tokens", "-n", help="tokens to generate at most")]
# Sampling options left unset take the model file's recommendation (general.sampling.*), else
# tierflow's defaults (SamplingParams).
_MODEL_DEFAULT = "[default: the model's recommendation, else tierflow's]"
TempOpt = Annotated[Optional[float], option("--temperature", help=f"0 is greedy {_MODEL_DEFAULT}")]
TopKOpt = Annotated[Optional[int], option("--top-k", help=f"0 disables {_MODEL_DEFAULT}")]
TopPOpt = Annotated[Optional[float], option("--top-p", help=f"1 disables {_MODEL_DEFAULT}")]
MinPOpt = Annotated[Optional[float], option("--min-p", help=f"0 disables {_MODEL_DEFAULT}")]
PenaltyOpt = Annotated[Optional[float], option("--repeat-penalty", help=f"1 disables {_MODEL_DEFAULT}")]
SeedOpt = Annotated[Optional[int], option("--seed")]
StopOpt = Annotated[Optional[list[str]], option("--stop", help="stop string (repeatable)")]


def main() -> None:
    """Console-script entry point: a TierflowError is one line on stderr and exit code 2."""
    try:
        app()
    except TierflowError as error:
        err.print(f"[red]error:[/red] {error}", soft_wrap=True)
        sys.exit(2)


def _print_version(asked: bool) -> None:
    if asked:
        out.print(f"tierflow {importlib.metadata.version('tierflow')}")
        raise typer.Exit()


VersionOpt = Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print the version and exit")]


@app.callback()
def _options_of_every_command(version: VersionOpt = False) -> None:
    """Run language models larger than your GPU. Every option can also be set in the environment:
    --cpu-memory as TIERFLOW_CPU_MEMORY, --model as TIERFLOW_MODEL, and so on."""


@contextmanager
def _progress_bar(label: str):
    """A progress bar on stderr (when stderr is a terminal), fed (phase, bytes done, total)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    if not err.is_terminal:
        yield None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as bar:
        task, phases = bar.add_task(label, total=None), [None]

        def update(phase: str, done: int, total: int) -> None:
            if phase != phases[-1]:  # a new phase: its rate and time left are its own
                phases.append(phase)
                bar.reset(task, description=f"{label}: {phase}")
            bar.update(task, completed=done, total=total or None)

        yield update


def _model_name(model: Optional[str]) -> str:
    """A file's name, or the model name as given."""
    if model is None:
        return "SmolLM2-135M-Instruct (bundled)"
    return Path(model).name if Path(model).exists() else model


def _loading(model: Optional[str]):
    """A progress bar on stderr while weights load (when stderr is a terminal)."""
    return _progress_bar(f"loading {_model_name(model)}")


class _Notices(logging.Handler):
    """Shows the library's INFO messages (a pack's size and place, as it is built) on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        err.print(record.getMessage(), markup=False, soft_wrap=True)


@contextmanager
def _pack_notices():
    """Shows, while a model loads, where its pack goes and how large it is, if it is built (on a
    terminal, like the progress bar: piped stderr stays one line per error)."""
    if not err.is_terminal:
        yield
        return
    logger, handler = logging.getLogger("tierflow.offload.pack"), _Notices(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _load(model, gpu_memory, cpu_memory, threads, ctx, draft=None, draft_shape="tree", draft_tokens=None):
    from tierflow.runtime.engine import Engine

    with _pack_notices(), _loading(model) as progress:
        return Engine.load(model, gpu_memory=gpu_memory, cpu_memory=cpu_memory, threads=threads,
                           context_length=ctx, progress=progress, draft=draft, draft_shape=draft_shape,
                           draft_tokens=draft_tokens)


@app.command()
def run(prompt: Annotated[str, typer.Argument(help="text to complete; - reads it from stdin")],
        model: ModelOpt = None,
        max_tokens: MaxTokensOpt = 256, temperature: TempOpt = None, top_k: TopKOpt = None,
        top_p: TopPOpt = None, min_p: MinPOpt = None, repeat_penalty: PenaltyOpt = None,
        seed: SeedOpt = None, stop: StopOpt = None,
        as_json: Annotated[bool, option("--json", help="print text, tokens and stats as JSON")] = False,
        as_chat: Annotated[bool, option("--chat", help="apply the chat template: PROMPT is one user "
                                                      "message, the answer the assistant's")] = False,
        gpu_memory: GpuOpt = None, cpu_memory: CpuOpt = None, threads: ThreadsOpt = None,
        ctx: CtxOpt = None, draft: DraftOpt = None, draft_shape: DraftShapeOpt = "tree",
        draft_tokens: DraftTokensOpt = None) -> None:
    """Complete PROMPT once and print the completion (with --chat: answer it)."""
    sampling = _sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         repeat_penalty=repeat_penalty, seed=seed)
    sampling |= dict(max_tokens=max_tokens, stop=stop)
    if prompt == "-":
        prompt = _stdin_text()
    engine = _load(model, gpu_memory, cpu_memory, threads, ctx, draft, draft_shape, draft_tokens)
    stream = (engine.chat_stream([{"role": "user", "content": prompt}], **sampling) if as_chat
              else engine.stream(prompt, **sampling))
    if as_json:
        for _ in stream:
            pass
        result = stream.result
        print(json.dumps({"text": result.text, "tokens": result.tokens,
                          "finish_reason": result.finish_reason, "stats": result.stats.as_dict()}))
        return
    try:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    sys.stdout.write("\n")


def _stdin_text() -> str:
    """All of stdin, as text; bytes that are not UTF-8 reach the engine, which names the problem
    (as they do from argv)."""
    return sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")


@app.command()
def chat(model: ModelOpt = None,
         system: Annotated[Optional[str], option("--system", help="system prompt")] = None,
         max_tokens: MaxTokensOpt = 1024, temperature: TempOpt = None, top_k: TopKOpt = None,
         top_p: TopPOpt = None, min_p: MinPOpt = None, repeat_penalty: PenaltyOpt = None,
         seed: SeedOpt = None, gpu_memory: GpuOpt = None, cpu_memory: CpuOpt = None,
         threads: ThreadsOpt = None, ctx: CtxOpt = None, draft: DraftOpt = None,
         draft_shape: DraftShapeOpt = "tree", draft_tokens: DraftTokensOpt = None,
         plain: Annotated[bool, option("--plain", help="print answers as plain text, not as "
                                                     "rendered markdown")] = False) -> None:
    """Chat interactively. /help lists the commands (/system, /set, /save, /load, /reset, /exit),
    Ctrl-D quits, Ctrl-C stops the current answer; Up and Down recall earlier lines."""
    from tierflow.cli.chat_session import ChatSession
    from tierflow.cli.chat_terminal import AnswerView, line_reader
    from tierflow.offload.plan.profile import cache_dir

    sampling = _sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         repeat_penalty=repeat_penalty, seed=seed)
    if isinstance(sys.stdin, io.TextIOWrapper):
        # Input that is not UTF-8 reaches the engine, which names the problem, whatever the locale
        # (a strict one would make input() raise UnicodeDecodeError), as argv does.
        sys.stdin.reconfigure(errors="surrogateescape")
    engine = _load(model, gpu_memory, cpu_memory, threads, ctx, draft, draft_shape, draft_tokens)
    view = AnswerView(out, err, markdown=out.is_terminal and not plain)
    ChatSession(engine, system, sampling | {"max_tokens": max_tokens}, out,
                read_line=line_reader(cache_dir() / "chat_history"), view=view).run()


@app.command()
def serve(model: ModelOpt = None,
          host: Annotated[str, option("--host", help="address to bind; keep loopback unless "
                                            "other machines must reach it")] = "127.0.0.1",
          port: Annotated[int, option("--port")] = 8000,
          api_key: Annotated[Optional[str], option(
              "--api-key", help="require 'Authorization: Bearer KEY'")] = None,
          cors_origin: Annotated[Optional[list[str]], option(
              "--cors-origin", help="browser origin allowed to call the API (repeatable)")] = None,
          max_prompt_chars: Annotated[Optional[int], option(
              "--max-prompt-chars", help="characters of prompt text a request may send "
              "(default: 16 per context position)")] = None,
          gpu_memory: GpuOpt = None, cpu_memory: CpuOpt = None, threads: ThreadsOpt = None,
          ctx: CtxOpt = None, draft: DraftOpt = None, draft_shape: DraftShapeOpt = "tree",
          draft_tokens: DraftTokensOpt = None) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) and a chat page."""
    from tierflow.cli.server import ServerSettings
    from tierflow.cli.server import serve as serve_forever

    settings = ServerSettings(host=host, port=port, api_key=api_key, cors_origins=tuple(cors_origin or ()),
                              max_prompt_chars=max_prompt_chars)
    engine = _load(model, gpu_memory, cpu_memory, threads, ctx, draft, draft_shape, draft_tokens)
    if not settings.is_loopback and settings.api_key is None:
        err.print(f"[yellow]warning:[/yellow] {host} is reachable from other machines and no --api-key "
                  "is set", soft_wrap=True)
    out.print(f"serving {engine.path.stem} at {settings.url}")
    serve_forever(engine, settings)


BENCH_PROMPT = "Once upon a time, in a small village by the sea, there lived"


@app.command()
def bench(model: ModelOpt = None,
          prompt: Annotated[str, option("--prompt", "-p", help="text to complete")] = BENCH_PROMPT,
          max_tokens: Annotated[int, option("--max-tokens", "-n", help="tokens to generate")] = 128,
          repetitions: Annotated[int, option("--repetitions", "-r", help="timed runs")] = 3,
          temperature: Annotated[float, option("--temperature", help="0 is greedy")] = 0.0,
          seed: SeedOpt = None,
          as_json: Annotated[bool, option("--json", help="print the figures as JSON")] = False,
          gpu_memory: GpuOpt = None, cpu_memory: CpuOpt = None, threads: ThreadsOpt = None,
          ctx: CtxOpt = None, draft: DraftOpt = None, draft_shape: DraftShapeOpt = "tree",
          draft_tokens: DraftTokensOpt = None) -> None:
    """Time prompt processing and generation (greedy by default): the median of the timed runs,
    after one untimed warm-up; with --draft, also guesses accepted and tokens per target pass."""
    if repetitions < 1 or max_tokens < 1:
        raise typer.BadParameter("--repetitions and --max-tokens must be at least 1")
    sampling = _sampling(temperature=temperature, seed=seed)
    engine = _load(model, gpu_memory, cpu_memory, threads, ctx, draft, draft_shape, draft_tokens)
    with engine:
        engine.generate(prompt, max_tokens=max_tokens, **sampling)
        runs = []
        for _ in range(repetitions):
            engine.generate(".", max_tokens=1)  # a new prompt: the next run's prefill is not cached
            runs.append(engine.generate(prompt, max_tokens=max_tokens, **sampling).stats)
    figures = _bench_figures(runs)
    if as_json:
        print(json.dumps(figures))
        return
    table = Table(title=f"{_model_name(model)}" + (f", draft {draft} ({draft_shape})" if draft else ""))
    for name in figures:
        table.add_column(name.replace("_", " "), justify="right")
    table.add_row(*(f"{value:g}" for value in figures.values()))
    out.print(table)


def _bench_figures(runs: list) -> dict:
    import statistics

    def median(values):
        return round(statistics.median(values), 2)

    return {"prompt_tokens": runs[0].prompt_tokens,
            "prefill_tokens_per_s": median([r.prefill_tokens_per_s for r in runs]),
            "generated_tokens": median([r.generated_tokens for r in runs]),
            "decode_tokens_per_s": median([r.decode_tokens_per_s for r in runs]),
            "tokens_per_pass": median([r.tokens_per_pass for r in runs]),
            "accepted_of_drafted": median([r.accepted_tokens / max(r.drafted_tokens, 1) for r in runs])}


def _sampling(**options) -> dict:
    """The sampling settings given (the rest take the model's defaults), checked before a model
    loads so a typo fails fast."""
    from tierflow.runtime.sampler import SamplingParams

    settings = {name: value for name, value in options.items() if value is not None}
    SamplingParams(**settings)
    return settings


@app.command()
def info(model: ModelArg = None, model_opt: ModelOpt = None) -> None:
    """Show a model's architecture, sizes, tensor types and bytes per tier (loads no weights)."""
    from tierflow.runtime.model_info import describe_model

    summary = describe_model(model or model_opt)
    table = Table(title=str(summary.path), show_header=False)
    for key, value in summary.rows():
        table.add_row(key, str(value))
    out.print(table)
    types = Table("tensor type", "tensors", "bytes in file")
    for type_name, (count, nbytes) in sorted(summary.tensor_types.items()):
        types.add_row(type_name, str(count), format_size(nbytes))
    out.print(types)


@app.command("list")
def list_command(as_json: Annotated[bool, option("--json", help="print the list as JSON")] = False
                 ) -> None:
    """List the models ollama, the Hugging Face cache and LM Studio hold on this machine, by the name
    -m takes (reads headers only)."""
    from tierflow.offload.gguf.model_list import list_models

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
    out.print(table if models else "no models found in ollama, the Hugging Face cache or LM Studio")


@app.command()
def plan(model: ModelArg = None, model_opt: ModelOpt = None, gpu_memory: GpuOpt = None,
         cpu_memory: CpuOpt = None,
         threads: ThreadsOpt = None, ctx: CtxOpt = None,
         prompt_tokens: Annotated[Optional[int], option(
             "--prompt-tokens", help="prompt length of the prefill prediction, and the position of "
             "the decode one (default: 512, at most the context)")] = None,
         as_json: Annotated[bool, option("--json", help="print the plan as JSON")] = False) -> None:
    """Show where each layer would live and compute, the memory it takes and the predicted
    tokens/s, before anything loads (reads the header and the cached hardware profile)."""
    from tierflow.offload.plan.profile import profile_path
    from tierflow.runtime.loader import plan_file, thread_count

    threads = thread_count(threads)
    if not profile_path(threads).exists():
        err.print("measuring this machine once for the planner (tierflow probe), about 20 s", soft_wrap=True)
    result = plan_file(model or model_opt, threads=threads, gpu_memory=gpu_memory, cpu_memory=cpu_memory,
                       context_length=ctx, prompt_tokens=prompt_tokens)
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


@app.command()
def probe(threads: ThreadsOpt = None,
          refresh: Annotated[bool, option("--refresh", help="measure again, replacing the "
                                                "cached profile")] = False,
          as_json: Annotated[bool, option("--json", help="print the profile as JSON")] = False) -> None:
    """Measure disk, RAM and kernel speeds: the hardware profile the planner predicts with.

    Measured once (about 20 s) and cached; --refresh measures again."""
    from tierflow.offload.plan.probe import ProbeWarning, load_profile
    from tierflow.offload.plan.profile import profile_path
    from tierflow.runtime.loader import thread_count

    threads = thread_count(threads)
    with warnings.catch_warnings(record=True) as caught, _status("measuring") as progress:
        warnings.simplefilter("always", ProbeWarning)
        profile = load_profile(threads, refresh=refresh, progress=progress)
    for warning in caught:
        if issubclass(warning.category, ProbeWarning):
            err.print(f"[yellow]warning:[/yellow] {warning.message}", soft_wrap=True)
    if as_json:
        print(profile.to_json())
        return
    _print_profile(profile)
    out.print(f"cached in {profile_path(threads)} (--refresh measures again)", soft_wrap=True)


@contextmanager
def _status(label: str):
    """A spinner on stderr (when stderr is a terminal) naming the step, fed step names."""
    if not err.is_terminal:
        yield None
        return
    with err.status(label) as status:
        yield lambda step: status.update(f"{label} {step}")


def _print_profile(profile) -> None:
    gbps = "{:.1f} GB/s".format
    table = Table(title=f"hardware profile, {profile.threads} threads", show_header=False)
    table.add_row("CPU", profile.cpu_name)
    table.add_row("disk read", f"{gbps(profile.disk_read_gbps)} "
                  f"({'O_DIRECT' if profile.disk_direct_io else 'buffered, page cache dropped'})")
    table.add_row("RAM read", gbps(profile.ram_read_gbps))
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


@app.command()
def convert(model: ModelArg = None,
            bits: Annotated[int, option("--bits", "-b", help="4 (Q4_1, which llama.cpp loads "
                                              "too), 3 or 2 (tierflow's TQ3_1, TQ2_1)")] = 4,
            output: Annotated[Optional[Path], option("--output", "-o", help="file to write")] = None,
            method: Annotated[str, option("--method", help="search (lower error) or rtn "
                                                "(round to nearest, fast)")] = "search",
            force: Annotated[bool, option("--force", help="replace OUT if it exists")] = False,
            model_opt: ModelOpt = None) -> None:
    """Requantize a model's layer weights to 4, 3 or 2 bits and write them to OUT (-o)."""
    from tierflow.errors import InvalidArgumentError
    from tierflow.offload.gguf.convert import convert_model

    if output is None:
        raise InvalidArgumentError("give the file to write with -o/--output")
    source = model or model_opt
    with _progress_bar(f"converting {_model_name(source)}") as progress:
        report = convert_model(source, output, bits, method, progress, force=force)
    out.print(f"wrote {report.path}: {format_size(report.file_bytes)}, "
              f"{report.bits_per_weight:.2f} bits per weight overall; {report.num_requantized} "
              f"layer weights as {report.quant_type} ({report.requantized_bits_per_weight:.1f} bits "
              f"per weight, {report.method}), {report.num_copied} tensors copied; "
              f"{report.seconds:.1f} s", soft_wrap=True)


if __name__ == "__main__":
    main()
