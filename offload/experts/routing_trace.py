"""Routing traces: which experts each token used in each MoE layer, recorded or synthetic.

The format is one integer array, `trace[t, l, j]` = the expert id in slot j of token t's top-k
at MoE layer l: shape [T tokens, L layers, K top_k], distinct ids within a (t, l) row, saved
with np.save (`.npy`). `Engine.record_routing()` records one with a RoutingRecorder, which stacks
the router's top-k ids per layer as the decoder computes, and beside it what the engine's early
router (prediction.py: layer l's router applied to layer l-1's residual stream) would have
predicted for each token at each layer: a `Routing`. It is kept beside the model's pack
(keep_routing: the newest KEPT_TOKENS tokens of every recording), where the planner finds it
(kept_routing) for its hit rates and for the share of reads from disk the prediction starts a
layer early; the expert cache benchmark (benchmarks/moe.py) replays any trace array.

Synthetic traces stand in where no recorded one fits. Their generator states its assumptions as
parameters (SyntheticTraceSpec): each layer has its own popularity ranking of the experts, Zipf
with exponent `zipf_s`; a slot repeats the previous token's expert in that slot with probability
`reuse` (temporal locality); otherwise, with probability `affinity`, it follows a fixed partner
of the previous layer's expert in the same slot (cross-layer affinity, as ExFlow observes);
otherwise it is drawn from the popularity. Every `phase_tokens` the rankings are reshuffled, a
change of topic that a policy must adapt to. Real routing differs: fit the parameters to a
recorded trace before trusting conclusions drawn from these.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tierflow.offload.experts.next_layer import EarlyRouter, early_router, route_top_k
from tierflow.offload.pack.pack_cache import routing_path
from tierflow.runtime.compute.interfaces import Activations, Weights
from tierflow.runtime.models.config import ModelConfig

KEPT_TOKENS = 16384  # of routing kept per model: ~3 MB for 48 layers of top-8, with the predictions
NOT_PREDICTED = -1  # in Routing.predicted: no prediction was made (a pass's first MoE layer)


@dataclass(frozen=True)
class Routing:
    """A model's recorded routing: `trace` [T, L, K] (the format above); `predicted` [T, L, K],
    the experts the early router picked for the same token and layer one layer before (NOT_PREDICTED
    where it made none); `shares` [T, L, K], each choice's part of its token's router weight at that
    layer. Either is None where only the trace is known."""

    trace: np.ndarray
    predicted: np.ndarray | None = None
    shares: np.ndarray | None = None

    def __post_init__(self):
        check_trace(self.trace)
        for name in ("predicted", "shares"):
            part = getattr(self, name)
            if part is not None and part.shape != self.trace.shape:
                raise ValueError(f"{name} {part.shape} do not match the trace {self.trace.shape}")


@dataclass(frozen=True)
class SyntheticTraceSpec:
    num_tokens: int = 2048
    num_layers: int = 32
    num_experts: int = 8
    top_k: int = 2
    zipf_s: float = 1.0  # popularity of a layer's r-th most used expert ~ 1 / r ** zipf_s (0: uniform)
    reuse: float = 0.3  # chance a slot repeats the previous token's expert (temporal locality)
    affinity: float = 0.3  # chance a slot follows the previous layer's expert's partner
    phase_tokens: int = 512  # tokens between reshuffles of the popularity rankings; 0: never
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if min(self.num_tokens, self.num_layers) < 1 or self.zipf_s < 0 or self.phase_tokens < 0:
            raise ValueError(f"invalid synthetic trace spec: {self}")
        if not (0 <= self.reuse and 0 <= self.affinity and self.reuse + self.affinity <= 1):
            raise ValueError(f"reuse and affinity must be >= 0 with a sum <= 1, got {self.reuse} and "
                             f"{self.affinity}")


def make_synthetic_trace(spec: SyntheticTraceSpec) -> np.ndarray:
    """A trace [T, L, K] of expert ids (int32) with the skew and locality `spec` states."""
    rng = np.random.default_rng(spec.seed)
    T, L, K, E = spec.num_tokens, spec.num_layers, spec.top_k, spec.num_experts
    popularity = 1.0 / np.arange(1, E + 1) ** spec.zipf_s
    popularity /= popularity.sum()
    partner = np.stack([rng.permutation(E) for _ in range(L)])  # partner[l, e]: layer l+1's partner of e
    kind = rng.random((T, L, K))  # per slot: < reuse repeats, < reuse + affinity follows, else a draw
    ranks = rng.choice(E, size=(T, L, K), p=popularity)  # the draws, as popularity ranks
    trace = np.empty((T, L, K), dtype=np.int32)
    for t in range(T):
        if t % (spec.phase_tokens or T) == 0:  # a change of topic: new rankings
            ranking = np.stack([rng.permutation(E) for _ in range(L)])  # ranking[l, r]: r-th most used
        for layer in range(L):
            row: list[int] = []
            for j in range(K):
                if t > 0 and kind[t, layer, j] < spec.reuse:
                    expert = int(trace[t - 1, layer, j])
                elif layer > 0 and kind[t, layer, j] < spec.reuse + spec.affinity:
                    expert = int(partner[layer - 1, trace[t, layer - 1, j]])
                else:
                    expert = int(ranking[layer, ranks[t, layer, j]])
                while expert in row:  # taken by an earlier slot: draw again from the popularity
                    expert = int(ranking[layer, rng.choice(E, p=popularity)])
                row.append(expert)
            trace[t, layer] = row
    return trace


def check_trace(trace: np.ndarray, num_experts: int | None = None) -> np.ndarray:
    """The trace as an int array [T, L, K], or a ValueError naming what is wrong with it."""
    trace = np.asarray(trace)
    if trace.ndim != 3 or 0 in trace.shape or not np.issubdtype(trace.dtype, np.integer):
        raise ValueError(f"a routing trace is an integer array [tokens, layers, top_k], "
                         f"got {trace.dtype} {trace.shape}")
    if trace.min() < 0 or (num_experts is not None and trace.max() >= num_experts):
        raise ValueError(f"expert ids must lie in 0..{num_experts or 'E'}-1, found "
                         f"{trace.min()}..{trace.max()}")
    ordered = np.sort(trace, axis=-1)
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ValueError("an expert appears twice in one token's top-k at one layer")
    return trace


def save_trace(path: Path, trace: np.ndarray) -> None:
    np.save(Path(path), check_trace(trace))


def load_trace(path: Path) -> np.ndarray:
    return check_trace(np.load(Path(path), allow_pickle=False))


def keep_routing(source: Path, routing: Routing) -> None:
    """Adds a recording of model file `source`'s routing to the one kept beside its pack, keeping
    the newest KEPT_TOKENS tokens; one of another shape (a changed file) is replaced. A cache folder
    that cannot be written only loses the recording."""
    try:
        path = routing_path(source)
        trace, predicted, shares = routing.trace, _predictions(routing), routing.shares
        kept = _readable_routing(path)
        if kept is not None and kept.trace.shape[1:] == trace.shape[1:]:  # both checked already
            trace = np.concatenate([kept.trace, trace])
            predicted = np.concatenate([_predictions(kept), predicted])
            shares = None if shares is None or kept.shares is None else np.concatenate([kept.shares, shares])
        partial = path.with_name(path.name + ".partial.npz")
        try:
            np.savez(partial, trace=trace[-KEPT_TOKENS:].astype(np.int32),
                     predicted=predicted[-KEPT_TOKENS:].astype(np.int32),
                     **({} if shares is None else {"shares": shares[-KEPT_TOKENS:].astype(np.float16)}))
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    except OSError:
        pass


def kept_routing(source: Path) -> Routing | None:
    """The routing recorded with model file `source` kept beside its pack, if there is a readable one."""
    try:
        return _readable_routing(routing_path(source))
    except OSError:
        return None


def _predictions(routing: Routing) -> np.ndarray:
    return routing.predicted if routing.predicted is not None else np.full_like(routing.trace, NOT_PREDICTED)


def _readable_routing(path: Path) -> Routing | None:
    try:
        with np.load(path, allow_pickle=False) as saved:
            shares = saved["shares"].astype(np.float32) if "shares" in saved.files else None
            return Routing(saved["trace"], saved["predicted"], shares)
    except (OSError, ValueError, EOFError, KeyError, AttributeError):
        return None


class RoutingRecorder:
    """Collects a decoder's routing (runtime.decoder.decoder.Decoder.on_routing), pass by pass: every token
    the model computes, in the order computed (prompt chunks, then each step's tokens; a
    speculative pass's rejected guesses included), with the early router's prediction of each MoE
    layer's experts from the stream entering the layer before, as the expert tiers predict it, and
    each choice's share of its token's router weight."""

    def __init__(self, config: ModelConfig):
        self.moe_layers = list(config.moe_layers)  # the layers that route (not a model's leading dense ones)
        self._before = dict(zip(self.moe_layers[1:], self.moe_layers))  # MoE layer -> the one before
        self._top_k, self._eps, self._gating = config.experts_used, config.rms_norm_eps, config.expert_gating
        self._routers: dict[int, EarlyRouter] = {}  # from each layer's weights, the first time it routes
        self._passes: list[tuple[np.ndarray, ...]] = []  # ([T, L, K] chosen, predicted, shares) each
        self._layers: dict[int, tuple[np.ndarray, ...]] = {}  # this pass: layer -> the three, [T, K]
        self._stream: tuple[int, np.ndarray] | None = None  # (layer, its residual stream [T, H])

    def __call__(self, layer_idx: int, chosen: np.ndarray, router_weights: Activations, residual: Activations,
                 weights: Weights) -> None:
        chosen = np.array(chosen, dtype=np.int32)
        self._layers[layer_idx] = chosen, self._predicted(layer_idx, weights, len(chosen)), \
            router_shares(router_weights)
        # a copy: the layer adds its output to the stream in place
        self._stream = layer_idx, np.array(torch.as_tensor(residual).cpu().numpy(), dtype=np.float32)
        if len(self._layers) == len(self.moe_layers):
            self._passes.append(tuple(np.stack([self._layers[i][part] for i in self.moe_layers], axis=1)
                                      for part in (0, 1, 2)))
            self._layers, self._stream = {}, None

    def _predicted(self, layer_idx: int, weights: Weights, tokens: int) -> np.ndarray:
        """[T, K]: layer_idx's router applied to the stream that entered the MoE layer before it,
        as the expert tiers predict (NOT_PREDICTED for a pass's first MoE layer)."""
        stream = self._stream
        if stream is None or stream[0] != self._before.get(layer_idx) or len(stream[1]) != tokens:
            return np.full((tokens, self._top_k), NOT_PREDICTED, np.int32)
        if layer_idx not in self._routers:
            self._routers[layer_idx] = early_router(weights)
        router, ffn_norm, bias = self._routers[layer_idx]
        ids, _ = route_top_k(router, stream[1], self._top_k, ffn_norm, self._eps, self._gating, bias)
        return ids.astype(np.int32)

    @property
    def recorded(self) -> bool:
        return bool(self._passes)

    def trace(self) -> np.ndarray:
        """The routing so far, int32 [tokens, layers, top_k] (a pass cut short is left out)."""
        return self.routing().trace

    def routing(self) -> Routing:
        """The routing so far with its predictions (a pass cut short is left out)."""
        if not self._passes:
            raise ValueError("no routing was recorded: nothing ran through the model while recording")
        return Routing(*(np.concatenate([recorded[part] for recorded in self._passes]) for part in (0, 1, 2)))


def router_shares(weights: Activations) -> np.ndarray:
    """Each choice's part of its token's router weight: weights [T, k] -> float32 [T, k]."""
    shares = torch.as_tensor(weights).detach().float().cpu().numpy().copy()
    return shares / np.maximum(shares.sum(axis=-1, keepdims=True), np.finfo(np.float32).tiny)
