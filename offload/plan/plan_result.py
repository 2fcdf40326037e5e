"""The planner's result: a Plan, what it holds and how `tierflow plan` prints it."""

from dataclasses import asdict, dataclass

from tierflow.offload.plan.cost_model import Timing
from tierflow.offload.plan.expert_plan import ExpertPlacement
from tierflow.units import format_size


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
    kv_type: str  # the KV cache's type (kv_types.KV_TYPES)
    kv_on_cpu: bool  # every layer's cache in RAM, the GPU layers' too
    kv_bytes: int  # the whole KV cache at context_length: every sequence's
    kv_gpu_bytes: int  # of kv_bytes, the GPU layers' caches, held on the GPU; the rest is in RAM
    activation_bytes: int  # RAM kept within cpu_budget for the largest pass's activations
    budget_bytes: dict[str, int]  # gpu_budget, cpu_budget as used (defaults resolved)
    used_bytes: dict[str, int]  # held against the budgets: "gpu" its layers and their KV caches,
    # "cpu" globals + RAM layers + ring (+ expert homes and caches) + the KV cache in RAM; "disk":
    # the streamed layers' bytes, read from disk every pass
    peak_bytes: dict[str, dict[str, int]]  # "prefill"/"decode" -> "gpu"/"cpu" -> bytes
    prefill: Timing | None  # None: not predicted (no profile was needed, and none was given)
    decode: Timing | None  # one step with the context full (at position context_length - 1)
    context_length: int
    prompt_tokens: int
    notes: tuple[str, ...]  # assumptions behind the figures
    experts: ExpertPlacement | None = None  # a MoE model's experts: their home, their cache
    sequences: int = 1  # KV caches of context_length positions: the sequences decoded together
    draft_layers: int = 0  # a self-draft's layers (the first ones): never streamed; kv_bytes holds its cache

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
                           "ring_bytes", "kv_type", "kv_on_cpu", "kv_bytes", "kv_gpu_bytes",
                           "activation_bytes", "budget_bytes", "used_bytes", "context_length", "sequences")}

    def weight_bytes(self) -> dict[str, int]:
        """used_bytes less the KV cache: the weights held per tier (and read from disk)."""
        kv_cpu = self.kv_bytes - self.kv_gpu_bytes
        return self.used_bytes | {"gpu": self.used_bytes["gpu"] - self.kv_gpu_bytes,
                                  "cpu": self.used_bytes["cpu"] - kv_cpu}

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
            ("held", f"gpu {size(self.used_bytes['gpu'])}, cpu {size(self.used_bytes['cpu'])} (weights, "
                     f"ring, expert cache and KV cache), disk {size(self.used_bytes['disk'])}"),
            ("layers", f"{len(self.gpu_layers)} on GPU, {len(self.resident_layers)} in RAM, "
                       f"{len(self.streamed_layers)} streamed from disk every token"),
            *(_describe_experts(self.experts) if self.experts else []),
            ("prefetch ring", ring),
            ("context", f"{self.context_length} positions"
                        + (f" in each of {self.sequences} sequences" if self.sequences > 1 else "")),
            ("KV cache", f"{self.kv_type}, {size(self.kv_bytes)}: {size(self.kv_gpu_bytes)} on GPU, "
                         f"{size(self.kv_bytes - self.kv_gpu_bytes)} in RAM"
                         + (" (kv_on_cpu: the CPU attends)" if self.kv_on_cpu else "")),
            ("activations", f"up to {size(self.activation_bytes)} in RAM (a prefill chunk at the "
                            f"context's end)"),
        ]
        for phase in ("prefill", "decode"):
            peak = self.peak_bytes[phase]
            rows.append((f"peak ({phase})", f"gpu {size(peak['gpu'])}, cpu {size(peak['cpu'])}"))
        if p is None or d is None:
            rows.append(("speed", "not predicted: everything is in RAM, so the machine was not measured"))
        else:
            rows += [
                ("prefill", f"{p.tokens_per_s:,.0f} tok/s for {p.tokens} tokens ({p.seconds:.3g} s: "
                            f"compute {p.compute_s:.3g} s, disk {p.io_s:.3g} s)"),
                ("decode", f"{d.tokens_per_s:,.1f} tok/s with the context full "
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


def _describe_experts(p: ExpertPlacement) -> list[tuple[str, str]]:
    """The summary's rows of the experts: each tier, its share of uses, and where the shares come from."""
    size = format_size
    served = {tier: f"serves {p.served[tier]:.0%} of uses, {size(round(p.bytes_per_token[tier]))} per token"
              for tier in p.served}
    if p.gpu_layers:
        gpu = f"every expert of layers {_ranges(list(p.gpu_layers))}, placed by hand; {served['gpu']}"
    elif p.gpu_cache_bytes:
        gpu = (f"a cache of {p.gpu_cached_experts} ({size(p.gpu_cache_bytes)}), policy {p.policy}; "
               f"{served['gpu']}")
    else:
        gpu = "none" + (", placed by hand" if p.manual else "")
    if p.home == "cpu":
        ram = f"every expert off the GPU; {served['cpu']}"
    else:
        ram = (f"a cache of {p.ram_cached_experts} ({size(p.ram_cache_bytes)}), policy {p.policy}; "
               f"{served['cpu']}")
    rows = [("experts", f"{p.total_experts} x {size(p.expert_bytes)}; shares predicted from {p.routing}"),
            ("experts on GPU", gpu), ("experts in RAM", ram)]
    if p.home == "disk":
        source = "as the recorded predictions say" if p.read_ahead_measured else "assumed"
        rows.append(("experts on disk", f"the rest, read when used ({p.read_ahead:.0%} a layer early, "
                                        f"{source}); {served['disk']}"))
    if p.skip_below:
        rows.append(("experts skipped", f"a disk read under {p.skip_below:g} of a token's router weight: "
                                        f"{p.skipped:.0%} of uses predicted, "
                                        f"{size(round(p.skipped_bytes_per_token))} per token not read "
                                        f"(not exact: the model's output changes)"))
    if p.union_cap:
        rows.append(("experts per verify", f"at most {p.union_cap} distinct per layer in a pass verifying a "
                                           f"token tree (not exact: the model's output changes)"))
    return rows


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
