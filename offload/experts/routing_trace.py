"""Routing traces: which experts each token used in each MoE layer, recorded or synthetic.

The format is one integer array, `trace[t, l, j]` = the expert id in slot j of token t's top-k
at MoE layer l: shape [T tokens, L layers, K top_k], distinct ids within a (t, l) row, saved
with np.save (`.npy`). `Engine.record_routing()` records one with a RoutingRecorder, which stacks
the router's top-k ids per layer as the decoder computes, and keeps it beside the model's pack
(keep_trace: the newest KEPT_TOKENS tokens of every recording), where the planner finds it for its
hit rates (kept_trace); the expert cache benchmark (benchmarks/moe.py) replays any such array.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierflow.offload.pack.cache import routing_path

KEPT_TOKENS = 16384  # of routing kept per model: ~1.5 MB for 48 layers of top-8


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


def keep_trace(source: Path, trace: np.ndarray) -> None:
    """Adds a recording of model file `source`'s routing to the one kept beside its pack, keeping
    the newest KEPT_TOKENS tokens; one of another shape (a changed file) is replaced. A cache folder
    that cannot be written only loses the trace."""
    trace = check_trace(trace)
    try:
        path = routing_path(source)
        kept = _readable_trace(path)
        if kept is not None and kept.shape[1:] == trace.shape[1:]:
            trace = np.concatenate([kept, trace])
        partial = path.with_name(path.name + ".partial.npy")
        try:
            np.save(partial, trace[-KEPT_TOKENS:].astype(np.int32))
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    except OSError:
        pass


def kept_trace(source: Path) -> np.ndarray | None:
    """The routing trace kept beside model file `source`'s pack, if there is a readable one."""
    try:
        return _readable_trace(routing_path(source))
    except OSError:
        return None


def _readable_trace(path: Path) -> np.ndarray | None:
    try:
        return load_trace(path)
    except (OSError, ValueError, EOFError):
        return None


class RoutingRecorder:
    """Collects a decoder's routing (runtime.model.Decoder.on_routing), pass by pass, as a trace:
    every token the model computes, in the order computed (prompt chunks, then each step's tokens;
    a speculative pass's rejected guesses included)."""

    def __init__(self, moe_layers: Sequence[int]):
        self.moe_layers = moe_layers  # the layers that route (a model's leading dense ones do not)
        self._passes: list[np.ndarray] = []  # [T, L, K] each
        self._layers: dict[int, np.ndarray] = {}  # the pass in progress: layer -> [T, K]

    def __call__(self, layer_idx: int, chosen: np.ndarray) -> None:
        self._layers[layer_idx] = np.array(chosen, dtype=np.int32)
        if len(self._layers) == len(self.moe_layers):
            self._passes.append(np.stack([self._layers[i] for i in self.moe_layers], axis=1))
            self._layers = {}

    @property
    def recorded(self) -> bool:
        return bool(self._passes)

    def trace(self) -> np.ndarray:
        """The routing so far, int32 [tokens, layers, top_k] (a pass cut short is left out)."""
        if not self._passes:
            raise ValueError("no routing was recorded: nothing ran through the model while recording")
        return np.concatenate(self._passes)
