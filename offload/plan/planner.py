"""The planner: from the GGUF header, the hardware profile and the budgets, a `Plan`.

    plan = make_plan(model, pack_sizes(model), profile, gpu_budget=0, cpu_budget=2 << 30,
                     context_length=4096)
    print(plan.table())

No weight is read. A Plan gives every tensor group (the embeddings, each layer's attention and
FFN, the output head) a home tier and a compute device, the prefetch depth, the KV cache's tier,
peak memory per tier and the predicted prefill and decode tokens/s.

Bytes. Weights are counted as the model's pack lays them out (offload/pack/layout.py: the writer's
own walk, sized from the header), which is what TieredWeights holds and the streamer reads: one
extent for the globals (embeddings, output norm and head, rope factors), one per layer (its norms
and packed linears), arrays 64-byte aligned, extents padded to 4 KiB. A layer's attention and FFN
share its extent, so they share a home; its groups are its family's tensor map's.

Budgets are resolved by the caller (runtime/loader.py, the one place defaults are decided). The
hardware profile may be handed over as a function: it is called only when the placement depends
on the machine's speeds (something streams, or there is a GPU budget); otherwise the plan places
everything in RAM and predicts nothing (`prefill` and `decode` are None).

A mixture-of-experts model places its experts instead of its layers (offload/plan/expert_plan.py):
every layer stays in RAM, and each expert gets a home, RAM or disk, with an expert cache in VRAM
or RAM; the plan's `experts` says which, and its groups list every expert.

Placement of a dense model, in order:
1. GPU (only when the profile has a GPU and gpu_budget > 0): layers from 0 up while they fit, each
   with its share of the KV cache (a layer computed on the GPU keeps its keys and values there).
2. The globals stay in RAM (every token needs them) and count against cpu_budget.
3. If the other layers fit beside them, all are resident: no ring, depth 0.
4. Else the rest stream from disk through a ring of depth + 1 slots of the largest layer's extent,
   depth 1..4, the ring counted against cpu_budget. For each affordable depth, the layers that fit
   in what is left stay resident: first fit in layer order, or as many spread evenly (resident
   layers between streamed ones give the disk time to read ahead). The (depth, layout) with the
   lowest predicted decode time wins; ties go to fewer streamed bytes, a deeper ring, then the
   earliest layers. Below globals + min(the other layers, two slots), BudgetError names that size.

Cost model (GB = 1e9 bytes; speeds from the HardwareProfile). A pass (a decode step at position
p = prompt_tokens, or a prefill chunk of T <= 512 tokens at positions s .. s + T - 1) is a chain of
stages, one per layer and one for the output head:
    compute = sum over linears of T * bytes / rate(bits)            matmuls
              + layer_overhead_s                                    norms, rope, Python (per pass)
              + decode: 2 * K * D * 4 * p cache bytes / ram_read_gbps       attention reads
                prefill: 4 * H * D * T * (s + (T + 1) / 2) flops / (2e9 * kernel_batch_gbps[8])
    read    = extent bytes / disk_read_gbps                         streamed layers only
  rate(bits): decode kernel_gbps[bits], prefill kernel_batch_gbps[bits] (bytes x tokens per
  second); float32 linears (torch) decode at ram_read_gbps and prefill at 4 x the int8 batch
  rate (as many weights per second); bits not measured: the nearest that is. The head computes
  one token even in prefill. GPU layers use GpuProfile.kernel_gbps (cost_model.PLACEHOLDER_GPU_GBPS while
  unmeasured) and, in prefill, read their weights once per GPU_TOKENS_PER_READ tokens.
Stages compute one after another. One reader reads the streamed layers in order, cycling across
passes, as LayerStreamer does: read n is issued once streamed layer n - depth - 1 has computed
(the decoder moving on frees its slot), and layer n computes once its read is done. The time of a
pass is that pipeline's makespan, stepped through stage by stage: decode is the steady-state
period (mean of passes 5-8), prefill is P tokens from a cold ring. It lies between
max(compute, io) and compute + io (the sums over the pass): disk-bound, a decode step is io plus
any run of unstreamed compute longer than the ring lets the disk read ahead.
Left out: reads slowing compute (O_DIRECT DMA costs little CPU), the first pass's checksums,
CPU-GPU activation copies, prefill attention on the GPU.
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass

from tierflow.errors import BudgetError, ContextLengthError, PlanBudgetError
from tierflow.offload.gguf.model_file import ModelFile
from tierflow.offload.pack.layout import ExtentSize
from tierflow.offload.pack.writer import PackSizes
from tierflow.offload.plan.budgets import kv_cache_bytes, scratch_bytes
from tierflow.offload.plan.cost_model import Costs, Layout, Timing, timings
from tierflow.offload.plan.expert_plan import ExpertPlacement, ExpertStages, place_experts
from tierflow.offload.plan.profile import HardwareProfile
from tierflow.runtime.generation import PREFILL_CHUNK
from tierflow.units import format_size, round_up_as_printed

MAX_PREFETCH_DEPTH = 4
DEFAULT_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class GroupPlacement:
    name: str  # "embeddings", "attention", "ffn", "router" (MoE), "expert" or "output" (head, its
    # norm, rope factors)
    layer: int | None
    nbytes: int  # bytes in the pack; a layer's two groups add up to its extent; an expert is its own
    home: str  # "gpu", "cpu" or "disk" (a layer: streamed into the RAM ring every pass; an expert:
    # read into the expert cache when used and not cached)
    compute: str  # "gpu", "cpu", or for experts with a GPU cache "cpu or gpu" (scheduled every step)
    expert: int | None = None  # an expert's index in its layer


@dataclass(frozen=True)
class Plan:
    model: str
    num_layers: int
    groups: tuple[GroupPlacement, ...]
    gpu_layers: tuple[int, ...]
    resident_layers: tuple[int, ...]  # held in RAM
    streamed_layers: tuple[int, ...]  # read from disk into the ring every pass
    prefetch_depth: int  # layers read ahead of the one computing; 0 when nothing streams
    ring_slot_bytes: int
    ring_bytes: int  # (prefetch_depth + 1) slots
    kv_bytes: int
    kv_gpu_bytes: int  # of kv_bytes, the GPU layers' caches, held on the GPU; the rest is in RAM
    budget_bytes: dict[str, int]  # gpu_budget, cpu_budget as used (defaults resolved)
    used_bytes: dict[str, int]  # against the budgets: "gpu" its layers and their KV caches, "cpu"
    # globals + RAM layers + ring; "disk": the streamed layers' bytes, read from disk every pass
    peak_bytes: dict[str, dict[str, int]]  # "prefill"/"decode" -> "gpu"/"cpu" -> bytes
    prefill: Timing | None  # None: not predicted (no profile was needed, and none was given)
    decode: Timing | None  # one step at position prompt_tokens
    context_length: int
    prompt_tokens: int
    notes: tuple[str, ...]  # assumptions behind the figures
    experts: ExpertPlacement | None = None  # a MoE model's experts: their home, their cache

    @property
    def predicted_prefill_tps(self) -> float | None:
        return None if self.prefill is None else self.prefill.tokens_per_s

    @property
    def predicted_decode_tps(self) -> float | None:
        return None if self.decode is None else self.decode.tokens_per_s

    def placement(self) -> dict:
        """Where everything lives and computes, without the predictions: what two plans of the
        same model under the same budgets must agree on."""
        return {key: value for key, value in asdict(self).items()
                if key in ("groups", "gpu_layers", "resident_layers", "streamed_layers", "prefetch_depth",
                           "ring_bytes", "kv_bytes", "kv_gpu_bytes", "budget_bytes", "used_bytes")}

    def as_dict(self) -> dict:
        return asdict(self) | {"predicted_prefill_tps": self.predicted_prefill_tps,
                               "predicted_decode_tps": self.predicted_decode_tps}

    def rows(self) -> list[tuple[str, int, str, str]]:
        """(group, bytes, home, compute): the layers placed alike in one row, e.g. "layers 0-11,
        14 attention+ffn", and their experts placed alike in another, e.g. "layers 0-31 experts
        0-7"; rows in the order of their first layer."""
        runs: dict[tuple, list[GroupPlacement]] = {}
        for g in self.groups:
            if g.layer is not None:
                runs.setdefault((g.expert is not None, g.home, g.compute), []).append(g)
        rows = [(_GLOBAL_LABELS[g.name], g.nbytes, g.home, g.compute)
                for g in self.groups if g.name == "embeddings"]
        for (experts, home, compute), groups in runs.items():
            names = ("experts " + _ranges(sorted({g.expert for g in groups})) if experts
                     else "+".join(dict.fromkeys(g.name for g in groups)))
            layers = sorted({g.layer for g in groups})
            noun = "layer" if len(layers) == 1 else "layers"
            rows.append((f"{noun} {_ranges(layers)} {names}", sum(g.nbytes for g in groups), home, compute))
        return rows + [(_GLOBAL_LABELS[g.name], g.nbytes, g.home, g.compute)
                       for g in self.groups if g.name == "output"]

    def summary(self) -> list[tuple[str, str]]:
        size, d, p = format_size, self.decode, self.prefill
        ring = (f"depth {self.prefetch_depth}: {self.prefetch_depth + 1} x {size(self.ring_slot_bytes)}"
                f" = {size(self.ring_bytes)} in RAM" if self.prefetch_depth else "none (nothing streams)")
        rows = [
            ("budgets", f"gpu_memory {size(self.budget_bytes['gpu'])}, "
                        f"cpu_memory {size(self.budget_bytes['cpu'])}"),
            ("weights held", f"gpu {size(self.used_bytes['gpu'])}, cpu {size(self.used_bytes['cpu'])} "
                             f"(ring and expert cache included), disk {size(self.used_bytes['disk'])}"),
            ("layers", f"{len(self.gpu_layers)} on GPU, {len(self.resident_layers)} in RAM, "
                       f"{len(self.streamed_layers)} streamed from disk every token"),
            *([("experts", _describe_experts(self.experts))] if self.experts else []),
            ("prefetch ring", ring),
            ("KV cache", f"{size(self.kv_bytes)} ({self.context_length} positions, float32): "
                         f"{size(self.kv_gpu_bytes)} on GPU, "
                         f"{size(self.kv_bytes - self.kv_gpu_bytes)} in RAM"),
        ]
        for phase in ("prefill", "decode"):
            peak = self.peak_bytes[phase]
            rows.append((f"peak ({phase})", f"gpu {size(peak['gpu'])}, cpu {size(peak['cpu'])}"))
        if p is None or d is None:
            return rows + [("speed", "not predicted: everything is in RAM, so the machine was not measured")]
        rows += [
            ("prefill", f"{p.tokens_per_s:,.0f} tok/s for {p.tokens} tokens ({p.seconds:.3g} s: "
                        f"compute {p.compute_s:.3g} s, disk {p.io_s:.3g} s)"),
            ("decode", f"{d.tokens_per_s:,.1f} tok/s at position {self.prompt_tokens} "
                       f"({d.seconds * 1e3:.3g} ms/token: compute {d.compute_s * 1e3:.3g} ms, "
                       f"disk {d.io_s * 1e3:.3g} ms)"),
        ]
        return rows + [("note", note) for note in self.notes]

    def table(self) -> str:
        """The plan as plain text: the groups, then the summary."""
        rows = self.rows()
        width = max(len(label) for label, *_ in rows)
        lines = [f"{'group':<{width}} {'bytes':>10}  {'home':<5} compute"]
        lines += [f"{label:<{width}} {format_size(n):>10}  {home:<5} {compute}"
                  for label, n, home, compute in rows]
        return "\n".join(lines + [""] + [f"{key}: {value}" for key, value in self.summary()])


