"""The one loader: from a model file and the user's budgets to its weights, placed as planned.

    model = open_model_file(path)                         # header, family, config, tensors checked
    budgets = resolve_budgets(model, sizes, cpu_memory, gpu_budget, context_length)
    plan = make_plan(model, sizes, profile, **budgets)    # offload/plan/planner.py
    weights = place_weights(model, plan, gpu, progress)   # the pack (built once), placed as planned

Engine.load, the draft's placement, `tierflow plan` and `tierflow info` all go through here, so
the placement `tierflow plan` prints is the one a load then holds. This is the one place default
budgets are decided:
- gpu_memory: 0 (the GPU is used when asked for);
- cpu_memory: the available RAM less a margin (max(10% of RAM, 1 GiB)), the KV cache and the
  activations of a prefill chunk;
- context length: the model's, capped at DEFAULT_CONTEXT_CAP.
The machine's speeds are needed only when something streams or a GPU budget is given; they are
measured once (`tierflow probe`, cached), and the per-layer overhead once per model shape.
"""

import os
from dataclasses import dataclass, replace

import psutil
import torch

from tierflow.errors import BudgetError, ContextLengthError, InvalidArgumentError, ModelFileError
from tierflow.gpu_kernels.launch import load_all_kernels
from tierflow.gpu_kernels.layer_kernels import TritonKernels
from tierflow.offload.gguf.model_file import ModelFile, open_model_file
from tierflow.offload.gguf.model_path import resolve_model_path
from tierflow.offload.gguf.vocab_file import llama_vocab_file
from tierflow.offload.pack.writer import LoadProgress, PackSizes, open_pack, pack_sizes
from tierflow.offload.plan.budgets import available_ram_bytes, kv_cache_bytes, scratch_bytes
from tierflow.offload.plan.planner import DEFAULT_PROMPT_TOKENS, Plan, make_plan
from tierflow.offload.plan.probe import load_profile, save_profile
from tierflow.offload.plan.profile import GpuProfile, HardwareProfile
from tierflow.offload.tiers.device import DeviceTier
from tierflow.offload.tiers.tiered import TieredWeights
from tierflow.runtime.config import ModelConfig
from tierflow.runtime.generation import PREFILL_CHUNK, TokenGenerator
from tierflow.runtime.kv_cache import KVCache
from tierflow.runtime.model import Decoder, Kernels
from tierflow.runtime.overhead import measure_layer_overhead, shape_key
from tierflow.runtime.tokenizer import Tokenizer
from tierflow.runtime.vocabulary import check_vocabulary
from tierflow.units import parse_size

DEFAULT_CONTEXT_CAP = 4096  # the KV cache length a load defaults to
GPU_DEVICES = ("cpu", "interpret")


@dataclass(frozen=True)
class GpuTier:
    """Where layers placed on the GPU tier live and what computes them."""

    budget: int  # gpu_memory in bytes; 0: no GPU tier
    device: torch.device
    kernels: Kernels | None  # None: the CPU kernels (the CPU standing in for a GPU)


@dataclass(frozen=True)
class Budgets:
    cpu_bytes: int  # weights in RAM (the ring and expert caches included)
    gpu_bytes: int  # weights and their KV caches on the GPU
    context_length: int

    def less(self, held: dict[str, int]) -> "Budgets":
        """What is left after `held` bytes per tier ("cpu", "gpu") were placed first."""
        return replace(self, cpu_bytes=self.cpu_bytes - held["cpu"], gpu_bytes=self.gpu_bytes - held["gpu"])


class LoadedModel:
    """A model's weights placed as planned, and a decoder over them with its KV cache (each
    layer's where it computes, allocated here: the budgets of what loads next see it)."""

    def __init__(self, model: ModelFile, plan: Plan, weights: TieredWeights, context_length: int):
        self.path, self.arch, self.config = model.path, model.arch, model.config
        self.plan, self.weights, self.context_length = plan, weights, context_length
        decoder = Decoder(self.config, self.arch.block, weights, context_length)
        self.generator = TokenGenerator(decoder, KVCache(self.config, context_length, weights.allocate_cache))

    def bytes_by_tier(self) -> dict[str, int]:
        return self.weights.bytes_by_tier()

    def close(self) -> None:
        self.weights.close()


def thread_count(threads: int | None) -> int:
    """The CPU threads to compute with: the physical cores unless given."""
    if threads is None:
        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r}")
    return threads


def context_length_for(requested: int | None, config: ModelConfig) -> int:
    if requested is None:
        return min(config.context_length, DEFAULT_CONTEXT_CAP)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise InvalidArgumentError(f"context_length must be a positive integer, got {requested!r}")
    if requested > config.context_length:
        raise ContextLengthError(f"context_length {requested} exceeds the model's {config.context_length}")
    return requested


def resolve_budgets(model: ModelFile, cpu_memory: int | str | None, gpu_budget: int,
                    context_length: int) -> Budgets:
    """The budgets of a load: cpu_memory as given, or by default the available RAM less a
    margin and what the KV cache and a prefill chunk's activations will take."""
    if cpu_memory is not None:
        cpu = parse_size(cpu_memory)
    else:
        prompt = min(DEFAULT_PROMPT_TOKENS, context_length)
        reserved = (kv_cache_bytes(model.config, context_length)
                    + scratch_bytes(model.config, min(prompt, PREFILL_CHUNK), prompt))
        cpu = available_ram_bytes(reserved)
    return Budgets(cpu, gpu_budget, context_length)


