"""`tierflow serve` (one or several models, by name) and `tierflow ps` (what a running server holds)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from tierflow.cli.display import err, load_engine, out
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
    LogLevelOpt,
    NCpuMoeOpt,
    OfflineOpt,
    ParallelOpt,
    ThreadsOpt,
    cache_options,
    expert_options,
    option,
)
from tierflow.cli.store_commands import pull_missing

ServedOpt = Annotated[Optional[list[str]], option(
    "--model", "-m", help="a model to serve, as NAME=FILE or a GGUF file, preset or model name alone, which "
    "is then its name (repeatable: requests pick one by their `model`; the first loads at start, the others "
    "when first asked for) [default: bundled SmolLM2-135M-Instruct]")]
KeepAliveOpt = Annotated[Optional[str], option(
    "--keep-alive", help="how long an idle model stays loaded: a duration (30s, 5m, 1h), 0 to unload after "
    "each answer, -1 for ever [default: 5m with several models, for ever with one]")]
MaxModelsOpt = Annotated[int, option("--max-models", help="models loaded at once; a load past them "
                                     "unloads the least recently used idle one")]


def serve(model: ServedOpt = None,
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
          max_tokens_limit: Annotated[Optional[int], option(
              "--max-tokens-limit", help="the most tokens a request may ask for (default: no limit; an "
              "answer ends at the context's end)")] = None,
          no_context_shift: Annotated[bool, option(
              "--no-context-shift", help="refuse a chat longer than the context, as OpenAI's API does, "
              "rather than drop its oldest turns")] = False,
          keep_alive: KeepAliveOpt = None, max_models: MaxModelsOpt = 3,
          parallel: ParallelOpt = None,
          log_level: LogLevelOpt = "info",
          gpu_memory: GpuOpt = None, cpu_memory: CpuOpt = None, threads: ThreadsOpt = None,
          ctx: CtxOpt = None, draft: DraftOpt = None, draft_shape: DraftShapeOpt = "tree",
          draft_tokens: DraftTokensOpt = None, kv_type: KvTypeOpt = None, kv_on_cpu: KvOnCpuOpt = False,
          allow_context_extension: ExtendOpt = False, cpu_moe: CpuMoeOpt = False,
          n_cpu_moe: NCpuMoeOpt = None, expert_skip: ExpertSkipOpt = 0.0,
          expert_union_cap: ExpertUnionCapOpt = 0,
          chat_template: ChatTemplateOpt = None,
          offline: OfflineOpt = False
          ) -> None:
    """Serve OpenAI's API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings,
    /v1/models), ollama's (/api/chat, /api/generate, /api/embed, /api/tags, /api/ps, /api/show),
    Anthropic's (/v1/messages), llama-server's /tokenize, /detokenize and /props, /metrics and a chat
    page, for each model by name. A Hugging Face name that is not on this disk is pulled first
    (unless --offline). The address is bound before the first model loads, so one that is taken
    fails at once."""
    from tierflow.server.listen import listening
    from tierflow.server.model_pool import DEFAULT_KEEP_ALIVE_S, FOREVER, ModelPool, parse_keep_alive
    from tierflow.server.openai_schema import ApiError
    from tierflow.server.routes import ServerSettings, generations_of
    from tierflow.server.routes import serve as serve_forever
    from tierflow.units import parse_size

    sources = served_models(model or [None])
    for source in sources.values():
        pull_missing(source)
    if max_models < 1:
        raise typer.BadParameter("--max-models must be at least 1")
    try:
        keep_alive_s = parse_keep_alive(keep_alive, "--keep-alive")
    except ApiError as error:
        raise typer.BadParameter(error.message) from None
    if keep_alive_s is None:
        keep_alive_s = FOREVER if len(sources) == 1 else DEFAULT_KEEP_ALIVE_S
    settings = ServerSettings(host=host, port=port, api_key=api_key, cors_origins=tuple(cors_origin or ()),
                              max_prompt_chars=max_prompt_chars, max_tokens_limit=max_tokens_limit,
                              context_shift=not no_context_shift, log_level=log_level.lower())
    loader = _Loader(dict(cpu_memory=cpu_memory, gpu_memory=gpu_memory, threads=threads, draft=draft,
                          draft_shape=draft_shape, draft_tokens=draft_tokens, chat_template=chat_template,
                          **expert_options(cpu_moe, n_cpu_moe, expert_skip, expert_union_cap),
                          parallel="auto" if parallel is None else parallel,
                          **cache_options(ctx, kv_type, kv_on_cpu, allow_context_extension)))
    budgets = {tier: parse_size(size) for tier, size in (("cpu", cpu_memory), ("gpu", gpu_memory)) if size}
    # While a model loads, as many requests wait for it as it would take loaded: its queue, and
    # --parallel (4 at most when the budgets choose) answered at once.
    waiting = settings.max_queued + (parallel or 4)
    pool = ModelPool(sources, loader, generations_of(settings), keep_alive_s=keep_alive_s,
                     max_loaded=max_models, budgets=budgets, max_waiting=waiting)
    with listening(settings) as sockets:
        first = pool.preload(next(iter(sources)))
        if not settings.is_loopback and settings.api_key is None:
            err.print(f"[yellow]warning:[/yellow] {host} is reachable from other machines and no --api-key "
                      "is set", soft_wrap=True)
        others = f"; on demand: {', '.join(list(sources)[1:])}" if len(sources) > 1 else ""
        out.print(f"serving {first.name} at {settings.url} ({first.engine.parallel} at a time, "
                  f"{first.engine.context_length} positions each){others}", soft_wrap=True)
        serve_forever(pool, settings, sockets)


def served_models(given: list[str | None]) -> dict[str, str]:
    """Names to files or store names, from serve's -m values: NAME=FILE, or a file (named by its
    stem) or a store name (named as given) alone; None is the bundled model."""
    from tierflow.offload.store.model_path import resolve_model_path

    sources: dict[str, str] = {}
    for value in given:
        if value is None:
            value = str(resolve_model_path(None))
        name, _, source = value.partition("=")
        if not source or "/" in name or not name:  # no NAME= in front: the value is the model
            path, source = Path(value), value
            name = path.stem if path.suffix == ".gguf" or path.is_file() else value
        if name in sources:
            raise typer.BadParameter(f"two models are served as {name!r}: name one of them (-m NAME=FILE)")
        sources[name] = source
    return sources


@dataclass
class _Loader:
    """How the server loads a model on demand: serve's options, its memory within what is left."""

    options: dict

    def needs(self, source: str) -> dict[str, int]:
        from tierflow.offload.store.presets import find_preset
        from tierflow.runtime.loading.loader import CacheOptions, plan_file, thread_count

        preset = find_preset(source)
        options = self.options if preset is None else preset.filled(self.options)
        source = source if preset is None else preset.model
        cache = CacheOptions(options["context_length"], options["kv_cache_type"], options["kv_on_cpu"],
                             options["allow_context_extension"])
        plan = plan_file(source, threads=thread_count(options["threads"]), cpu_memory=options["cpu_memory"],
                         gpu_memory=options["gpu_memory"], cache=cache,
                         expert_placement=options["expert_placement"], expert_skip=options["expert_skip"],
                         expert_union_cap=options["expert_union_cap"])
        return {tier: plan.used_bytes[tier] for tier in ("cpu", "gpu")}

    def load(self, source: str, budgets: dict[str, int]):
        memory = {f"{tier}_memory": budget for tier, budget in budgets.items()}
        return load_engine(source, **(self.options | memory))


def ps(url: Annotated[str, option("--url", help="the server's base URL")] = "http://127.0.0.1:8000") -> None:
    """Show the models a running `tierflow serve` has loaded: memory per tier, context, until when."""
    import httpx

    try:
        models = httpx.get(f"{url.rstrip('/')}/api/ps", timeout=10).raise_for_status().json()["models"]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        err.print(f"[red]error:[/red] no tierflow server answered at {url}: {error}", soft_wrap=True)
        raise typer.Exit(2) from None
    from tierflow.units import format_size

    table = Table("name", "RAM", "GPU", "context", "until")
    for model in models:
        table.add_row(model["name"], format_size(model["size"] - model["size_vram"]),
                      format_size(model["size_vram"]), str(model.get("context_length", "")),
                      model["expires_at"])
    out.print(table if models else f"no model is loaded at {url}")
