"""The self-draft: a target with no small model of its vocabulary drafts with its own first layers,
its output norm and its output head (LayerSkip's early exit, without LayerSkip's training).

The draft's layers are the target's own weights, seen through `PrefixWeights`: nothing is copied.
The planner holds them (Budgets.draft_layers: never streamed, on the GPU tier or in RAM) and counts
the draft's own KV cache of them, one sequence's, beside the target's, on the tier where each
layer computes. A draft of fewer layers costs less per level and agrees with the target less
often (on SmolLM2-135M, greedy, the first 16 of 30 layers picked the target's token 11% of the
time, 24 layers 41%, 27 layers 48%); "self" without a depth leaves the choice to measurement
(speculative/choice.py), among DEPTH_FRACTIONS of the most layers the budgets hold.
"""

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tierflow.errors import BudgetError, InvalidArgumentError
from tierflow.kv_types import KV_TYPES
from tierflow.offload.gguf.model_file import ModelFile
from tierflow.offload.pack.writer import PackSizes
from tierflow.offload.plan.budgets import layer_kv_bytes
from tierflow.offload.plan.planner import ProfileSource
from tierflow.runtime.compute.interfaces import Weights
from tierflow.runtime.decoder.decoder import Decoder
from tierflow.runtime.decoder.host_attention import HostAttention
from tierflow.runtime.generation.token_loop import TokenGenerator
from tierflow.runtime.loading.loader import Budgets, LoadedModel, plan_load
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.runtime.sampling.sampler import Sampler
from tierflow.speculative.drafts import ModelDraft
from tierflow.speculative.tree import TokenTree
from tierflow.units import format_size

DEPTH_FRACTIONS = (0.5, 0.75, 1.0)  # "self": the depths tried, of the most layers the budgets hold


@dataclass(frozen=True)
class DraftRequest:
    """What Engine.load's draft asks for: "ngram", a draft model file, "self" or "self:N", "mtp"
    (the file's multi-token-prediction block), or "auto" (ngram, a self-draft, and with
    "auto:FILE" that draft file, chosen by prediction)."""

    kind: str  # "ngram", "file", "self", "mtp" or "auto"
    file: str | os.PathLike | None = None  # "file", or "auto" with a draft file
    layers: int | None = None  # "self:N"; None: chosen by measurement

    @property
    def wants_self(self) -> bool:
        return self.kind in ("self", "auto")


def parse_draft(draft: str | os.PathLike | None, num_layers: int) -> DraftRequest | None:
    """The draft keyword, checked: self:N with 1 <= N < num_layers (the target's layers)."""
    if draft is None:
        return None
    if isinstance(draft, os.PathLike):
        return DraftRequest("file", draft)
    if not isinstance(draft, str) or not draft:
        raise InvalidArgumentError(f"draft must be 'ngram', 'self', 'self:N', 'mtp', 'auto', 'auto:FILE' or "
                                   f"a GGUF file, not {draft!r}")
    kind, _, rest = draft.partition(":")
    if draft in ("ngram", "self", "mtp", "auto"):
        return DraftRequest(draft)
    if kind == "auto" and rest:
        return DraftRequest("auto", rest)
    if kind == "self":
        return DraftRequest("self", layers=_depth(rest, num_layers))
    return DraftRequest("file", draft)


def _depth(text: str, num_layers: int) -> int:
    if not text.strip().isdigit():
        raise InvalidArgumentError(f"draft 'self:{text}': N must be a whole number of layers, from 1 to "
                                   f"{num_layers - 1} (the target has {num_layers})")
    layers = int(text)
    if not 1 <= layers < num_layers:
        raise InvalidArgumentError(f"draft 'self:{layers}' drafts with {layers} layers, but the target has "
                                   f"{num_layers}: N must be from 1 to {num_layers - 1}")
    return layers


