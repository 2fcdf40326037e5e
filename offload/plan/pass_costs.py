"""The predicted seconds of a pass over T tokens of a planned model: the cost model (cost_model.py)
as a function of the pass's width, which is what sizes a speculative token tree.

A verify pass feeds T tokens (a draft's tree) through every layer and the output head, all T
rows wanted. Each stage computes the larger of a decode step's cost (the weights read once, a
memory-bound matrix-vector product) and T tokens at the kernels' batched rate (compute-bound):
a small tree costs what one token does, a large one grows with T. Both include the measured
fixed cost per layer (HardwareProfile.layer_overhead_s). A streamed layer's read costs the same
whatever T. A MoE model's experts add to each layer that has them what its T tokens fire together
(expert_plan.ExpertStages: many more distinct experts than one token's, those on disk read; at
most expert_union_cap of them). Work done between passes (a draft proposing the next tree) is a
stage of its own:
the reader keeps reading ahead into the free ring slots meanwhile, as LayerStreamer does, so
the steady-state period says how much of that work the reads hide.
"""

from tierflow.kv_types import KV_TYPES
from tierflow.offload.pack.writer import PackSizes
from tierflow.offload.plan.cost_model import Costs, Layout, Stage, steady_pass_seconds
from tierflow.offload.plan.expert_plan import ExpertStages, largest_expert
from tierflow.offload.plan.plan_result import Plan
from tierflow.offload.plan.profile import HardwareProfile
from tierflow.runtime.models.config import ModelConfig

POSITION = 256  # where the predicted passes sit in the context: a short chat's (attention is minor there)


class PassCosts:
    """Seconds of a pass over T tokens of a model placed as `plan` says, on the profiled machine."""

    def __init__(self, plan: Plan, config: ModelConfig, sizes: PackSizes, profile: HardwareProfile):
        self.costs = Costs(profile, config, KV_TYPES[plan.kv_type], plan.kv_on_cpu)
        self.layout = Layout(plan.gpu_layers, plan.streamed_layers, plan.prefetch_depth)
        self.sizes, self.config = sizes, config
        self.position = max(min(POSITION, plan.context_length // 2), 0)
        self.experts = None if plan.experts is None else ExpertStages(
            plan.experts, largest_expert(sizes.experts), self.costs, config)

    def seconds(self, tokens: int, between_s: float = 0.0, num_layers: int | None = None) -> float:
        """The steady-state time from one pass of `tokens` tokens to the next, with between_s
        of other work after each pass (reads into free ring slots go on during it), through the
        first num_layers layers (default: all; fewer: a self-draft's) and the head."""
        stages = [*self._stages(tokens, num_layers), Stage(between_s)]
        return steady_pass_seconds(stages, self.layout.depth)

    def _stages(self, tokens: int, num_layers: int | None) -> list[Stage]:
        costs, start = self.costs, self.position
        stages = []
        for i, extent in enumerate(self.sizes.layers[:num_layers]):
            device = "gpu" if i in self.layout.gpu else "cpu"
            compute = max(costs.layer_s(i, extent, device, 1, start),
                          costs.layer_s(i, extent, device, tokens, start))
            read = costs.read_s(extent) if i in self.layout.streamed else 0.0
            if self.experts is not None and self.config.has_experts(i):
                expert_compute, expert_read = self.experts.layer_s(i, tokens, verifying=True)
                compute, read = compute + expert_compute, read + expert_read
            stages.append(Stage(compute, read))
        head = self.sizes.globals.linears
        head_s = max(costs.matmul_s(head, 1, "cpu", False), costs.matmul_s(head, tokens, "cpu", True))
        return [*stages, Stage(head_s)]
