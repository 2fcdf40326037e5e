"""The one loader: from a model file and the user's budgets to its weights, placed as planned.

    model = open_model_file(path)                         # header, family, config, tensors checked
    budgets = resolve_budgets(model, sizes, cpu_memory, gpu_budget, cache, profile)  # and the context
    plan = plan_load(model, sizes, budgets, profile)      # offload/plan/planner.py
    weights = place_weights(model, plan, gpu, progress)   # the pack (built once), placed as planned

Engine.load, the draft's placement, `tierflow plan` and `tierflow info` all go through here, so
the placement `tierflow plan` prints is the one a load then holds. This is the one place default
budgets are decided:
- gpu_memory: 0 (the GPU is used when asked for);
- cpu_memory: the available RAM less a margin (max(10% of RAM, 1 GiB)); it holds the weights
  kept in RAM, the KV cache of the layers computed there and the largest pass's activations;
- context length: the model's trained context if the budgets hold its KV cache and activations,
  else the largest multiple of 256 that they hold, with a notice (offload/plan/context.py);
- KV cache type: kv_types.DEFAULT_KV_TYPE (f16).
The machine's speeds are needed only when something streams or a GPU budget is given; they are
measured once (`tierflow probe`, cached), within cpu_memory or 10% of the available RAM, whichever is
smaller (offload/plan/probe.py), and the per-layer overhead once per model shape.
"""

import functools
import os
from dataclasses import dataclass, field, replace
from numbers import Integral, Real

import psutil
import torch

from tierflow.errors import BudgetError, InvalidArgumentError, ModelFileError
from tierflow.gpu_kernels.launch import load_all_kernels
from tierflow.gpu_kernels.layer_kernels import TritonKernels
from tierflow.kv_types import KV_TYPES, KVType, kv_type
from tierflow.offload.experts.routing_trace import Routing, kept_routing
from tierflow.offload.gguf.model_file import ModelFile, open_model_file
from tierflow.offload.gguf.vocab_file import llama_vocab_file
from tierflow.offload.pack.built import BuiltPack, builds_in_ram
from tierflow.offload.pack.layout import fill_threads
from tierflow.offload.pack.writer import PackSizes, open_pack, pack_sizes
from tierflow.offload.plan.budgets import available_ram_bytes
from tierflow.offload.plan.context import check_context, plan_context
from tierflow.offload.plan.expert_plan import ExpertRequest, trace_fits
from tierflow.offload.plan.planner import Plan, ProfileSource, make_plan
from tierflow.offload.plan.probe import load_profile, save_profile
from tierflow.offload.plan.profile import GpuProfile, HardwareProfile
from tierflow.offload.store.model_path import resolve_model_path
from tierflow.offload.tiers.device import DeviceTier
from tierflow.offload.tiers.tiered import TieredWeights
from tierflow.progress import LoadPhase, LoadProgress
from tierflow.runtime.compute.interfaces import Kernels
from tierflow.runtime.decoder.decoder import Decoder
from tierflow.runtime.decoder.host_attention import HostAttention
from tierflow.runtime.generation.token_loop import TokenGenerator
from tierflow.runtime.loading.overhead import measure_layer_overhead, shape_key
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.runtime.models.config import ModelConfig
from tierflow.runtime.text.tokenizer import Tokenizer
from tierflow.runtime.text.vocabulary import check_vocabulary
from tierflow.units import parse_size

GPU_DEVICES = ("cpu", "interpret")
# parallel="auto": the sequences tried, most first, and the context each must still get (or the
# model's, if shorter): four chat slots as llama-server's default, but not at the price of short chats
AUTO_PARALLEL = (4, 2, 1)
AUTO_MIN_CONTEXT = 4096


@dataclass(frozen=True)
class GpuTier:
    """Where layers placed on the GPU tier live and what computes them."""

    budget: int  # gpu_memory in bytes; 0: no GPU tier
    device: torch.device
    kernels: Kernels | None  # None: the CPU kernels (the CPU standing in for a GPU)


@dataclass(frozen=True)
class CacheOptions:
    """What a load asks of its KV cache (Engine.load's keywords of the same names)."""

    context_length: int | None = None  # None: the trained context, or the largest that fits
    kv_cache_type: str | None = None  # a kv_types.KV_TYPES name; None: the default
    kv_on_cpu: bool = False  # every layer's cache in RAM (llama.cpp's -nkvo)
    allow_context_extension: bool = False  # a context past the trained one is refused unless set
    parallel: int | str = 1  # sequences decoded together, each with its own KV cache; or "auto"


