"""The planner: from the GGUF header, the hardware profile and the budgets, a `Plan`.

    plan = make_plan(model, pack_sizes(model), profile, gpu_budget=0, cpu_budget=2 << 30,
                     context_length=4096, kv=kv_type("q8_0"))
    print(plan.table())

No weight is read. A Plan gives every tensor group (the embeddings, each layer's attention and
FFN, the output head) a home tier and a compute device, the prefetch depth, the KV cache's type,
size and tiers, peak memory per tier and the predicted prefill and decode tokens/s.

Bytes. Weights are counted as the model's pack lays them out (offload/pack/layout.py: the writer's
own walk, sized from the header), which is what TieredWeights holds and the streamer reads: one
extent for the globals (embeddings, output norm and head, rope factors), one per layer (its norms
and packed linears), arrays 64-byte aligned, extents padded to 4 KiB. A layer's attention and FFN
share its extent, so they share a home; its groups are its family's tensor map's.

Budgets are resolved by the caller (runtime/loading/loader.py, the one place defaults are decided; the
context a default load gets is offload/plan/context.py's). A budget holds everything placed on its
tier: cpu_memory the weights kept in RAM, the KV cache of the layers computed on the CPU and the
activations of the largest pass (budgets.py); gpu_memory the GPU layers and their caches. With
kv_on_cpu (llama.cpp's -nkvo) every layer's cache is in RAM and the CPU attends over it. A
layer's cache holds the whole context, or a ring (kv_types.cache_positions) for a sliding-window
layer. The hardware profile may be handed over as a function: it is called only when the placement depends
on the machine's speeds (something streams, or there is a GPU budget); otherwise the plan places
everything in RAM and predicts nothing (`prefill` and `decode` are None).

A mixture-of-experts model streams no layer: with a GPU budget its layers (attention, router,
shared expert: what every token uses) go to the GPU first as step 1 places a dense model's, the
rest stay in RAM, and its experts are placed on three tiers (offload/plan/expert_plan.py): on the
GPU (a cache of hot ones, or by hand every expert of the last layers), in RAM, and on disk behind
a cache in RAM; the plan's `experts` says which, and its groups list every expert.

Placement of a dense model, in order:
1. GPU (only when the profile has a GPU and gpu_budget > 0): layers from 0 up while they fit, each
   with its KV cache (a layer computed on the GPU keeps its keys and values there).
2. cpu_budget less the RAM's KV cache and activations is what the weights get. The globals stay
   in RAM (every token needs them), and so do a self-draft's layers (draft_layers, the first
   ones, not on the GPU: the draft runs them every step); its KV cache of those layers counts
   with the target's, on the tier where each layer computes.
3. If the other layers fit beside them, all are resident: no ring, depth 0.
4. Else the rest stream from disk through a ring of depth + 1 slots of the largest layer's extent,
   depth 1..4, the ring counted against cpu_budget. For each affordable depth, the layers that fit
   in what is left stay resident: first fit in layer order, or as many spread evenly (resident
   layers between streamed ones give the disk time to read ahead). The (depth, layout) with the
   lowest predicted decode time wins; ties go to fewer streamed bytes, a deeper ring, then the
   earliest layers. Below globals + min(the other layers, two slots) + the KV cache and
   activations in RAM, BudgetError names that size.

Cost model (GB = 1e9 bytes; speeds from the HardwareProfile). A pass (a decode step at the last
position, p = context_length - 1, or a prefill chunk of T <= 512 tokens at positions
s .. s + T - 1) is a chain of stages, one per layer and one for the output head:
    compute = sum over linears of T * bytes / rate(bits)            matmuls
              + layer_overhead_s                                    norms, rope, Python (per pass)
              + decode: 2 * K * row_bytes(D) * n / rate             attention reads, n = p + 1
                (min(p + 1, window) for a window layer), the type's bytes, from RAM
                (ram_read_gbps) or the GPU, wherever the layer's cache is
                prefill: 4 * H * D * T * n flops / (2e9 * kernel_batch_gbps[8]), on the CPU,
                n = s + (T + 1) / 2 (at most the window)
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
from dataclasses import replace

from tierflow.errors import BudgetError, ContextLengthError
from tierflow.kv_types import DEFAULT_KV_TYPE, KV_TYPES, KVType
from tierflow.offload.experts.routing_trace import Routing
from tierflow.offload.gguf.model_file import ModelFile
from tierflow.offload.pack.layout import ExtentSize
from tierflow.offload.pack.writer import PackSizes
from tierflow.offload.plan.budgets import CacheFootprint, RamBudget, scratch_bytes
from tierflow.offload.plan.cost_model import Costs, Layout, Timing, timings
from tierflow.offload.plan.expert_plan import (
    ExpertPlacement,
    ExpertRequest,
    ExpertStages,
    largest_expert,
    place_experts,
)
from tierflow.offload.plan.plan_result import GroupPlacement, Plan
from tierflow.offload.plan.profile import HardwareProfile
from tierflow.units import format_size, round_up_as_printed

MAX_PREFETCH_DEPTH = 4
DEFAULT_PROMPT_TOKENS = 512


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


def _choose_layout(globals_: ExtentSize, layers: list[ExtentSize], gpu: tuple[int, ...], ram: RamBudget,
                   costs: Costs, prompt_tokens: int, context_length: int, pinned: int = 0) -> Layout:
    """The streamed layers and ring depth (steps 3 and 4); the first `pinned` layers (a
    self-draft's) are held like the globals, never streamed."""
    sizes = [x.nbytes for x in layers]
    held = [i for i in range(min(pinned, len(layers))) if i not in gpu]
    fixed = globals_.nbytes + sum(sizes[i] for i in held)  # in RAM whatever else streams
    candidates = [i for i in range(len(layers)) if i not in gpu and i not in held]
    everything = fixed + sum(sizes[i] for i in candidates)
    if everything <= ram.room:
        return Layout(gpu, (), 0)
    slot = max(sizes)  # the streamer's slots hold the largest extent (already 4 KiB-aligned)
    if ram.room < fixed + 2 * slot:
        need = f"the embeddings and output head ({format_size(globals_.nbytes)})"
        if held:
            need += f", the self-draft's {len(held)} layers ({format_size(fixed - globals_.nbytes)})"
        if everything < fixed + 2 * slot:  # cheaper to hold every layer than to stream
            if candidates:
                need += f" and {len(candidates)} layers ({format_size(everything - fixed)})"
        else:
            need += f" plus two streaming buffers of the largest layer ({format_size(slot)} each)"
        raise ram.refuse(need, min(everything, fixed + 2 * slot))
    best, best_key = None, None
    for depth in range(1, MAX_PREFETCH_DEPTH + 1):
        room = ram.room - fixed - (depth + 1) * slot
        if room < 0:
            break
        for order, resident in enumerate(_resident_choices(candidates, sizes, room)):
            streamed = tuple(i for i in candidates if i not in resident)
            if len(streamed) < depth + 1:
                continue  # the ring would hold every streamed layer: a smaller depth does that
            layout = Layout(gpu, streamed, depth)
            seconds = timings(layout, globals_, layers, costs, prompt_tokens, context_length)[1].seconds
            key = (round(seconds * 1e9), sum(sizes[i] for i in streamed), -depth, order)
            if best_key is None or key < best_key:
                best, best_key = layout, key
    return best


def _layers_left_in_ram(layers: list[ExtentSize], gpu: tuple[int, ...], gpu_kv: list[int]) -> str:
    """The note of a MoE model whose always-used weights do not all fit gpu_memory."""
    everything = sum(x.nbytes for x in layers) + sum(gpu_kv)
    held = f"layers 0-{len(gpu) - 1}'s" if gpu else "none of its layers'"
    return (f"gpu_memory holds {held} attention, routers and shared experts with their KV cache; the "
            f"other layers compute in RAM: all of them need {format_size(everything)} on the GPU")


def _gpu_layers(layers: list[ExtentSize], gpu_budget: int, gpu_kv: list[int]) -> tuple[int, ...]:
    """Layers from the first on while they and their KV caches on the GPU (gpu_kv) fit the budget."""
    chosen, used = [], 0
    for i, extent in enumerate(layers):
        if used + extent.nbytes + gpu_kv[i] > gpu_budget:
            break
        chosen.append(i)
        used += extent.nbytes + gpu_kv[i]
    return tuple(chosen)


def _least_gpu_beside_experts(globals_: ExtentSize, layers: list[ExtentSize],
                              experts: list[list[ExtentSize]], cache: CacheFootprint, cpu_budget: int
                              ) -> int | None:
    """The least gpu_memory whose layers (from the first on, with their KV cache) leave cpu_memory
    room for the others beside one layer's experts, what an expert cache needs at least; None when
    even every layer on the GPU leaves too little."""
    one_layer = max(sum(x.nbytes for x in layer) for layer in experts)
    for count in range(1, len(layers) + 1):
        gpu = tuple(range(count))
        in_ram = globals_.nbytes + sum(x.nbytes for x in layers[count:]) + one_layer
        if in_ram <= cache.ram(cpu_budget, gpu).room:
            return round_up_as_printed(sum(x.nbytes for x in layers[:count]) + cache.gpu_bytes(gpu))
    return None


ProfileSource = HardwareProfile | Callable[[], HardwareProfile]


def make_plan(model: ModelFile, sizes: PackSizes, profile: ProfileSource, *, gpu_budget: int, cpu_budget: int,
              context_length: int, prompt_tokens: int | None = None, kv: KVType = KV_TYPES[DEFAULT_KV_TYPE],
              kv_on_cpu: bool = False, sequences: int = 1, draft_layers: int = 0,
              expert_request: ExpertRequest = ExpertRequest(), routing: Routing | None = None) -> Plan:
    """The plan for a model file under budgets the caller resolved (runtime/loading/loader.py), with a KV
    cache of type kv for context_length positions (the caller checked it against the model's) for
    each of `sequences` sequences decoded together. draft_layers > 0: a self-draft computes with
    the first draft_layers layers, which are then never streamed, and holds its own KV cache of
    them (one sequence's) beside the target's, where they compute.
    A budget that cannot work raises PlanBudgetError (a BudgetError) naming the smallest that
    would. profile may be a function, called only when the placement needs the machine's speeds.
    prompt_tokens (default 512, at most the context) is the prefill prediction's prompt. A MoE
    model's experts go where expert_request asks (ExpertRequest: auto, or by hand), with hit rates
    and read-ahead from `routing`, the model's recorded routing (its trace expert_plan.trace_fits),
    when one is given."""
    config = model.config
    if context_length < 1:
        raise ContextLengthError(f"context_length must be at least 1, got {context_length}")
    if prompt_tokens is None:
        prompt_tokens = min(DEFAULT_PROMPT_TOKENS, context_length)
    if not 1 <= prompt_tokens <= context_length:
        raise ContextLengthError(f"prompt_tokens must be 1..{context_length} (the context), "
                                 f"got {prompt_tokens}")
    globals_, layers = sizes.globals, sizes.layers
    cache = CacheFootprint.of(config, context_length, kv, kv_on_cpu, sequences, draft_layers)
    fits = not gpu_budget and sizes.total_bytes <= cache.ram(cpu_budget, ()).room
    if callable(profile) and not fits:
        profile = profile()
    if gpu_budget > 0 and profile.gpu is None:
        raise BudgetError("gpu_memory was given but the hardware profile has no GPU; omit it or use 0")
    costs = None if callable(profile) else Costs(profile, config, kv, kv_on_cpu)
    experts = stages = None
    notes = list(costs.notes) if costs else []
    if config.is_moe:  # the layers go to the GPU or RAM, the experts are placed
        gpu = _gpu_layers(layers, gpu_budget, cache.on_gpu()) if gpu_budget else ()
        layout = Layout(gpu, (), 0)
        base = globals_.nbytes + sum(x.nbytes for i, x in enumerate(layers) if i not in gpu)
        gpu_held = sum(layers[i].nbytes for i in gpu) + cache.gpu_bytes(gpu)
        least_gpu = (_least_gpu_beside_experts(globals_, layers, sizes.experts, cache, cpu_budget)
                     if costs is not None and profile.gpu is not None and not expert_request.manual else None)
        experts = place_experts(model.path.name, config, base, sizes.experts, cache.ram(cpu_budget, gpu),
                                (gpu_budget, gpu_held), profile, expert_request, routing, least_gpu)
        if gpu_budget and len(gpu) < len(layers):
            notes.append(_layers_left_in_ram(layers, gpu, cache.on_gpu()))
        if costs is not None:
            stages = ExpertStages(experts, largest_expert(sizes.experts), costs, config)
    elif fits:
        gpu, layout = (), Layout((), (), 0)
    else:
        gpu = _gpu_layers(layers, gpu_budget, cache.on_gpu())
        layout = _choose_layout(globals_, layers, gpu, cache.ram(cpu_budget, gpu), costs, prompt_tokens,
                                context_length, draft_layers)
    prefill, decode = (None, None) if costs is None else timings(layout, globals_, layers, costs,
                                                                 prompt_tokens, context_length, stages)
    plan = _assemble(model, sizes, layout, experts, (prefill, decode), cache, gpu_budget, cpu_budget,
                     context_length, prompt_tokens, notes)
    return replace(plan, sequences=sequences, draft_layers=draft_layers)


def resident_plan(model: ModelFile, sizes: PackSizes, *, on_gpu: bool, gpu_budget: int, cpu_budget: int,
                  context_length: int, kv: KVType, kv_on_cpu: bool = False) -> Plan:
    """A placement that streams nothing: every layer on the GPU tier (on_gpu, a dense model) or all
    of it in RAM; the caller has checked that it fits. A draft model is placed so: it runs every
    step. Nothing is predicted."""
    config = model.config
    gpu = tuple(range(config.num_layers)) if on_gpu and not config.is_moe else ()
    cache = CacheFootprint.of(config, context_length, kv, kv_on_cpu)
    experts = None
    if config.is_moe:
        base = sizes.globals.nbytes + sum(x.nbytes for x in sizes.layers)
        experts = place_experts(model.path.name, config, base, sizes.experts, cache.ram(cpu_budget, ()),
                                (0, 0), None)
    return _assemble(model, sizes, Layout(gpu, (), 0), experts, (None, None), cache, gpu_budget, cpu_budget,
                     context_length, min(DEFAULT_PROMPT_TOKENS, context_length), ())


def _assemble(model: ModelFile, sizes: PackSizes, layout: Layout, experts: ExpertPlacement | None,
              predictions: tuple[Timing | None, Timing | None], cache: CacheFootprint, gpu_budget: int,
              cpu_budget: int, context_length: int, prompt_tokens: int, notes) -> Plan:
    """The Plan of a chosen layout: its groups, bytes per tier and peaks."""
    config, globals_, layers, gpu = model.config, sizes.globals, sizes.layers, layout.gpu
    kv_bytes, kv_gpu = sum(cache.layer_bytes), cache.gpu_bytes(gpu)
    scratch = {"prefill": cache.activation_bytes, "decode": scratch_bytes(config, 1, context_length)}
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
            "cpu": globals_.nbytes + sum(layers[i].nbytes for i in resident) + ring + kv_bytes - kv_gpu,
            "disk": sum(layers[i].nbytes for i in layout.streamed)}
    if experts is not None:
        on_gpu = sum(x.nbytes for i in experts.gpu_layers for x in sizes.experts[i])
        used[experts.home] += sum(x.nbytes for layer in sizes.experts for x in layer) - on_gpu
        used["gpu"] += on_gpu + experts.gpu_cache_bytes
        used["cpu"] += experts.ram_cache_bytes
    peak = {phase: {"gpu": used["gpu"] + (scratch[phase] if gpu else 0), "cpu": used["cpu"] + scratch[phase]}
            for phase in scratch}
    prefill, decode = predictions
    return Plan(model=model.path.name, num_layers=config.num_layers, groups=tuple(groups), gpu_layers=gpu,
                resident_layers=resident, streamed_layers=layout.streamed, prefetch_depth=layout.depth,
                ring_slot_bytes=slot, ring_bytes=ring, kv_type=cache.kv.name, kv_on_cpu=cache.on_cpu,
                kv_bytes=kv_bytes, kv_gpu_bytes=kv_gpu, activation_bytes=cache.activation_bytes,
                budget_bytes={"gpu": gpu_budget, "cpu": cpu_budget}, used_bytes=used, peak_bytes=peak,
                prefill=prefill, decode=decode, context_length=context_length,
                prompt_tokens=prompt_tokens, notes=tuple(notes), experts=experts)


def _expert_groups(p: ExpertPlacement, extents: list[list[ExtentSize]]) -> list[GroupPlacement]:
    def placed(layer: int) -> tuple[str, str]:
        if layer in p.gpu_layers:
            return "gpu", "gpu"
        return p.home, "cpu or gpu" if p.gpu_cache_bytes else "cpu"

    return [GroupPlacement("expert", i, x.nbytes, *placed(i), expert=e)
            for i, layer in enumerate(extents) for e, x in enumerate(layer)]
