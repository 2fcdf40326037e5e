"""Expert placement: where a MoE model's experts live, where their cache is, and what a pass costs.

The expert is the unit of placement. Everything else of a MoE model (the globals and every layer's
attention, router and shared expert: a small part of it) stays in RAM. The experts take one of
three placements, chosen from the budgets alone:

- all resident in RAM, when the model fits cpu_memory and there is no GPU budget;
- home in RAM, with a cache of them in VRAM (gpu_memory), when there is a GPU budget: per layer
  step each active expert runs on the GPU when cached, else on the CPU or copied and cached,
  whichever lets both devices finish soonest (offload/experts/hybrid.py); cpu_memory must then
  hold every expert;
- home on disk (the pack), with a cache of them in the RAM the budget leaves, when the model does
  not fit cpu_memory (offload/experts/store.py); that cache must hold one layer's experts, what one
  prefill step may use at once.

Cost of a pass, per MoE layer, for `timings` (cost_model.py), k experts used of E per layer:
- decode: k experts compute one token each. Their hit rate is the cache's share of all experts
  (h = cached / (layers x E): routing assumed uniform and without locality, so a real model's
  skew only does better). A miss is read from disk (or copied to the GPU); a share
  READ_AHEAD_SHARE of misses is assumed predicted a layer early and read while the layer before
  computes, the rest is read when the router asks. With a GPU cache the expected makespan of the
  schedule is taken over the number of cached experts, binomial in k with h.
- prefill over T tokens: u = E (1 - (1 - k/E)^T) distinct experts per layer, each computing
  T k / u tokens at the batched kernel rate, each fetched at most once per chunk.
"""

import math
from dataclasses import dataclass

from tierflow.errors import PlanBudgetError
from tierflow.offload.experts.hybrid import ExpertCosts, schedule_experts
from tierflow.offload.pack.layout import ExtentSize
from tierflow.offload.plan.budgets import RamBudget
from tierflow.offload.plan.cost_model import PLACEHOLDER_GPU_GBPS, Costs
from tierflow.offload.plan.profile import HardwareProfile
from tierflow.runtime.config import ModelConfig
from tierflow.units import format_size

READ_AHEAD_SHARE = 0.5  # of the misses, those read a layer ahead (expert_stats' prediction precision)
CACHE_POLICY = "score"  # offload/experts/policy.py: recency, frequency and the prediction


