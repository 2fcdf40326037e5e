"""The `tierflow` command: thin wrappers that parse arguments and call the Python API."""

import importlib.metadata
import io
import json
import sys
from typing import Annotated, Optional

import typer
from rich.table import Table

from tierflow.cli.cache_commands import cache_app
from tierflow.cli.display import err, load_engine, model_name, out
from tierflow.cli.model_commands import convert, info, list_command, plan, probe
from tierflow.cli.options import (
    ChatTemplateOpt,
    CpuMoeOpt,
    CpuOpt,
    CtxOpt,
    DraftOpt,
    DraftShapeOpt,
    DraftTokensOpt,
    ExpertSkipOpt,
    ExpertUnionCapOpt,
    ExtendOpt,
    GpuOpt,
    KvOnCpuOpt,
    KvTypeOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelOpt,
    NCpuMoeOpt,
    OfflineOpt,
    PenaltyOpt,
    SeedOpt,
    StopOpt,
    TempOpt,
    ThreadsOpt,
    TopKOpt,
    TopPOpt,
    cache_options,
    expert_options,
    option,
)
from tierflow.cli.serve_command import ps, serve
from tierflow.cli.store_commands import pull, rm, show
from tierflow.errors import TierflowError

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)


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
        draft_tokens: DraftTokensOpt = None, kv_type: KvTypeOpt = None, kv_on_cpu: KvOnCpuOpt = False,
        allow_context_extension: ExtendOpt = False, cpu_moe: CpuMoeOpt = False,
        n_cpu_moe: NCpuMoeOpt = None, expert_skip: ExpertSkipOpt = 0.0,
        expert_union_cap: ExpertUnionCapOpt = 0, chat_template: ChatTemplateOpt = None,
        offline: OfflineOpt = False
        ) -> None:
    """Complete PROMPT once and print the completion (with --chat: answer it)."""
    sampling = _sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         repeat_penalty=repeat_penalty, seed=seed)
    sampling |= dict(max_tokens=max_tokens, stop=stop)
    if prompt == "-":
        prompt = _stdin_text()
    engine = load_engine(model, gpu_memory=gpu_memory, cpu_memory=cpu_memory, threads=threads, draft=draft,
                         draft_shape=draft_shape, draft_tokens=draft_tokens, chat_template=chat_template,
                         **expert_options(cpu_moe, n_cpu_moe, expert_skip, expert_union_cap),
                         **cache_options(ctx, kv_type, kv_on_cpu, allow_context_extension))
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
         kv_type: KvTypeOpt = None, kv_on_cpu: KvOnCpuOpt = False, allow_context_extension: ExtendOpt = False,
         cpu_moe: CpuMoeOpt = False, n_cpu_moe: NCpuMoeOpt = None, expert_skip: ExpertSkipOpt = 0.0,
         expert_union_cap: ExpertUnionCapOpt = 0,
         chat_template: ChatTemplateOpt = None,
         offline: OfflineOpt = False,
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
    engine = load_engine(model, gpu_memory=gpu_memory, cpu_memory=cpu_memory, threads=threads, draft=draft,
                         draft_shape=draft_shape, draft_tokens=draft_tokens, chat_template=chat_template,
                         **expert_options(cpu_moe, n_cpu_moe, expert_skip, expert_union_cap),
                         **cache_options(ctx, kv_type, kv_on_cpu, allow_context_extension))
    view = AnswerView(out, err, markdown=out.is_terminal and not plain)
    ChatSession(engine, system, sampling | {"max_tokens": max_tokens}, out,
                read_line=line_reader(cache_dir() / "chat_history"), view=view).run()


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
          draft_tokens: DraftTokensOpt = None, kv_type: KvTypeOpt = None, kv_on_cpu: KvOnCpuOpt = False,
          allow_context_extension: ExtendOpt = False, cpu_moe: CpuMoeOpt = False,
          n_cpu_moe: NCpuMoeOpt = None, expert_skip: ExpertSkipOpt = 0.0,
          expert_union_cap: ExpertUnionCapOpt = 0) -> None:
    """Time prompt processing and generation (greedy by default): the median of the timed runs,
    after one untimed warm-up; with --draft, also guesses accepted and tokens per target pass."""
    if repetitions < 1 or max_tokens < 1:
        raise typer.BadParameter("--repetitions and --max-tokens must be at least 1")
    sampling = _sampling(temperature=temperature, seed=seed)
    engine = load_engine(model, gpu_memory=gpu_memory, cpu_memory=cpu_memory, threads=threads, draft=draft,
                         draft_shape=draft_shape, draft_tokens=draft_tokens,
                         **expert_options(cpu_moe, n_cpu_moe, expert_skip, expert_union_cap),
                         **cache_options(ctx, kv_type, kv_on_cpu, allow_context_extension))
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
    table = Table(title=f"{model_name(model)}" + (f", draft {draft} ({draft_shape})" if draft else ""))
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
    from tierflow.runtime.sampling.sampler import SamplingParams

    settings = {name: value for name, value in options.items() if value is not None}
    SamplingParams(**settings)
    return settings


for command in (serve, ps, pull, show, rm, info, plan, probe, convert):
    app.command()(command)
app.command("list")(list_command)
app.add_typer(cache_app, name="cache")

if __name__ == "__main__":
    main()
