"""The planner's cost model: the predicted time of a decode step and of a prefill.

A pass (a decode step, or a prefill chunk) is a chain of stages, one per layer and one for the
output head, each with its compute time and, for streamed layers, its read time (formulas in
offload/plan/planner.py's docstring). `run_pipeline` steps through them as the runtime runs them:
stages compute in order while one reader reads the streamed stages in order, each read waiting
for a free ring slot (LayerStreamer's rule).
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierflow.kv_types import MAX_PASS_TOKENS, KVType
from tierflow.offload.pack.layout import ExtentSize
from tierflow.offload.plan.profile import BATCH_WIDTH, HardwareProfile
from tierflow.runtime.models.config import ModelConfig

PLACEHOLDER_GPU_GBPS = 300.0  # a mid-range consumer GPU's memory bandwidth, until the probe times the kernels
GPU_TOKENS_PER_READ = 128  # prefill tokens a GPU serves per read of its weights (placeholder)
_DECODE_PASSES, _STEADY_PASSES = 8, 4

if TYPE_CHECKING:  # expert_plan builds on this module
    from tierflow.offload.plan.expert_plan import ExpertStages


@dataclass(frozen=True)
class Timing:
    tokens: int  # computed in `seconds`: 1 for a decode step, the prompt for prefill
    seconds: float  # predicted wall time
    compute_s: float  # compute alone, as if no read were waited for
    io_s: float  # disk reads alone

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf


def _nearest(table: dict[int, float], bits: int, fallback: float) -> float:
    if not table:
        return fallback
    return table[min(table, key=lambda b: (abs(b - bits), -b))]


def _cpu_product_s(nbytes: int, tokens: float, one_gbps: float, batch_gbps: float | None) -> float:
    """Seconds of a CPU product of `tokens` tokens with `nbytes` of weights, from the measured rate of
    one token's product (one_gbps) and of BATCH_WIDTH tokens' (batch_gbps; None: tokens products of
    one token each, as decode steps are). Between the two the time is interpolated linearly: a few
    tokens' product costs more than one token's even where one token's is bound by memory, since
    each added token is work the kernels do (on AVX2, 2 tokens cost 1.5x one, 8 tokens 3x); taking
    the larger of one token's time and the batched rate's, as this did, priced a 3-token verify pass
    of Qwen2.5-1.5B at 1.14x a decode step where it measures 1.9x."""
    one_s = nbytes / (one_gbps * 1e9)
    if batch_gbps is None or tokens <= 1:
        return tokens * one_s
    per_token_s = nbytes / (batch_gbps * 1e9)
    if tokens >= BATCH_WIDTH:
        return tokens * per_token_s
    batch_s = max(BATCH_WIDTH * per_token_s, one_s)
    return one_s + (tokens - 1) / (BATCH_WIDTH - 1) * (batch_s - one_s)


@dataclass(frozen=True)
class Stage:
    compute_s: float
    read_s: float = 0.0  # > 0: streamed


class Costs:
    """Seconds per stage under the profile; see the module docstring for each formula. Attention
    runs where the layer's KV cache is: a GPU layer's on the GPU, unless kv_on_cpu puts every
    cache in RAM (then the CPU attends)."""

    def __init__(self, profile: HardwareProfile, config: ModelConfig, kv: KVType, kv_on_cpu: bool = False):
        self.p, self.c, self.kv, self.kv_on_cpu = profile, config, kv, kv_on_cpu
        gpu = profile.gpu
        self.gpu_gbps = dict(gpu.kernel_gbps) if gpu is not None else {}
        self.notes = []
        if gpu is not None and not self.gpu_gbps:
            self.notes.append(f"GPU kernel speed not measured: assumed {PLACEHOLDER_GPU_GBPS:g} GB/s "
                              f"(a placeholder until the probe times the GPU kernels)")

    def matmul_s(self, linears, tokens: int, device: str, batch: bool) -> float:
        p, total = self.p, 0.0
        for linear in linears:
            if device == "gpu":
                rate = _nearest(self.gpu_gbps, linear.bits or 8, PLACEHOLDER_GPU_GBPS)
                total += math.ceil(tokens / GPU_TOKENS_PER_READ) * linear.nbytes / (rate * 1e9)
            elif linear.bits is None:
                one, wide = p.ram_read_gbps, 4 * _nearest(p.kernel_batch_gbps, 8, p.ram_read_gbps)
                total += _cpu_product_s(linear.nbytes, tokens, one, wide if batch else None)
            else:
                one = _nearest(p.kernel_gbps, linear.bits, p.ram_read_gbps)
                wide = _nearest(p.kernel_batch_gbps, linear.bits, p.ram_read_gbps) if batch else None
                total += _cpu_product_s(linear.nbytes, tokens, one, wide)
        return total

    def layer_s(self, layer_idx: int, extent: ExtentSize, device: str, tokens: int, start: int) -> float:
        """Layer `layer_idx` over `tokens` new tokens at positions start..; tokens == 1 is decode."""
        seconds = self.matmul_s(extent.linears, tokens, device, tokens > 1) + self.p.layer_overhead_s
        return seconds + self.attention_s(layer_idx, "cpu" if self.kv_on_cpu else device, tokens, start)

    def attention_s(self, layer_idx: int, device: str, tokens: int, start: int) -> float:
        """Decode reads every key and value it attends to, in the cache's type, where the cache
        is; prefill on the CPU is counted in flops (on the GPU it is left out)."""
        c, window = self.c, self.c.window(layer_idx)
        if tokens == 1:
            attended = min(start + 1, window) if window else start + 1
            cache_bytes = 2 * c.num_kv_heads * self.kv.row_bytes(c.head_dim) * attended
            rate = (self.p.ram_read_gbps if device == "cpu"
                    else _nearest(self.gpu_gbps, 8, PLACEHOLDER_GPU_GBPS))
            return cache_bytes / (rate * 1e9)
        if device != "cpu":
            return 0.0
        keys = start + (tokens + 1) / 2  # a token's keys, on average over the pass
        flops = 4 * c.num_heads * c.head_dim * tokens * (min(keys, window) if window else keys)
        return flops / (2e9 * _nearest(self.p.kernel_batch_gbps, 8, self.p.ram_read_gbps))

    def read_s(self, extent: ExtentSize) -> float:
        return extent.nbytes / (self.p.disk_read_gbps * 1e9)


def run_pipeline(passes: list[list[Stage]], depth: int) -> list[float]:
    """End time of each pass: stages compute in order; one reader reads streamed stages in order,
    read n issued once streamed stage n - depth - 1 has computed and freed its ring slot
    (LayerStreamer's rule)."""
    clock = reader = 0.0
    freed: list[float] = []  # when each streamed stage finished computing
    ends = []
    for stages in passes:
        for stage in stages:
            if stage.read_s:
                n = len(freed)
                issued = freed[n - depth - 1] if n > depth else 0.0
                reader = max(reader, issued) + stage.read_s
                clock = max(clock, reader) + stage.compute_s
                freed.append(clock)
            else:
                clock += stage.compute_s
        ends.append(clock)
    return ends


@dataclass(frozen=True)
class Layout:
    gpu: tuple[int, ...]
    streamed: tuple[int, ...]
    depth: int


def pass_stages(layout: Layout, globals_: ExtentSize, layers: list[ExtentSize], costs: Costs, tokens: int,
                start: int, experts: "ExpertStages | None" = None) -> list[Stage]:
    """The stages of a pass over `tokens` new tokens at positions start..: one per layer, then the
    output head (one token's); `experts` adds a MoE model's experts to each layer that has them."""
    def stage(i: int, x: ExtentSize) -> Stage:
        compute = costs.layer_s(i, x, "gpu" if i in layout.gpu else "cpu", tokens, start)
        read = costs.read_s(x) if i in layout.streamed else 0.0
        if experts is not None and experts.config.has_experts(i):
            expert_compute, expert_read = experts.layer_s(i, tokens)
            compute, read = compute + expert_compute, read + expert_read
        return Stage(compute, read)

    head = Stage(costs.matmul_s(globals_.linears, 1, "cpu", False))
    return [stage(i, x) for i, x in enumerate(layers)] + [head]


def steady_pass_seconds(step: list[Stage], depth: int) -> float:
    """The period of a pass repeated back to back (the ring reading ahead across passes)."""
    ends = run_pipeline([step] * _DECODE_PASSES, depth)
    return (ends[-1] - ends[-1 - _STEADY_PASSES]) / _STEADY_PASSES


def timings(layout: Layout, globals_: ExtentSize, layers: list[ExtentSize], costs: Costs,
             prompt_tokens: int, context_length: int, experts: "ExpertStages | None" = None
             ) -> tuple[Timing, Timing]:
    """(prefill of prompt_tokens, a decode step with the context full); `experts` adds a MoE
    model's experts to the stage of every layer that has them (their reads, if any, run ahead by
    experts.read_ahead_layers)."""
    def pass_(tokens: int, start: int) -> list[Stage]:
        return pass_stages(layout, globals_, layers, costs, tokens, start, experts)

    depth = layout.depth if experts is None else max(layout.depth, experts.read_ahead_layers)
    step = pass_(1, context_length - 1)
    decode = Timing(1, steady_pass_seconds(step, depth), sum(s.compute_s for s in step),
                    sum(s.read_s for s in step))
    chunks = [pass_(min(MAX_PASS_TOKENS, prompt_tokens - s), s)
              for s in range(0, prompt_tokens, MAX_PASS_TOKENS)]
    stages = [s for chunk in chunks for s in chunk]
    prefill = Timing(prompt_tokens, run_pipeline(chunks, depth)[-1],
                     sum(s.compute_s for s in stages), sum(s.read_s for s in stages))
    return prefill, decode