@dataclass(frozen=True)
class Budgets:
    cpu_bytes: int  # RAM: weights (ring, expert caches), the KV cache kept there, activations
    gpu_bytes: int  # weights and their KV caches on the GPU
    context_length: int
    kv: KVType
    kv_on_cpu: bool = False
    notices: tuple[str, ...] = field(default=(), compare=False)  # what choosing the context decided
    sequences: int = 1  # KV caches of context_length positions (CacheOptions.parallel)
    draft_layers: int = 0  # a self-draft's layers: held, never streamed, with a KV cache of their own
    experts: ExpertRequest = ExpertRequest()  # where a MoE model's experts are asked to go
    routing: Routing | None = field(default=None, compare=False)  # its kept recorded routing, if it fits

    def less(self, held: dict[str, int]) -> "Budgets":
        """What is left after `held` bytes per tier ("cpu", "gpu") were placed first."""
        return replace(self, cpu_bytes=self.cpu_bytes - held["cpu"], gpu_bytes=self.gpu_bytes - held["gpu"])


class LoadedModel:
    """A model's weights placed as planned, and a decoder over them with its KV cache (each
    layer's where it computes, or all in RAM with kv_on_cpu; allocated here: the budgets of what
    loads next see it)."""

    def __init__(self, model: ModelFile, plan: Plan, weights: TieredWeights, context_length: int):
        self.path, self.arch, self.config = model.path, model.arch, model.config
        self.plan, self.weights, self.context_length = plan, weights, context_length
        source, allocate = weights, weights.allocate_cache
        if plan.kv_on_cpu:
            source, allocate = HostAttention.over(weights), None
        decoder = Decoder(self.config, self.arch.block, source, context_length)
        # one token generator per sequence decoded together, each over its own KV cache
        self.generators = [TokenGenerator(decoder, KVCache(self.config, context_length, allocate,
                                                           kv_type=KV_TYPES[plan.kv_type]))
                           for _ in range(plan.sequences)]

    @property
    def generator(self) -> TokenGenerator:
        """The first sequence's: the only one of a model loaded for one sequence at a time."""
        return self.generators[0]

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes held per tier: the weights (and the KV caches on the GPU) as placed, and the
        KV cache in RAM as planned."""
        held = self.weights.bytes_by_tier()
        return held | {"cpu": held["cpu"] + self.plan.kv_bytes - self.plan.kv_gpu_bytes}

    def close(self) -> None:
        self.weights.close()


def thread_count(threads: int | None) -> int:
    """The CPU threads to compute with: the physical cores unless given."""
    if threads is None:
        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r}")
    return threads


def resolve_budgets(model: ModelFile, sizes: PackSizes, cpu_memory: int | str | None, gpu_budget: int,
                    cache: CacheOptions, profile: ProfileSource, experts: ExpertRequest = ExpertRequest()
                    ) -> Budgets:
    """The budgets of a load: cpu_memory as given, or by default the available RAM less a margin;
    the KV cache's type; the context (offload/plan/context.py), which may need the machine's
    speeds (profile) to see whether a placement of the pack (sizes) fits; and with parallel
    "auto", the most of AUTO_PARALLEL sequences whose caches hold AUTO_MIN_CONTEXT positions each
    (or the trained or requested context, if shorter) beside the weights. A MoE model's experts go
    where `experts` asks, with hit rates from the routing recorded and kept beside its pack, if any."""
    routing = kept_routing(model.path) if model.config.is_moe else None
    routing = routing if routing is not None and trace_fits(model.config, routing.trace) else None
    resolve = functools.partial(_resolve_budgets, model, sizes, cpu_memory, gpu_budget, profile=profile,
                                experts=experts, routing=routing)
    if cache.parallel != "auto":
        return resolve(cache)
    wanted = min(AUTO_MIN_CONTEXT, cache.context_length or model.config.context_length)
    for sequences in AUTO_PARALLEL:
        options = replace(cache, parallel=sequences)
        if sequences == 1:
            return resolve(options)
        try:
            budgets = resolve(options)
        except BudgetError:
            continue
        if budgets.context_length >= wanted:
            return budgets
    raise AssertionError("AUTO_PARALLEL ends with 1")


def _resolve_budgets(model: ModelFile, sizes: PackSizes, cpu_memory: int | str | None, gpu_budget: int,
                     cache: CacheOptions, profile: ProfileSource, experts: ExpertRequest,
                     routing: Routing | None) -> Budgets:
    kv = kv_type(cache.kv_cache_type)
    model.config.cache_rows.check(kv)
    check_context(cache.context_length, model.config, cache.allow_context_extension)
    cpu = parse_size(cpu_memory) if cpu_memory is not None else available_ram_bytes()

    def plan_at(context_length: int) -> Plan:
        return make_plan(model, sizes, profile, gpu_budget=gpu_budget, cpu_budget=cpu,
                         context_length=context_length, kv=kv, kv_on_cpu=cache.kv_on_cpu,
                         sequences=cache.parallel, expert_request=experts, routing=routing)

    plan, notice = plan_context(plan_at, cache.context_length, model.config.context_length)
    notices = () if notice is None else (notice,)
    return Budgets(cpu, gpu_budget, plan.context_length, kv, cache.kv_on_cpu, notices, cache.parallel,
                   experts=experts, routing=routing)


def expert_request(placement: object, config: ModelConfig, model: str, skip: object = 0.0,
                   union_cap: object = 0) -> ExpertRequest:
    """Engine.load's expert_placement: "auto" (the planner's caches), "cpu" (every expert off the
    GPU: llama.cpp's --cpu-moe) or N (the experts of layers 0..N-1 off it: --n-cpu-moe N); expert_skip,
    the router share under which an expert read from disk is skipped (0: never); and
    expert_union_cap, the distinct experts a layer of a tree's verify pass computes at most (0: all)."""
    if not isinstance(skip, Real) or isinstance(skip, bool) or not 0 <= skip < 1:
        raise InvalidArgumentError(f"expert_skip is a share of a token's router weight, at least 0 and "
                                   f"under 1 (0: exact, no expert skipped), got {skip!r}")
    if not isinstance(union_cap, Integral) or isinstance(union_cap, bool) or union_cap < 0:
        raise InvalidArgumentError(f"expert_union_cap is a count of experts, at least 0 (0: no cap), "
                                   f"got {union_cap!r}")
    for name, value in (("expert_skip", skip), ("expert_union_cap", union_cap)):
        if value and not config.is_moe:
            raise InvalidArgumentError(f"{name} leaves experts out, and {model} is not a mixture-of-experts "
                                       f"model: it has none (leave out {name}, --{name.replace('_', '-')})")
    if union_cap and union_cap < config.experts_used:
        raise InvalidArgumentError(f"expert_union_cap {union_cap} is fewer experts than one token of {model} "
                                   f"uses ({config.experts_used}): give at least that, or 0 for no cap")
    if placement == "auto":
        return ExpertRequest(skip_below=float(skip), union_cap=int(union_cap))
    if placement == "cpu":
        cpu_layers = config.num_layers
    elif isinstance(placement, Integral) and not isinstance(placement, bool) and placement >= 0:
        cpu_layers = min(int(placement), config.num_layers)
    else:
        raise InvalidArgumentError(f"expert_placement must be \"auto\", \"cpu\" or a count of layers >= 0 "
                                   f"(llama.cpp's --n-cpu-moe), got {placement!r}")
    if not config.is_moe:
        raise InvalidArgumentError(f"{model} is not a mixture-of-experts model: it has no experts to place "
                                   f"(leave out expert_placement, --cpu-moe and --n-cpu-moe)")
    return ExpertRequest(cpu_layers, float(skip), int(union_cap))


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
                  progress: LoadProgress | None = None, cpu_memory: int | str | None = None
                  ) -> HardwareProfile:
    """This machine's measured profile (probed once and cached, within cpu_memory or 10% of the
    available RAM: probe.allowance), with the per-layer overhead of this model's shape (measured once
    per shape, cached with it); the CPU standing in for a GPU gets the CPU's own speeds as the GPU's."""
    def measuring(step: str, done: int, total: int) -> None:  # a first streamed load probes (~10 s)
        if progress is not None:
            progress(LoadPhase.PROBING, done, total)

    memory = parse_size(cpu_memory) if cpu_memory is not None else None
    profile = load_profile(threads, progress=measuring, memory_bytes=memory)
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


