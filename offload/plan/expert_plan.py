"""Expert placement: where a MoE model's experts live, which caches hold them, and what a pass costs.

The expert is the unit of placement, on three tiers at once, in the order of value per byte:
1. what every token uses (the globals, and each layer's attention, norms, router and shared expert:
   a small part of the model) stays in RAM, except that with a GPU budget the layers go to the GPU
   first, from the first on, each with its KV cache, as a dense model's do (planner.py); those that
   do not fit stay in RAM, and the plan says so;
2. the GPU budget those leave holds experts: automatically a cache of the hot ones, or, placed by
   hand (`expert_placement`, llama.cpp's `--n-cpu-moe N`), every expert of the layers from N on;
3. the other experts live in RAM when cpu_memory holds them all beside the rest, else on disk (the
   pack) behind a cache in the RAM left, which must hold one layer's experts (what one prefill
   step may use at once).
Each layer step, an active expert not on the GPU runs on the CPU or is copied up (and cached),
whichever lets both devices finish soonest (offload/experts/hybrid.py); one not in RAM is read from
disk first (offload/experts/store.py). Experts placed by hand never move: those left on the CPU
are never copied up.

Hit rates. The share of expert uses each tier serves comes from how often each expert is used:
from a routing trace when one is at hand (recorded by `Engine.record_routing()`), else assumed
uniform (every expert as likely: a real model's skew only does better). The GPU cache is credited
with the most used experts, the RAM cache with the next ones, as a frequency policy keeps them.
The share of the disk's reads that start a layer early is the share of the trace's uses served by
disk that the recorded early-router prediction had picked (cross-layer affinity, which only adds
to it, left out); without recorded predictions it is READ_AHEAD_SHARE. It is what prediction
offers: the RAM cache's policy admits a prefetch only over an expert it ranks lower, and the
prefetch gate (offload/experts/prefetch_gate.py) may ask for more confidence, so fewer may be read.

Cost of a pass, per MoE layer, for `timings` (cost_model.py), k experts used of E per layer:
- decode: k experts compute one token each. A use served by disk is read (the read-ahead share
  of them predicted a layer early and read while the layer before computes, the rest when the
  router asks). With a GPU cache, the schedule's expected makespan is taken over the number of
  cached experts, binomial in k with the GPU's share; experts placed on the GPU by hand compute
  there.
  With skip_below, the share of uses it skips (`skipped_share`) is neither read nor computed.
- a verify pass of a token tree, T tokens: as a prefill chunk's, u capped at union_cap.
- prefill over T tokens: u = E (1 - (1 - k/E)^T) distinct experts per layer, each computing
  T k / u tokens at the batched kernel rate, each fetched at most once per chunk.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierflow.errors import PlanBudgetError
from tierflow.offload.experts.hybrid import ExpertCosts, schedule_experts
from tierflow.offload.experts.routing_trace import Routing
from tierflow.offload.pack.layout import ExtentSize
from tierflow.offload.plan.budgets import RamBudget
from tierflow.offload.plan.cost_model import PLACEHOLDER_GPU_GBPS, Costs
from tierflow.offload.plan.profile import HardwareProfile
from tierflow.runtime.models.config import ModelConfig
from tierflow.units import format_size, round_up_as_printed

READ_AHEAD_SHARE = 0.5  # of the reads from disk, those started a layer early, without a recorded routing
CACHE_POLICY = "score"  # offload/experts/policy.py: recency, frequency and the prediction
TIERS = ("gpu", "cpu", "disk")


@dataclass(frozen=True)
class ExpertRequest:
    """Where the user asks the experts to go: "auto" (the planner's caches), or by hand, llama.cpp's
    way: `cpu_layers` N keeps the experts of layers 0..N-1 off the GPU and puts every other layer's
    there (`--n-cpu-moe N`; every layer's off it: `--cpu-moe`). Two options trade exactness for
    fewer bytes (offload/experts/tier.py): skip_below skips an expert that would be read from disk
    for tokens that all give it less than this share of their router weight (0: never); union_cap
    caps the distinct experts a layer of a token tree's verify pass computes (0: no cap)."""

    cpu_layers: int | None = None  # None: auto
    skip_below: float = 0.0
    union_cap: int = 0

    @property
    def manual(self) -> bool:
        return self.cpu_layers is not None


@dataclass(frozen=True)
class ExpertPlacement:
    home: str  # where the experts not on the GPU live: "cpu" (all in RAM) or "disk" (the pack)
    ram_cache_bytes: int  # home "disk": the cache of them in RAM; 0 with home "cpu"
    gpu_cache_bytes: int  # a cache of hot experts in VRAM, scheduled every step; 0: none
    gpu_layers: tuple[int, ...]  # placed by hand: the layers whose experts all live on the GPU
    expert_bytes: int  # one expert's extent in the pack (the largest)
    total_experts: int  # over all layers
    served: dict[str, float]  # predicted share of decode expert uses each tier serves ("gpu", "cpu", "disk")
    bytes_per_token: dict[str, float]  # predicted decode bytes of used experts each tier serves
    routing: str  # what the shares come from: "uniform routing" or "a routing trace of N tokens"
    read_ahead: float  # of the uses served by disk, the share read a layer early (predicted)
    read_ahead_measured: bool  # read_ahead from a recorded routing's predictions, not READ_AHEAD_SHARE
    manual: bool = False  # placed by hand (ExpertRequest): nothing moves between the tiers
    policy: str = CACHE_POLICY
    scheduler: ExpertCosts | None = None  # the speeds the CPU-GPU schedule balances (a GPU cache only)
    skip_below: float = 0.0  # ExpertRequest's
    union_cap: int = 0  # ExpertRequest's
    skipped: float = 0.0  # predicted share of decode expert uses skipped (theirs to read from disk)

    @property
    def skipped_bytes_per_token(self) -> float:
        """The predicted decode bytes per token that skip_below leaves unread."""
        used = sum(self.bytes_per_token.values())  # of the uses not skipped
        return used * self.skipped / (1 - self.skipped) if self.skipped < 1 else 0.0

    @property
    def gpu_cached_experts(self) -> int:
        return min(self.total_experts, self.gpu_cache_bytes // self.expert_bytes)

    @property
    def ram_cached_experts(self) -> int:
        return min(self.total_experts, self.ram_cache_bytes // self.expert_bytes)


def expert_costs(profile: HardwareProfile) -> ExpertCosts:
    """The scheduler's speeds from the profile: 4-bit kernel speeds (the GPU's placeholder until
    the probe times its kernels) and the host-to-device copy speed."""
    cpu = profile.kernel_gbps.get(4) or max(profile.kernel_gbps.values())
    gpu = profile.gpu.kernel_gbps.get(4) or PLACEHOLDER_GPU_GBPS
    return ExpertCosts(cpu_gbps=cpu, gpu_gbps=gpu, copy_gbps=profile.gpu.h2d_gbps)


def expert_uses(config: ModelConfig, trace: np.ndarray | None) -> np.ndarray:
    """Each expert's share of all uses, [layer, expert] over every layer (zero for a dense one):
    counted in a routing trace [T, MoE layers, k] that fits the model, else uniform."""
    uses = np.zeros((config.num_layers, config.num_experts))
    moe = list(config.moe_layers)
    if trace is not None:
        for j, layer in enumerate(moe):
            uses[layer] = np.bincount(trace[:, j].reshape(-1), minlength=config.num_experts)
    else:
        uses[moe] = 1.0
    return uses / uses.sum()


def trace_fits(config: ModelConfig, trace: np.ndarray) -> bool:
    """Whether a routing trace [T, L, k] is this model's: its MoE layers, top-k and expert ids."""
    return (trace.ndim == 3 and trace.shape[1:] == (len(config.moe_layers), config.experts_used)
            and 0 <= trace.min() and trace.max() < config.num_experts)


def place_experts(model: str, config: ModelConfig, base_bytes: int, experts: list[list[ExtentSize]],
                  ram: RamBudget, gpu: tuple[int, int], profile: HardwareProfile | None,
                  request: ExpertRequest = ExpertRequest(), routing: Routing | None = None,
                  least_gpu: int | None = None) -> ExpertPlacement:
    """The placement of `experts` (per layer, each expert's extent) beside base_bytes (the globals
    and the layers not on the GPU, in RAM) in the RAM's room for weights, and on the GPU beside what
    it holds already: gpu = (gpu_memory, the bytes of the layers and KV cache placed there; 0, 0:
    no GPU). A budget that cannot work raises PlanBudgetError; a RAM too small names least_gpu too,
    where given: the gpu_memory that takes enough layers off the RAM. `routing` (recorded, its trace
    fitting the model: trace_fits) gives the hit rates and the read-ahead; without it they are assumed."""
    gpu_room = gpu[0] - gpu[1]
    expert_bytes = max(x.nbytes for layer in experts for x in layer)
    total = sum(len(layer) for layer in experts)
    if request.manual:
        gpu_layers = tuple(i for i in config.moe_layers if i >= request.cpu_layers)
        on_gpu = sum(x.nbytes for i in gpu_layers for x in experts[i])
        if on_gpu > gpu_room:
            raise _refuse_manual(request, gpu_layers, on_gpu, gpu)
        gpu_cache = 0
    else:
        gpu_layers, gpu_cache = (), gpu_room if gpu_room >= expert_bytes else 0
    off_gpu = [layer if i not in gpu_layers else [] for i, layer in enumerate(experts)]
    all_bytes = sum(x.nbytes for layer in off_gpu for x in layer)
    one_layer = max(sum(x.nbytes for x in layer) for layer in off_gpu)
    if base_bytes + all_bytes <= ram.room:
        home, ram_cache = "cpu", 0
    elif ram.room < base_bytes + one_layer:
        minimum = ram.minimum(base_bytes + one_layer)
        on_gpu = "" if least_gpu is None else (f", or with gpu_memory {format_size(least_gpu)}, which "
                                                f"takes enough layers' attention and routers to the GPU")
        raise PlanBudgetError(f"cpu_memory {format_size(ram.budget)} is too small for {model}: its globals, "
                              f"attention and routers in RAM take {format_size(base_bytes)} and the expert "
                              f"cache needs room for one layer's experts ({format_size(one_layer)})"
                              f"{ram.beside()}; the least that works is {format_size(minimum)}{on_gpu}",
                              minimum)
    else:
        home, ram_cache = "disk", ram.room - base_bytes
    trace = None if routing is None else routing.trace
    uses = expert_uses(config, trace)
    tier_of = _tier_of(uses, config.moe_layers, gpu_layers, gpu_cache // expert_bytes,
                       math.inf if home == "cpu" else ram_cache // expert_bytes)
    skipped = skipped_share(config, routing, tier_of, request.skip_below) if request.skip_below else 0.0
    served = {tier: float(uses[tier_of == i].sum()) for i, tier in enumerate(TIERS)}
    served["disk"] = max(served["disk"] - skipped, 0.0)
    read_ahead = None if routing is None else read_ahead_share(config, routing, tier_of)
    per_token = len(config.moe_layers) * config.experts_used * expert_bytes
    return ExpertPlacement(home, ram_cache, gpu_cache, gpu_layers, expert_bytes, total, served,
                           {tier: share * per_token for tier, share in served.items()},
                           "uniform routing" if trace is None else f"a routing trace of {len(trace)} tokens",
                           READ_AHEAD_SHARE if read_ahead is None else read_ahead, read_ahead is not None,
                           manual=request.manual,
                           scheduler=expert_costs(profile) if gpu_cache and profile is not None else None,
                           skip_below=request.skip_below, skipped=skipped, union_cap=request.union_cap)


def _tier_of(uses: np.ndarray, moe_layers: Sequence[int], gpu_layers: tuple[int, ...], gpu_cached: int,
             ram_cached: float) -> np.ndarray:
    """Each expert's tier [layer, expert], as an index into TIERS: the GPU's layers (by hand) or its
    cache of the most used experts, then the RAM cache's of the next most used, the rest on disk
    (the layers without experts: "gpu", serving nothing)."""
    tier_of = np.zeros(uses.shape, np.int8)
    off_gpu = [layer for layer in moe_layers if layer not in gpu_layers]
    rows, experts = np.divmod(np.argsort(-uses[off_gpu].reshape(-1), kind="stable"), uses.shape[1])
    layers = np.asarray(off_gpu, dtype=np.int64)[rows]
    ranked_tier = np.full(len(rows), TIERS.index("disk"), np.int8)
    ranked_tier[:gpu_cached] = TIERS.index("gpu")
    ranked_tier[gpu_cached:gpu_cached + min(len(rows), ram_cached)] = TIERS.index("cpu")
    tier_of[layers, experts] = ranked_tier
    return tier_of


def read_ahead_share(config: ModelConfig, routing: Routing, tier_of: np.ndarray) -> float | None:
    """Of the recorded uses that the placement `tier_of` serves from disk, the share that the
    recorded early-router prediction picked, so that the read starts a layer early; None without
    recorded predictions, or with no use served by disk."""
    if routing.predicted is None:
        return None
    layers = np.asarray(list(config.moe_layers))
    on_disk = tier_of[layers[None, :, None], routing.trace] == TIERS.index("disk")  # [T, L, K]
    if not on_disk.any():
        return None
    predicted = (routing.trace[..., :, None] == routing.predicted[..., None, :]).any(axis=-1)
    return float(predicted[on_disk].mean())


def skipped_share(config: ModelConfig, routing: Routing | None, tier_of: np.ndarray, skip_below: float
                  ) -> float:
    """Of all decode expert uses, the share skip_below skips: served by disk, not a token's first
    choice, and under that share of its router weight, by the recorded routing's shares where it
    has them, else with every choice given an equal share (uniform routing's)."""
    if routing is None or routing.shares is None:
        k = config.experts_used
        on_disk = float((tier_of[list(config.moe_layers)] == TIERS.index("disk")).mean())
        return on_disk * (k - 1) / k if 1 / k < skip_below else 0.0
    layers = np.asarray(list(config.moe_layers))
    on_disk = tier_of[layers[None, :, None], routing.trace] == TIERS.index("disk")  # [T, L, K]
    small = routing.shares < skip_below
    small[..., 0] = False
    return float((on_disk & small).mean())


def _refuse_manual(request: ExpertRequest, gpu_layers: tuple[int, ...], on_gpu: int, gpu: tuple[int, int]
                   ) -> PlanBudgetError:
    """The error for experts placed on the GPU by hand that gpu_memory cannot hold."""
    layers = f"layers {gpu_layers[0]}-{gpu_layers[-1]}" if len(gpu_layers) > 1 else f"layer {gpu_layers[0]}"
    budget, held = gpu
    minimum = round_up_as_printed(held + on_gpu)
    asked = f"expert_placement {request.cpu_layers} (--n-cpu-moe {request.cpu_layers}) puts the experts of " \
            f"{layers} on the GPU ({format_size(on_gpu)})"
    if not budget:
        return PlanBudgetError(f"{asked}, but there is no gpu_memory: give at least {format_size(minimum)}, "
                               f"or place them with --cpu-moe", minimum)
    return PlanBudgetError(f"gpu_memory {format_size(budget)} cannot hold what {asked}: beside the layers' "
                           f"always-used weights and KV cache there ({format_size(held)}) they are "
                           f"{format_size(held + on_gpu - budget)} over; at least {format_size(minimum)} is "
                           f"needed, or a larger --n-cpu-moe", minimum)


def largest_expert(experts: list[list[ExtentSize]]) -> ExtentSize:
    """The largest of a model's experts (per layer, each expert's extent): what ExpertStages prices."""
    return max((x for layer in experts for x in layer), key=lambda x: x.nbytes)


class ExpertStages:
    """The experts' share of each MoE layer's stage in a pass (cost_model.timings' `experts`)."""

    read_ahead_layers = 1  # the next layer's predicted experts are read while this one computes

    def __init__(self, placement: ExpertPlacement, expert: ExtentSize, costs: Costs, config: ModelConfig):
        self.placement, self.expert, self.costs, self.config = placement, expert, costs, config
        self.num_experts, self.used = config.num_experts, config.experts_used

    def layer_s(self, layer_idx: int, tokens: int, verifying: bool = False) -> tuple[float, float]:
        """(compute seconds, seconds of reads that overlap the layer before) of layer `layer_idx`'s
        experts over `tokens` new tokens (verifying: a token tree's, which union_cap caps)."""
        p = self.placement
        if tokens == 1:  # a decode token's reads from disk, less those skip_below skips
            active, per_expert, reads = self.used * (1 - p.skipped), 1, self.used * p.served["disk"]
        else:  # a pass of many tokens skips no expert in practice: some token ranks it high
            active = self.num_experts * (1 - (1 - self.used / self.num_experts) ** tokens)
            if verifying and p.union_cap:
                active = min(active, p.union_cap)
            per_expert = tokens * self.used / active
            reads = active * (p.served["disk"] + p.skipped)
        if layer_idx in p.gpu_layers:
            return active * self.costs.matmul_s(self.expert.linears, per_expert, "gpu", tokens > 1), 0.0
        if p.gpu_cache_bytes:
            compute = self._scheduled_s(round(active), max(1, round(per_expert)))
        else:
            compute = active * self.costs.matmul_s(self.expert.linears, per_expert, "cpu", tokens > 1)
        off_gpu = 1.0 - p.served["gpu"] if p.manual else 1.0  # the share of uses in layers like this one
        misses_s = reads / off_gpu * self.costs.read_s(self.expert) if off_gpu else 0.0
        return compute + (1 - p.read_ahead) * misses_s, p.read_ahead * misses_s

    def _scheduled_s(self, active: int, tokens: int) -> float:
        """The schedule's expected makespan when each of `active` experts is cached with
        probability hit_rate (the number cached binomial)."""
        h, expected = self.placement.served["gpu"], 0.0
        for cached in range(active + 1):
            chance = math.comb(active, cached) * h ** cached * (1 - h) ** (active - cached)
            plan = schedule_experts({e: tokens for e in range(active)}, set(range(cached)),
                                    self.placement.expert_bytes, self.placement.scheduler,
                                    self.placement.gpu_cached_experts - cached)
            expected += chance * max(plan.cpu_seconds, plan.gpu_seconds)
        return expected
