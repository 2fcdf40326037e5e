"""The MTP draft (`draft="mtp"`): the target's own multi-token-prediction block, the layer that
Qwen3.5 and Qwen3-Next files carry after their last one (`nextn_predict_layers`), as llama.cpp
runs it (graph_mtp). At position q it reads the token at q and the target's final-normed hidden
state at q - 1:

    x = eh_proj([enorm * rms(embed(token_q)), hnorm * rms(h_{q-1})])
    x = block(x)                      a full-attention layer with the family's FFN, its own KV cache
    h'_q = head_norm * rms(x)         (nextn.shared_head_norm, else the target's output_norm)
    logits = output(h'_q)             the target's head: a guess at the token at q + 1

Its cache holds one such row per position the target has passed, each from the target's hidden
state (the target's generator keeps them: runtime/memory/hidden_trail.py). Guesses further ahead chain
the block on its own h' in place of the target's, level by level as ModelDraft grows any draft's
tree; those rows are dropped once the target has verified them, and the accepted tokens are fed
again with the target's hidden states.

The block is built in RAM from the model file at load (it is not in the pack): its bytes, its KV
cache of `context_length` positions and the hidden-state trail are taken from cpu_memory before
the target is planned. It computes on the CPU.
"""

import threading
from collections.abc import Sequence

import numpy as np

from tierflow.cpu_kernels import ops
from tierflow.errors import BudgetError, InvalidArgumentError
from tierflow.kv_types import KV_TYPES
from tierflow.offload.gguf.model_file import ModelFile
from tierflow.offload.gguf.tensors import check_tensors, mtp_tensors
from tierflow.offload.pack.layout import ExtentLayout, TensorDecoder
from tierflow.offload.pack.reader import extent_fields
from tierflow.offload.plan.budgets import layer_kv_bytes
from tierflow.offload.tiers.tiered import ResidentExperts
from tierflow.runtime.compute.interfaces import Weights
from tierflow.runtime.decoder.decoder import Decoder, SequenceInput
from tierflow.runtime.generation.token_loop import PREFILL_CHUNK, TokenGenerator
from tierflow.runtime.loading.loader import Budgets, LoadedModel
from tierflow.runtime.memory.hidden_trail import HiddenTrail
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.runtime.sampling.sampler import Sampler
from tierflow.speculative.drafts import ModelDraft
from tierflow.speculative.tree import TokenTree
from tierflow.units import format_size

TRAIL_ROWS = 2 * PREFILL_CHUNK  # the target's hidden states kept per sequence: the prompt's last positions


def check_mtp(model: ModelFile) -> None:
    """Refuses `draft="mtp"` for a file without a block tierflow runs, naming why; checks the
    block's tensors as the model's own are checked."""
    config, name = model.config, model.path.name
    if model.arch.mtp_fields is None:
        raise InvalidArgumentError(f"draft 'mtp': tierflow runs no multi-token-prediction block for "
                                   f"{config.arch} models ({name})")
    if config.nextn_layers == 0:
        raise InvalidArgumentError(f"draft 'mtp': {name} has no multi-token-prediction block "
                                   f"({config.arch}.nextn_predict_layers is 0 or absent)")
    check_tensors(model.gguf, model.arch, config, mtp_tensors(model.gguf, model.arch, config))


def mtp_ram_bytes_within(model: ModelFile, budgets: Budgets) -> int:
    """What the MTP draft holds in RAM (the block as the pack would lay it out, its KV cache and
    each sequence's hidden-state trail), checked first: a file without a block it runs is an
    InvalidArgumentError, a cpu_memory that cannot hold it a BudgetError naming both."""
    check_mtp(model)
    cache = layer_kv_bytes(model.config.mtp_config(), 0, budgets.context_length, budgets.kv)
    trail = budgets.sequences * TRAIL_ROWS * model.config.hidden_size * 4
    needed = sum(layout.extent_size().nbytes for layout in _layouts(model, None)) + cache + trail
    if needed > budgets.cpu_bytes:
        raise BudgetError(f"cpu_memory {format_size(max(budgets.cpu_bytes, 0))} cannot hold the MTP draft of "
                          f"{model.path.name} ({format_size(needed)}: its block, its KV cache and the "
                          f"target's hidden states), which is placed first")
    return needed


def _layouts(model: ModelFile, decoder: TensorDecoder | None) -> list[ExtentLayout]:
    """The block's extent, then its experts' (a MoE model's), laid out as the pack's."""
    config, arch, layer = model.config, model.arch, model.config.num_layers
    layouts = [ExtentLayout(model.gguf, decoder).add_fields(arch.mtp_fields(config))]
    if config.is_moe:
        layouts += [ExtentLayout(model.gguf, decoder).add_fields(arch.expert_fields(config, layer, e))
                    for e in range(config.num_experts)]
    return layouts


class MtpBlock:
    """The block's weights in RAM, as the WeightSource of a one-layer decoder whose embeddings
    and head are the target's."""

    def __init__(self, model: ModelFile, target: LoadedModel):
        block, *experts = [_weights(layout) for layout in _layouts(model, TensorDecoder(model.gguf))]
        self._layer = Weights(block.fields, experts=ResidentExperts(experts) if experts else None)
        self._target = target.weights

    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray:
        return self._target.embedding_rows(token_ids)

    def layer(self, layer_idx: int) -> Weights:
        return self._layer

    def output_norm(self) -> np.ndarray:
        return self._layer.fields.get("head_norm", self._target.output_norm())

    def output(self):
        return self._target.output()

    def rope_freq_factors(self):
        return self._target.rope_freq_factors()