def plan_load(model: ModelFile, sizes: PackSizes, budgets: Budgets, profile: ProfileSource,
              prompt_tokens: int | None = None) -> Plan:
    """The planner's plan under resolved budgets, with their notices among its notes; `profile`
    may be a function (see make_plan)."""
    plan = make_plan(model, sizes, profile, gpu_budget=budgets.gpu_bytes, cpu_budget=budgets.cpu_bytes,
                     context_length=budgets.context_length, prompt_tokens=prompt_tokens, kv=budgets.kv,
                     kv_on_cpu=budgets.kv_on_cpu, sequences=budgets.sequences,
                     draft_layers=budgets.draft_layers, expert_request=budgets.experts,
                     routing=budgets.routing)
    return replace(plan, notes=(*plan.notes, *budgets.notices))


def profile_source(model: ModelFile, threads: int, gpu: GpuTier | None = None,
                   progress: LoadProgress | None = None, cpu_memory: int | str | None = None
                   ) -> ProfileSource:
    """model_profile as a function called at most once, when a plan first needs it."""
    return functools.cache(lambda: model_profile(model, threads, gpu, progress, cpu_memory))


def place_weights(model: ModelFile, plan: Plan, gpu: GpuTier, progress: LoadProgress | None = None
                  ) -> TieredWeights:
    """The model's pack (built on first use) placed as the plan says. A pack found damaged while
    loading is rebuilt once. A plan that reads nothing from disk while it runs, of a model whose
    types a load lays out as fast as it reads them, writes no pack: its extents are built in RAM.
    The threads that lay extents out run from the first extent to the last, and no longer."""
    def place(packed) -> TieredWeights:
        device = DeviceTier(gpu.device, gpu.budget) if gpu.budget else None
        return TieredWeights(packed, model.config, plan, device, gpu.kernels, progress)

    experts_on_disk = plan.experts is not None and plan.experts.home == "disk"
    with fill_threads():
        if not plan.streamed_layers and not experts_on_disk and builds_in_ram(model):
            return place(BuiltPack(model))
        memory = plan.budget_bytes["cpu"]  # a build holds no more than the load will (it ends before)
        packed = open_pack(model, progress, memory)
        try:
            return place(packed)
        except ModelFileError:
            packed.path.unlink(missing_ok=True)
            return place(open_pack(model, progress, memory))