def gpu_tier(gpu_memory: int | str | None, gpu_device: str | None) -> GpuTier:
    """The GPU tier gpu_memory asks for: CUDA with the Triton kernels, or for testing the CPU
    standing in for a GPU (gpu_device "cpu": the CPU kernels; "interpret": the GPU kernels in
    Triton's interpreter)."""
    budget = parse_size(gpu_memory) if gpu_memory is not None else 0
    if gpu_device not in (None, *GPU_DEVICES):
        raise InvalidArgumentError(f"gpu_device must be 'cpu' or 'interpret' (the CPU standing in for a GPU, "
                                   f"for testing) or left out, not {gpu_device!r}")
    if gpu_device == "cpu" or budget == 0:
        return GpuTier(budget, torch.device("cpu"), None)
    if gpu_device == "interpret":
        try:
            load_all_kernels(interpret=True)
        except RuntimeError as error:  # Triton was imported without its interpreter
            raise InvalidArgumentError(f"gpu_device='interpret': {error}; set TRITON_INTERPRET=1 "
                                       f"first") from error
        return GpuTier(budget, torch.device("cpu"), TritonKernels(torch.device("cpu")))
    if not torch.cuda.is_available():
        raise BudgetError("gpu_memory was given but no CUDA GPU is available; omit it or use 0")
    load_all_kernels()  # a TritonUnavailableError that says how to get Triton, before any load
    device = torch.device("cuda", torch.cuda.current_device())
    return GpuTier(budget, device, TritonKernels(device))


def model_profile(model: ModelFile, threads: int, gpu: GpuTier | None = None,
                  progress: LoadProgress | None = None) -> HardwareProfile:
    """This machine's measured profile (probed once and cached), with the per-layer overhead of
    this model's shape (measured once per shape, cached with it); the CPU standing in for a GPU
    gets the CPU's own speeds as the GPU's."""
    def measuring(step: str) -> None:  # a first streamed load on a machine probes it (~20 s)
        if progress is not None:
            progress(f"measuring this machine for the planner ({step})", 0, 0)

    profile = load_profile(threads, progress=measuring)
    key = shape_key(model.config)
    if key not in profile.overhead_by_shape:
        seconds = measure_layer_overhead(model.arch, model.config, threads)
        profile = replace(profile, overhead_by_shape={**profile.overhead_by_shape, key: seconds})
        save_profile(profile)
    profile = replace(profile, layer_overhead_s=profile.overhead_by_shape[key])
    if gpu is not None and gpu.budget and gpu.device.type == "cpu":
        profile = replace(profile, gpu=GpuProfile("the CPU standing in for a GPU", gpu.budget,
                                                  profile.ram_read_gbps, dict(profile.kernel_gbps)))
    return profile


def plan_load(model: ModelFile, sizes: PackSizes, budgets: Budgets, profile, prompt_tokens: int | None = None
              ) -> Plan:
    """The planner's plan under resolved budgets; `profile` may be a function (see make_plan)."""
    return make_plan(model, sizes, profile, gpu_budget=budgets.gpu_bytes, cpu_budget=budgets.cpu_bytes,
                     context_length=budgets.context_length, prompt_tokens=prompt_tokens)


def place_weights(model: ModelFile, plan: Plan, gpu: GpuTier, progress: LoadProgress | None = None
                  ) -> TieredWeights:
    """The model's pack (built on first use) placed as the plan says. A pack found damaged while
    loading is rebuilt once."""
    def place(packed) -> TieredWeights:
        device = DeviceTier(gpu.device, gpu.budget) if gpu.budget else None
        return TieredWeights(packed, model.config, plan, device, gpu.kernels, progress)

    packed = open_pack(model, progress)
    try:
        return place(packed)
    except ModelFileError:
        packed.path.unlink(missing_ok=True)
        return place(open_pack(model, progress))


def load_model(model: ModelFile, budgets: Budgets, gpu: GpuTier, threads: int,
               progress: LoadProgress | None = None) -> LoadedModel:
    """Plans the model under the budgets (measuring the machine only if the plan needs it) and
    places its weights."""
    plan = plan_load(model, pack_sizes(model), budgets, lambda: model_profile(model, threads, gpu, progress))
    return load_planned(model, plan, gpu, progress)


def load_planned(model: ModelFile, plan: Plan, gpu: GpuTier, progress: LoadProgress | None = None
                 ) -> LoadedModel:
    """The model's weights placed as `plan` says, with a decoder and KV cache over them."""
    weights = place_weights(model, plan, gpu, progress)
    try:
        return LoadedModel(model, plan, weights, plan.context_length)
    except BaseException:
        weights.close()
        raise


def load_tokenizer(model: ModelFile) -> Tokenizer:
    """llama.cpp's tokenizer for the model's vocabulary, checked first (some bad ones would abort
    llama.cpp, and the process with it)."""
    check_vocabulary(model.gguf.metadata, model.path.name)
    with llama_vocab_file(model.gguf) as vocab_path:
        tokenizer = Tokenizer.from_gguf(vocab_path)
    if tokenizer.vocab_size > model.config.vocab_size:
        tokenizer.close()
        raise ModelFileError(f"{model.path.name}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                             f"embedding only {model.config.vocab_size} rows")
    return tokenizer


def plan_file(model: str | os.PathLike | None, *, threads: int, cpu_memory: int | str | None = None,
              gpu_memory: int | str | None = None, context_length: int | None = None,
              prompt_tokens: int | None = None) -> Plan:
    """The plan a load of this file under these budgets would follow, with its predictions (the
    machine is measured first if it never was); nothing is loaded."""
    gpu_budget = parse_size(gpu_memory) if gpu_memory is not None else 0
    with open_model_file(resolve_model_path(model)) as opened:
        context = context_length_for(context_length, opened.config)
        budgets = resolve_budgets(opened, cpu_memory, gpu_budget, context)
        return plan_load(opened, pack_sizes(opened), budgets, model_profile(opened, threads), prompt_tokens)
