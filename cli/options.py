"""The options the commands share; each can be set in the environment too (TIERFLOW_<OPTION>)."""

import os
from typing import Annotated, Optional

import typer


def option(flag: str, *aliases: str, **settings) -> typer.models.OptionInfo:
    """An option the environment can set too: --cpu-memory is also TIERFLOW_CPU_MEMORY."""
    return typer.Option(flag, *aliases, envvar="TIERFLOW_" + flag.lstrip("-").replace("-", "_").upper(),
                        **settings)


ModelOpt = Annotated[Optional[str], option(
    "--model", "-m", help="GGUF file, a preset, or a model name from ollama (llama3:8b), the Hugging Face "
    "cache or LM Studio (Org/Model[:Q4_K_M], pulled from Hugging Face when it is not on this disk); see "
    "`tierflow list` (default: bundled SmolLM2-135M-Instruct)")]
ModelArg = Annotated[Optional[str], typer.Argument(help="GGUF file or model name (default: bundled)")]
GpuOpt = Annotated[Optional[str], option("--gpu-memory", help="GPU weight budget, e.g. 4GiB")]
CpuOpt = Annotated[Optional[str], option("--cpu-memory", help="RAM weight budget, e.g. 8GiB")]
ThreadsOpt = Annotated[Optional[int], option("--threads", "-t", help="CPU threads")]
CtxOpt = Annotated[Optional[int], option(
    "--ctx", help="context length: the positions the KV cache holds (default: the model's trained context if "
    "the memory budgets hold it, else the most they do)")]
KvTypeOpt = Annotated[Optional[str], option(
    "--kv-type", help="KV cache type: f16 (default), f32, q8_0 or q4_0 (llama.cpp's -ctk/-ctv)")]
KvOnCpuOpt = Annotated[bool, option(
    "--kv-on-cpu", help="keep every layer's KV cache in RAM, the GPU layers' too (llama.cpp's -nkvo)")]
ParallelOpt = Annotated[Optional[int], option(
    "--parallel", "-np", help="requests generated together, each with its own KV cache (serve's default: "
    "4, 2 or 1, the most the budgets hold with 4096 positions each)")]
CpuMoeOpt = Annotated[bool, option(
    "--cpu-moe", help="keep every expert of a MoE model off the GPU (llama.cpp's --cpu-moe); by default "
    "the planner caches the hot ones in the GPU memory its layers leave")]
NCpuMoeOpt = Annotated[Optional[int], option(
    "--n-cpu-moe", help="keep the experts of a MoE model's layers 0..N-1 off the GPU and put every other "
    "layer's on it, where they must fit (llama.cpp's --n-cpu-moe)")]
ExpertSkipOpt = Annotated[float, option(
    "--expert-skip", help="a MoE model's expert that would be read from disk is skipped when the tokens "
    "that chose it give it less than this share of their router weight, its weight given to their other "
    "experts (AdapMoE); fewer bytes read, output no longer exact (default 0: never)")]
ExpertUnionCapOpt = Annotated[int, option(
    "--expert-union-cap", help="a MoE model's layer computes at most N distinct experts in a pass that "
    "verifies a draft's token tree, its tokens' lesser choices past N left out, those to be read from disk "
    "first; output no longer exact (default 0: no cap)")]
ExtendOpt = Annotated[bool, option(
    "--allow-context-extension", help="allow a --ctx past the model's trained context")]
DraftOpt = Annotated[Optional[str], option(
    "--draft", help="speculative decoding: 'ngram' (prompt lookup), a smaller GGUF with the same "
    "vocabulary (e.g. this model converted to 3 bits), 'self:N' (the model's own first N layers and "
    "head), 'self' (N chosen by measurement), 'mtp' (the file's multi-token-prediction block: Qwen3.5, "
    "Qwen3-Next), or 'auto' / 'auto:FILE' (the fastest of ngram, self and FILE, predicted by the "
    "planner, then measured); the output follows the model's own")]
DraftShapeOpt = Annotated[str, option("--draft-shape", help="a draft model's guesses: tree or chain")]
DraftTokensOpt = Annotated[Optional[int], option(
    "--draft-tokens", help="guesses per pass (default: sized by measured speed)")]
ChatTemplateOpt = Annotated[Optional[str], option(
    "--chat-template", help="the chat template instead of the file's: a Jinja file, or one of llama.cpp's "
    "built-in names (chatml, llama3, gemma, mistral-v7, phi3, ...)")]
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
LogLevelOpt = Annotated[str, option("--log-level", help="debug, info (a line per request), warning or error")]


def expert_options(cpu_moe: bool, n_cpu_moe: int | None, expert_skip: float, expert_union_cap: int) -> dict:
    """Engine.load's expert_placement from --cpu-moe and --n-cpu-moe, expert_skip and expert_union_cap."""
    if cpu_moe and n_cpu_moe is not None:
        raise typer.BadParameter("--cpu-moe and --n-cpu-moe both place the experts: give one of them")
    placement = "cpu" if cpu_moe else "auto" if n_cpu_moe is None else n_cpu_moe
    return dict(expert_placement=placement, expert_skip=expert_skip, expert_union_cap=expert_union_cap)


def cache_options(ctx, kv_type, kv_on_cpu, allow_context_extension) -> dict:
    """Engine.load's KV cache keywords from the shared options."""
    return dict(context_length=ctx, kv_cache_type=kv_type, kv_on_cpu=kv_on_cpu,
                allow_context_extension=allow_context_extension)


def _go_offline(offline: bool) -> None:
    """--offline: no pull from Hugging Face in this process (the library reads TIERFLOW_OFFLINE)."""
    if offline:
        os.environ["TIERFLOW_OFFLINE"] = "1"


OfflineOpt = Annotated[bool, option(
    "--offline", is_eager=True, callback=_go_offline,
    help="never download: a Hugging Face name that is not on this disk is an error, not a pull")]