def load_model(model: ModelFile, sizes: PackSizes, budgets: Budgets, gpu: GpuTier, profile: ProfileSource,
               progress: LoadProgress | None = None) -> LoadedModel:
    """Plans the model under the budgets (measuring the machine only if the plan needs it) and
    places its weights."""
    plan = plan_load(model, sizes, budgets, profile)
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


def load_tokenizer(model: ModelFile, chat_template: str | os.PathLike | None = None) -> Tokenizer:
    """llama.cpp's tokenizer for the model's vocabulary, checked first (some bad ones would abort
    llama.cpp, and the process with it), rendering chats with `chat_template` if given."""
    check_vocabulary(model.gguf.metadata, model.path.name)
    with llama_vocab_file(model.gguf) as vocab_path:
        tokenizer = Tokenizer.from_gguf(vocab_path)
    if tokenizer.vocab_size > model.config.vocab_size:
        tokenizer.close()
        raise ModelFileError(f"{model.path.name}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                             f"embedding only {model.config.vocab_size} rows")
    try:
        tokenizer.use_template(chat_template)
    except BaseException:
        tokenizer.close()
        raise
    return tokenizer


def plan_file(model: str | os.PathLike | None, *, threads: int, cpu_memory: int | str | None = None,
              gpu_memory: int | str | None = None, cache: CacheOptions = CacheOptions(),
              prompt_tokens: int | None = None, expert_placement: str | int = "auto",
              expert_skip: float = 0.0, expert_union_cap: int = 0) -> Plan:
    """The plan a load of this file under these budgets would follow, with its predictions (the
    machine is measured first if it never was); nothing is loaded."""
    gpu_budget = parse_size(gpu_memory) if gpu_memory is not None else 0
    with open_model_file(resolve_model_path(model)) as opened:
        experts = expert_request(expert_placement, opened.config, opened.path.name, expert_skip,
                                 expert_union_cap)
        profile, sizes = model_profile(opened, threads, cpu_memory=cpu_memory), pack_sizes(opened)
        budgets = resolve_budgets(opened, sizes, cpu_memory, gpu_budget, cache, profile, experts)
        return plan_load(opened, sizes, budgets, profile, prompt_tokens)