@dataclass(frozen=True)
class ExpertPlacement:
    home: str  # "cpu": every expert in RAM; "disk": every expert read from the pack when not cached
    cache: str | None  # "gpu": a cache of experts in VRAM; "cpu": in RAM (home on disk); None: no cache
    cache_bytes: int  # the cache's budget
    expert_bytes: int  # one expert's extent in the pack (the largest)
    total_experts: int  # over all layers
    hit_rate: float  # predicted share of expert uses found in the cache (1.0 with no cache: all at hand)
    miss_bytes_per_token: float  # predicted decode bytes of used experts not in the cache: read from
    # disk (home on disk), or computed on the CPU or copied (cache on the GPU)
    policy: str = CACHE_POLICY
    scheduler: ExpertCosts | None = None  # the speeds the CPU-GPU schedule balances (GPU cache only)

    @property
    def cached_experts(self) -> int:
        return min(self.total_experts, self.cache_bytes // self.expert_bytes) if self.cache else 0


def expert_costs(profile: HardwareProfile) -> ExpertCosts:
    """The scheduler's speeds from the profile: 4-bit kernel speeds (the GPU's placeholder until
    the probe times its kernels) and the host-to-device copy speed."""
    cpu = profile.kernel_gbps.get(4) or max(profile.kernel_gbps.values())
    gpu = profile.gpu.kernel_gbps.get(4) or PLACEHOLDER_GPU_GBPS
    return ExpertCosts(cpu_gbps=cpu, gpu_gbps=gpu, copy_gbps=profile.gpu.h2d_gbps)


def place_experts(model: str, config: ModelConfig, base_bytes: int, experts: list[list[ExtentSize]],
                  ram: RamBudget, gpu_budget: int, profile: HardwareProfile) -> ExpertPlacement:
    """The placement of `experts` (per layer, each expert's extent) beside base_bytes (globals and
    layers without their experts, all in RAM) in the RAM's room for weights; a budget that cannot
    work raises PlanBudgetError."""
    all_bytes = sum(x.nbytes for layer in experts for x in layer)
    one_layer = max(sum(x.nbytes for x in layer) for layer in experts)
    expert_bytes = max(x.nbytes for layer in experts for x in layer)
    total = sum(len(layer) for layer in experts)

    def placement(home: str, cache: str | None, cache_bytes: int, scheduler: ExpertCosts | None = None):
        cached = min(total, cache_bytes // expert_bytes)
        hit_rate = cached / total if cache else 1.0
        misses = len(config.moe_layers) * config.experts_used * (1 - hit_rate) * expert_bytes
        return ExpertPlacement(home, cache, cache_bytes, expert_bytes, total, hit_rate, misses,
                               scheduler=scheduler)

    if gpu_budget:
        if base_bytes + all_bytes > ram.room:
            minimum = ram.minimum(base_bytes + all_bytes)
            raise PlanBudgetError(f"cpu_memory {format_size(ram.budget)} is too small for {model} with "
                                  f"gpu_memory: experts cached on the GPU are scheduled against their home "
                                  f"in RAM, so cpu_memory must hold the whole model{ram.beside()}, at least "
                                  f"{format_size(minimum)} (or leave out gpu_memory to stream the experts "
                                  f"from disk)", minimum)
        return placement("cpu", "gpu", gpu_budget, expert_costs(profile))
    if base_bytes + all_bytes <= ram.room:
        return placement("cpu", None, 0)
    if ram.room < base_bytes + one_layer:
        minimum = ram.minimum(base_bytes + one_layer)
        raise PlanBudgetError(f"cpu_memory {format_size(ram.budget)} is too small for {model}: its globals, "
                              f"attention and routers take {format_size(base_bytes)} and the expert cache "
                              f"needs room for one layer's experts ({format_size(one_layer)}){ram.beside()}; "
                              f"the least that works is {format_size(minimum)}", minimum)
    return placement("disk", "cpu", ram.room - base_bytes)


class ExpertStages:
    """The experts' share of each MoE layer's stage in a pass (cost_model.timings' `experts`)."""

    read_ahead_layers = 1  # the next layer's predicted experts are read while this one computes

    def __init__(self, placement: ExpertPlacement, expert: ExtentSize, costs: Costs, config: ModelConfig):
        self.placement, self.expert, self.costs, self.config = placement, expert, costs, config
        self.num_experts, self.used = config.num_experts, config.experts_used

    def layer_s(self, tokens: int) -> tuple[float, float]:
        """(compute seconds, seconds of reads that overlap the layer before) of one layer's experts
        over `tokens` new tokens."""
        if tokens == 1:
            active, per_expert = self.used, 1
        else:
            active = self.num_experts * (1 - (1 - self.used / self.num_experts) ** tokens)
            per_expert = tokens * self.used / active
        p = self.placement
        if p.cache == "gpu":
            return self._scheduled_s(round(active), max(1, round(per_expert))), 0.0
        compute = active * self.costs.matmul_s(self.expert.linears, per_expert, "cpu", tokens > 1)
        if p.cache is None:
            return compute, 0.0
        misses_s = active * (1 - p.hit_rate) * self.costs.read_s(self.expert)
        return compute + (1 - READ_AHEAD_SHARE) * misses_s, READ_AHEAD_SHARE * misses_s

    def _scheduled_s(self, active: int, tokens: int) -> float:
        """The schedule's expected makespan when each of `active` experts is cached with
        probability hit_rate (the number cached binomial)."""
        h, expected = self.placement.hit_rate, 0.0
        for cached in range(active + 1):
            chance = math.comb(active, cached) * h ** cached * (1 - h) ** (active - cached)
            plan = schedule_experts({e: tokens for e in range(active)}, set(range(cached)),
                                    self.placement.expert_bytes, self.placement.scheduler)
            expected += chance * max(plan.cpu_seconds, plan.gpu_seconds)
        return expected