def _weights(layout: ExtentLayout) -> Weights:
    return Weights(extent_fields(layout.spec, memoryview(bytearray(layout.bytes()))))


class MtpGenerator:
    """The block's decoder and KV cache behind ModelDraft's generator calls (prefill, verify_tree,
    keep_path). Slot j of its cache is the target's position offset + j (rotary positions count
    from the cache's start: the attention sees the same distances)."""

    def __init__(self, block: MtpBlock, target: LoadedModel):
        config = target.config.mtp_config()
        self.block, self.eps = block, config.rms_norm_eps
        self.decoder = Decoder(config, target.arch.block, block, target.context_length)
        self.cache = KVCache(config, target.context_length, kv_type=KV_TYPES[target.plan.kv_type])
        self.target: TokenGenerator | None = None  # the sequence being drafted for (set by MtpDraft)
        self._source: TokenGenerator | None = None  # the sequence whose positions the cache holds
        self._offset = 0  # the target position of cache slot 0
        self._tokens: list[int] = []  # the target's token at each slot
        self._hidden: dict[int, np.ndarray] = {}  # tree node -> the block's h' after it

    def prefill(self, history: list[int], cancel: threading.Event) -> tuple[np.ndarray, int]:
        """Feeds the positions up to the last token of history (the tree's root) that the cache
        lacks, each with the target's hidden state before it; returns the root's logits."""
        root, trail = len(history) - 1, self.target.trail
        start = self._resume(history, trail)
        rows = trail.rows_for(start - 1, root)
        logits = hidden = None
        for a in range(start, root + 1, PREFILL_CHUNK):
            b = min(a + PREFILL_CHUNK, root + 1)
            logits, hidden = self.forward(history[a:b], rows[a - start:b - start], all_logits=False)
        self._tokens += history[start:]
        trail.forget_before(root)  # the next call reads from the root's own hidden state on
        self._hidden = {0: hidden[-1]}
        return logits[-1], start - self._offset

    def verify_tree(self, token_ids: list[int], parents: list[int], tree_start: int) -> np.ndarray:
        """A level of the draft's tree (the last len(token_ids) of the nodes `parents` describes,
        rooted at target position tree_start), each chained on its parent's h'."""
        nodes = range(len(parents) - len(token_ids), len(parents))
        hidden = np.stack([self._hidden[parents[node]] for node in nodes])
        logits, out = self.forward(token_ids, hidden, parents=np.asarray(parents, np.int32),
                                   tree_start=tree_start - self._offset)
        self._hidden.update(zip(nodes, out))
        return logits

    def keep_path(self, start: int, offsets: list[int]) -> None:
        """Keeps the root (position `start`), whose row came from the target's hidden state; the
        guesses' rows came from the block's own, and the accepted ones are fed again."""
        self._truncate(start + 1 - self._offset)

    def _resume(self, history: list[int], trail: HiddenTrail) -> int:
        """The first position to feed: after what the cache holds of this history (the root is
        always fed again), or, where the hidden states before that are gone (another sequence
        drafted meanwhile, a prompt longer than the trail), from the earliest one the trail holds."""
        root = len(history) - 1
        held = 0
        if self._source is self.target:
            for token, expected in zip(self._tokens, history[self._offset:root]):
                if token != expected:
                    break
                held += 1
        start = self._offset + held
        if held == 0 or trail.rows_for(start - 1, root) is None:
            start = max(trail.first + 1, 1)
            if start > root:
                raise RuntimeError(f"the target's hidden state at position {root - 1} was not kept")
            self._source, self._offset, held = self.target, start, 0
        self._truncate(held)
        return start

    def _truncate(self, length: int) -> None:
        self.cache.truncate(length)
        del self._tokens[length:]

    def forward(self, token_ids: Sequence[int], hidden: np.ndarray, all_logits: bool = True,
                parents: np.ndarray | None = None, tree_start: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """The block over tokens at the cache's next slots (or a tree's), each beside the hidden
        state before it [T, E]: (logits of every token, or of the last unless all_logits; h' [T, E])."""
        ids, w = np.asarray(token_ids, np.int64), self.block.layer(0)
        embedded = ops.rms_norm(self.block.embedding_rows(ids), w.enorm, self.eps)
        x = w.eh_proj(np.concatenate([embedded, ops.rms_norm(hidden, w.hnorm, self.eps)], axis=1))
        out = []
        logits = self.decoder.forward_batch([SequenceInput(ids, self.cache, all_logits, parents, tree_start,
                                                           embeddings=x, on_hidden=out.append)])[0]
        return logits, out[0]


class MtpDraft(ModelDraft):
    """ModelDraft over the MTP block: it drafts for the sequence whose step it is (the target
    generator whose hidden states it reads)."""

    def fresh(self) -> "MtpDraft":
        return MtpDraft(self.generator, self.max_width, self.min_reach, self.turn, self.rates)

    def propose(self, history: Sequence[int], budget: int, sampler: Sampler,
                target: TokenGenerator | None = None) -> TokenTree:
        self.generator.target = target
        return super().propose(history, budget, sampler, target)


def mtp_draft(model: ModelFile, target: LoadedModel, max_width: int) -> MtpDraft:
    """The MTP draft of a loaded target, its generators told to keep their hidden states."""
    for generator in target.generators:
        generator.trail = HiddenTrail(target.config.hidden_size, TRAIL_ROWS)
    return MtpDraft(MtpGenerator(MtpBlock(model, target), target), max_width=max_width)