def self_draft_budgets(model: ModelFile, sizes: PackSizes, budgets: Budgets, profile: ProfileSource,
                       asked: int | None, required: bool) -> Budgets | None:
    """budgets with the self-draft's layers set (Budgets.draft_layers): the number asked for, else
    the layers the target's plan holds anyway (all but the last at most), halved until the
    draft's KV cache fits. A draft that cannot fit is a BudgetError naming its cache when
    `required`, else None."""
    config = model.config
    layers = asked
    if layers is None:
        held = config.num_layers - len(plan_load(model, sizes, budgets, profile).streamed_layers)
        layers = max(1, min(held, config.num_layers - 1))
    while True:
        drafted = replace(budgets, draft_layers=layers)
        try:
            plan_load(model, sizes, drafted, profile)
            return drafted
        except BudgetError as error:
            if asked is None and layers > 1:
                layers //= 2
                continue
            if not required:
                return None
            cache = sum(layer_kv_bytes(config, i, budgets.context_length, budgets.kv) for i in range(layers))
            raise BudgetError(f"{error} (with the self-draft's {layers} layers held and its KV cache of "
                              f"them, {format_size(cache)} at {budgets.context_length} positions)") from error


def self_draft_depths(most: int, asked: int | None) -> list[int]:
    """The depths a self-draft may run at: the one asked for, or DEPTH_FRACTIONS of `most`."""
    if asked is not None:
        return [asked]
    return sorted({max(1, round(most * fraction)) for fraction in DEPTH_FRACTIONS})


class PrefixWeights:
    """A target's weights as a model of its first `num_layers` layers (held ones, which the
    planner never streams), its embeddings, output norm and head: a WeightSource for the draft."""

    def __init__(self, target: LoadedModel, num_layers: int):
        self._weights = target.weights
        self._layers = [target.weights.held_layer(i) for i in range(num_layers)]

    def embedding_rows(self, token_ids):
        return self._weights.embedding_rows(token_ids)

    def layer(self, layer_idx: int) -> Weights:
        return self._layers[layer_idx]

    def output_norm(self):
        return self._weights.output_norm()

    def output(self):
        return self._weights.output()

    def rope_freq_factors(self):
        return self._weights.rope_freq_factors()


def self_draft_generators(target: LoadedModel, depths: list[int]) -> dict[int, TokenGenerator]:
    """A token generator per depth, over one KV cache of the deepest's layers, each layer's where
    the target computes it (in RAM with kv_on_cpu): a shallower draft uses its first layers.
    Only one depth's history is in it at a time (SelfDraft starts it over on a switch)."""
    plan, deepest = target.plan, max(depths)
    allocate = None if plan.kv_on_cpu else target.weights.allocate_cache
    cache = KVCache(target.config.first_layers(deepest), target.context_length, allocate,
                    kv_type=KV_TYPES[plan.kv_type])
    generators = {}
    for depth in depths:
        source = PrefixWeights(target, depth)
        source = HostAttention.over(source) if plan.kv_on_cpu else source
        config = target.config.first_layers(depth)
        generators[depth] = TokenGenerator(Decoder(config, target.arch.block, source, target.context_length),
                                           cache)
    return generators


class SelfDraft(ModelDraft):
    """A ModelDraft at one depth of the self-draft, whose KV cache the other depths share (`owner`
    holds the generator whose history is in it): a depth that runs after another starts the
    cache over, which its first propose then prefills. All depths take the same turn."""

    def __init__(self, generator: TokenGenerator, owner: list, turn: threading.Lock, max_width: int = 4):
        super().__init__(generator, max_width, turn=turn)
        self.owner = owner

    def fresh(self) -> "SelfDraft":
        return SelfDraft(self.generator, self.owner, self.turn, self.max_width)

    def propose(self, history: Sequence[int], budget: int, sampler: Sampler,
                target: TokenGenerator | None = None) -> TokenTree:
        if self.owner[0] is not self.generator:
            self.generator.keep(0)
            self.owner[0] = self.generator
        return super().propose(history, budget, sampler)