_GLOBAL_LABELS = {"embeddings": "embeddings", "output": "output head"}


def _describe_experts(p: ExpertPlacement) -> str:
    each = f"{p.total_experts} x {format_size(p.expert_bytes)}"
    if p.cache is None:
        return f"{each}, all in RAM"
    tier, misses = (("GPU memory", "run on the CPU or copied") if p.cache == "gpu"
                    else ("RAM", "read from disk"))
    return (f"{each}, home {p.home}; a cache of {p.cached_experts} ({format_size(p.cache_bytes)}) in {tier}, "
            f"policy {p.policy}; predicted hit rate {p.hit_rate:.0%} (uniform routing), "
            f"{format_size(round(p.miss_bytes_per_token))} per token {misses}")


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


# -- placement ------------------------------------------------------------------------------------

def _resident_choices(candidates: list[int], sizes: list[int], room: int) -> list[tuple[int, ...]]:
    """Resident sets for `room` bytes: first fit in layer order; then as many spread evenly."""
    first_fit, left = [], room
    for i in candidates:
        if sizes[i] <= left:
            first_fit.append(i)
            left -= sizes[i]
    m, k = len(candidates), len(first_fit)
    spread = [candidates[j] for j in range(m) if (j + 1) * k // m > j * k // m]
    fits = sum(sizes[i] for i in spread) <= room
    return [tuple(first_fit)] + ([tuple(spread)] if fits and spread != first_fit else [])


def _choose_layout(globals_: ExtentSize, layers: list[ExtentSize], gpu: tuple[int, ...], cpu_budget: int,
                   costs: Costs, prompt_tokens: int) -> Layout:
    sizes = [x.nbytes for x in layers]
    candidates = [i for i in range(len(layers)) if i not in gpu]
    everything = globals_.nbytes + sum(sizes[i] for i in candidates)
    if everything <= cpu_budget:
        return Layout(gpu, (), 0)
    slot = max(sizes)  # the streamer's slots hold the largest extent (already 4 KiB-aligned)
    if cpu_budget < globals_.nbytes + 2 * slot:
        need = f"the embeddings and output head ({format_size(globals_.nbytes)})"
        if everything < globals_.nbytes + 2 * slot:  # cheaper to hold every layer than to stream
            if candidates:
                need += f" and {len(candidates)} layers ({format_size(everything - globals_.nbytes)})"
        else:
            need += f" plus two streaming buffers of the largest layer ({format_size(slot)} each)"
        minimum = round_up_as_printed(min(everything, globals_.nbytes + 2 * slot))
        raise PlanBudgetError(f"cpu_memory {format_size(cpu_budget)} cannot hold {need}: at least "
                              f"{format_size(minimum)} is needed", minimum)
    best, best_key = None, None
    for depth in range(1, MAX_PREFETCH_DEPTH + 1):
        room = cpu_budget - globals_.nbytes - (depth + 1) * slot
        if room < 0:
            break
        for order, resident in enumerate(_resident_choices(candidates, sizes, room)):
            streamed = tuple(i for i in candidates if i not in resident)
            if len(streamed) < depth + 1:
                continue  # the ring would hold every streamed layer: a smaller depth does that
            layout = Layout(gpu, streamed, depth)
            seconds = timings(layout, globals_, layers, costs, prompt_tokens)[1].seconds
            key = (round(seconds * 1e9), sum(sizes[i] for i in streamed), -depth, order)
            if best_key is None or key < best_key:
                best, best_key = layout, key
    return best


def _gpu_layers(layers: list[ExtentSize], gpu_budget: int, kv_per_layer: int) -> tuple[int, ...]:
    """Layers from the first on while they and their KV caches fit the GPU budget."""
    chosen, used = [], 0
    for i, extent in enumerate(layers):
        if used + extent.nbytes + kv_per_layer > gpu_budget:
            break
        chosen.append(i)
        used += extent.nbytes + kv_per_layer
    return tuple(chosen)


ProfileSource = HardwareProfile | Callable[[], HardwareProfile]


def make_plan(model: ModelFile, sizes: PackSizes, profile: ProfileSource, *, gpu_budget: int, cpu_budget: int,
              context_length: int, prompt_tokens: int | None = None) -> Plan:
    """The plan for a model file under budgets the caller resolved (runtime/loader.py). A budget
    that cannot work raises PlanBudgetError (a BudgetError) naming the smallest that would.
    profile may be a function, called only when the placement needs the machine's speeds.
    prompt_tokens (default 512, at most the context) is the prefill prediction's prompt and the
    decode prediction's position."""
    config = model.config
    if not 1 <= context_length <= config.context_length:
        raise ContextLengthError(f"context_length must be 1..{config.context_length}, got {context_length}")
    if prompt_tokens is None:
        prompt_tokens = min(DEFAULT_PROMPT_TOKENS, context_length)
    if not 1 <= prompt_tokens <= context_length:
        raise ContextLengthError(f"prompt_tokens must be 1..{context_length} (the context), "
                                 f"got {prompt_tokens}")
    globals_, layers = sizes.globals, sizes.layers
    fits = not gpu_budget and sizes.total_bytes <= cpu_budget
    if callable(profile) and not fits:
        profile = profile()
    if gpu_budget > 0 and profile.gpu is None:
        raise BudgetError("gpu_memory was given but the hardware profile has no GPU; omit it or use 0")
    costs = None if callable(profile) else Costs(profile, config)
    kv_per_layer = kv_cache_bytes(config, context_length) // config.num_layers
    experts = stages = None
    if config.is_moe:  # the experts are placed, the layers stay in RAM
        gpu, layout = (), Layout((), (), 0)
        base = globals_.nbytes + sum(x.nbytes for x in layers)
        experts = place_experts(model.path.name, config, base, sizes.experts, cpu_budget, gpu_budget, profile)
        if costs is not None:
            stages = ExpertStages(experts, max((x for layer in sizes.experts for x in layer),
                                               key=lambda x: x.nbytes), costs, config)
    elif fits:
        gpu, layout = (), Layout((), (), 0)
    else:
        gpu = _gpu_layers(layers, gpu_budget, kv_per_layer)
        layout = _choose_layout(globals_, layers, gpu, cpu_budget, costs, prompt_tokens)
    prefill, decode = (None, None) if costs is None else timings(layout, globals_, layers, costs,
                                                                 prompt_tokens, stages)
    return _assemble(model, sizes, layout, experts, (prefill, decode), gpu_budget, cpu_budget, context_length,
                     prompt_tokens, costs.notes if costs else ())


def resident_plan(model: ModelFile, sizes: PackSizes, *, on_gpu: bool, gpu_budget: int, cpu_budget: int,
                  context_length: int) -> Plan:
    """A placement that streams nothing: every layer on the GPU tier (on_gpu, a dense model) or all
    of it in RAM; the caller has checked that it fits. A draft model is placed so: it runs every
    step. Nothing is predicted."""
    config = model.config
    gpu = tuple(range(config.num_layers)) if on_gpu and not config.is_moe else ()
    experts = None
    if config.is_moe:
        base = sizes.globals.nbytes + sum(x.nbytes for x in sizes.layers)
        experts = place_experts(model.path.name, config, base, sizes.experts, cpu_budget, 0, None)
    return _assemble(model, sizes, Layout(gpu, (), 0), experts, (None, None), gpu_budget, cpu_budget,
                     context_length, min(DEFAULT_PROMPT_TOKENS, context_length), ())


def _assemble(model: ModelFile, sizes: PackSizes, layout: Layout, experts: ExpertPlacement | None,
              predictions: tuple[Timing | None, Timing | None], gpu_budget: int, cpu_budget: int,
              context_length: int, prompt_tokens: int, notes) -> Plan:
    """The Plan of a chosen layout: its groups, bytes per tier and peaks."""
    config, globals_, layers, gpu = model.config, sizes.globals, sizes.layers, layout.gpu
    kv_bytes = kv_cache_bytes(config, context_length)
    kv_gpu = kv_bytes // config.num_layers * len(gpu)  # a layer on the GPU keeps its KV cache there
    scratch = {"prefill": scratch_bytes(config, min(prompt_tokens, PREFILL_CHUNK), prompt_tokens),
               "decode": scratch_bytes(config, 1, context_length)}
    resident = tuple(i for i in range(len(layers)) if i not in gpu and i not in layout.streamed)
    slot = max(x.nbytes for x in layers) if layout.depth else 0
    ring = (layout.depth + 1) * slot if layout.depth else 0

    def home(i: int) -> str:
        return "gpu" if i in gpu else "disk" if i in layout.streamed else "cpu"

    groups = [GroupPlacement(name, None, nbytes, "cpu", "cpu") for name, nbytes in globals_.groups
              if name == "embeddings"]
    groups += [GroupPlacement(name, i, nbytes, home(i), "gpu" if i in gpu else "cpu")
               for i, extent in enumerate(layers) for name, nbytes in extent.groups]
    if experts is not None:
        groups += _expert_groups(experts, sizes.experts)
    groups += [GroupPlacement(name, None, nbytes, "cpu", "cpu") for name, nbytes in globals_.groups
               if name != "embeddings"]
    used = {"gpu": sum(layers[i].nbytes for i in gpu) + kv_gpu,
            "cpu": globals_.nbytes + sum(layers[i].nbytes for i in resident) + ring,
            "disk": sum(layers[i].nbytes for i in layout.streamed)}
    if experts is not None:
        used[experts.home] += sum(x.nbytes for layer in sizes.experts for x in layer)
        if experts.cache is not None:
            used[experts.cache] += experts.cache_bytes
    peak = {phase: {"gpu": used["gpu"] + (scratch[phase] if gpu else 0),
                    "cpu": used["cpu"] + kv_bytes - kv_gpu + scratch[phase]} for phase in scratch}
    prefill, decode = predictions
    return Plan(model=model.path.name, num_layers=config.num_layers, groups=tuple(groups), gpu_layers=gpu,
                resident_layers=resident, streamed_layers=layout.streamed, prefetch_depth=layout.depth,
                ring_slot_bytes=slot, ring_bytes=ring, kv_bytes=kv_bytes, kv_gpu_bytes=kv_gpu,
                budget_bytes={"gpu": gpu_budget, "cpu": cpu_budget}, used_bytes=used, peak_bytes=peak,
                prefill=prefill, decode=decode, context_length=context_length,
                prompt_tokens=prompt_tokens, notes=tuple(notes), experts=experts)


def _expert_groups(p: ExpertPlacement, extents: list[list[ExtentSize]]) -> list[GroupPlacement]:
    compute = "cpu or gpu" if p.cache == "gpu" else "cpu"
    return [GroupPlacement("expert", i, x.nbytes, p.home, compute, expert=e)
            for i, layer in enumerate(extents) for e, x in enumerate(layer)]
