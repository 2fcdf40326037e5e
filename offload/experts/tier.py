"""What the two expert tiers share: one MoE layer step through an expert cache, with prediction.

A tier keeps one ExpertCache (cache.py) of the experts its fast memory holds and a
NextLayerPredictor (prediction.py). A layer step, the same in both:

1. predicts the next MoE layer's experts (its router applied early to this layer's residual
   stream, plus cross-layer affinity) and records the prediction in the cache;
2. asks the tier which of this step's experts come through the cache, in what order, and which
   are served another way (`_route`);
3. gets those from the cache (hits at once, misses fetched), then starts fetching the next
   layer's predicted experts, so that fetches overlap this layer's compute: those predicted
   with the confidence the PrefetchGate asks for now (prefetch_gate.py), which counts what
   tokens cost under each: the bytes fetched, and those of the reads the compute waited for;
4. hands the experts to the decoder in groups it computes together: the cached ones at hand,
   then those whose reads arrived while the last group computed, then the others;
5. releases them, and after the last layer it serves moves the cache's clock on by the step's tokens.

Two options trade exactness for fewer bytes (off by default: the output is then no longer the
model's own). Before step 2 the decoder asks which choices to leave out (`dropped`), and gives
their weight to the tokens' other experts; a token's first choice is never left out.
- `skip_below` (AdapMoE's skip): an expert that would be read from disk is skipped when every
  token that chose it gives it less than that share of its router weight.
- `union_cap`: a pass that verifies a token tree computes at most that many distinct experts per
  layer (its tokens together fire several times a decode token's: a tree's batch would cost far
  more than one token's); past it go first those to be read from disk, then those at hand, each by
  the least router weight over the pass's tokens.

ExpertStore (store.py) streams experts from disk into a cache in RAM; HybridExperts (hybrid.py)
keeps a cache of them on the GPU over their home in RAM, or over a cache in RAM of their home on
disk (three tiers), and schedules each between the devices.
"""

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from tierflow.offload.experts.expert_cache import CacheStats, ExpertCache
from tierflow.offload.experts.next_layer import NextLayerPredictor
from tierflow.offload.experts.prefetch_gate import PrefetchGate
from tierflow.offload.experts.routing_trace import router_shares
from tierflow.runtime.compute.interfaces import Activations, Weights
from tierflow.runtime.models.config import ModelConfig

# Decode tokens after a pass of many (a prompt) that the prefetch gate does not count: the cache is
# still settling from what the prompt left in it, and the first threshold tried would pay for that
# (on the MoEfied Qwen2.5-Coder-1.5B, the first tokens after a 64-token prompt cost 1.6x the later ones).
SETTLING_TOKENS = 8


class ExpertTier:
    def __init__(self, config: ModelConfig, cache: ExpertCache, layers: Sequence[int] | None = None):
        """layers: the MoE layers whose experts come through this tier (default: all); predictions
        are made only for them (the caller adds their routers to the predictor)."""
        self.cache = cache
        self.last_layer = max(config.moe_layers if layers is None else layers)  # ends a step's token
        self.predictor = NextLayerPredictor(config.num_layers, config.num_experts, config.experts_used,
                                            config.rms_norm_eps, config.expert_gating)
        self.prefetch = True  # predict and fetch ahead (off: demand fetches only, for comparison)
        self.gate = PrefetchGate()  # how sure a prediction must be to be fetched ahead
        self.waited_bytes = 0  # of the fetches the compute waited for, so far
        self._token_started: int | None = None  # the cost counted when the decode token in progress began
        self._settling = 0  # decode tokens still to come before the gate counts them
        self.skip_below = 0.0  # a missed expert's router share under which it is skipped (0: never)
        self.skipped = 0  # expert reads skipped so far
        self.union_cap = 0  # the distinct experts a layer of a verify pass computes at most (0: all)
        self.capped = 0  # experts the cap left out so far

    @property
    def stats(self) -> CacheStats:
        return self.cache.stats

    def layer_experts(self, layer_idx: int) -> "LayerExperts":
        return LayerExperts(self, layer_idx)

    def dropped(self, layer_idx: int, chosen: np.ndarray, weights: Activations, verifying: bool = False
                ) -> np.ndarray | None:
        """The choices (bool [T, k]) to leave out (None: none): of experts skipped under
        `skip_below`, and in a pass that verifies a token tree, of those over `union_cap`."""
        cap = self.union_cap if verifying and len(chosen) > 1 else 0
        if not self.skip_below and not cap:
            return None
        shares = router_shares(weights)
        firsts = set(chosen[:, 0].tolist())  # a token's first choice is always computed
        dropped = np.zeros(chosen.shape, bool)
        if self.skip_below:
            dropped |= self._skipped(layer_idx, chosen, shares, firsts)
        if cap:
            dropped |= self._over_cap(layer_idx, chosen, shares, firsts, dropped, cap)
        return dropped if dropped.any() else None

    def _skipped(self, layer_idx: int, chosen: np.ndarray, shares: np.ndarray, firsts: set[int]
                 ) -> np.ndarray:
        """The choices of the experts skip_below skips: each would be read from disk, and every
        token that chose it gives it less than skip_below of its router weight."""
        small = shares < self.skip_below
        skipped = [e for e in np.unique(chosen[small]).tolist()
                   if e not in firsts and small[chosen == e].all() and self._on_disk(layer_idx, e)]
        self.skipped += len(skipped)
        return np.isin(chosen, skipped)

    def _over_cap(self, layer_idx: int, chosen: np.ndarray, shares: np.ndarray, firsts: set[int],
                  dropped: np.ndarray, cap: int) -> np.ndarray:
        """The choices of the experts past `cap` distinct ones in this pass: those read from disk
        go before those at hand, each group by the least router weight summed over the pass's
        tokens; no token's first choice goes."""
        kept = np.unique(chosen[~dropped]).tolist()
        if len(kept) <= cap:
            return np.zeros(chosen.shape, bool)
        candidates = sorted((e for e in kept if e not in firsts),
                            key=lambda e: (not self._on_disk(layer_idx, e), float(shares[chosen == e].sum())))
        over = candidates[:len(kept) - cap]
        self.capped += len(over)
        return np.isin(chosen, over)

    def step(self, layer_idx: int, chosen: np.ndarray, residual: Activations,
             dropped: np.ndarray | None = None) -> Iterator[list[tuple[int, Weights]]]:
        """The experts of one layer step (chosen int64 [T, k], less those `dropped`), grouped as
        runtime.compute.interfaces.Experts hands
        them: the cached ones at hand, then each set of those that arrived while the last computed,
        then the others. The prediction learns from the whole of chosen: the router's choice."""
        ids, counts = np.unique(chosen if dropped is None else chosen[~dropped], return_counts=True)
        residual = np.asarray(torch.as_tensor(residual).cpu())
        ahead = self.prefetch and self.gate.reads_ahead  # the gate holds for a whole token
        prediction = self.predictor.step(layer_idx, chosen, residual) if ahead else None
        following = self.predictor.following(layer_idx)
        if prediction is not None:
            self._predict(following, *prediction)
        cached, others = self._route(layer_idx, dict(zip(ids.tolist(), counts.tolist())))
        payloads = self.cache.get(layer_idx, cached) if cached else []
        if prediction is not None:
            self._prefetch(following, self.gate.threshold)
        try:
            waiting = list(zip(cached, payloads))
            while waiting:
                arrived = [item for item in waiting if self._arrived(item[1])]
                if not arrived:
                    arrived = waiting[:1]
                    self.waited_bytes += arrived[0][1].nbytes
                waiting = [item for item in waiting if item not in arrived]
                yield [(expert_id, self._weights(payload)) for expert_id, payload in arrived]
            rest = list(others)
            if rest:
                yield rest
        finally:
            self._release()
            if layer_idx == self.last_layer:
                self._next_token(len(chosen))
                self._count_token(len(chosen))

    def _predict(self, layer_idx: int, expert_ids: np.ndarray, confidences: np.ndarray) -> None:
        """Records the prediction of layer `layer_idx`'s experts with the cache(s) it concerns."""
        self.cache.predict(layer_idx, expert_ids, confidences)

    def _prefetch(self, layer_idx: int, min_confidence: float) -> None:
        """Starts fetching layer `layer_idx`'s predicted experts into the tier that gains most."""
        self.cache.prefetch(layer_idx, min_confidence)

    def _release(self) -> None:
        self.cache.release()

    def _next_token(self, tokens: int) -> None:
        self.cache.next_token(tokens)

    def _count_token(self, tokens: int) -> None:
        """After a step's last layer: a decode token's cost (since the end of the one before) goes to
        the gate; a pass of many tokens (a prompt, a verify pass) starts the count over, after
        SETTLING_TOKENS."""
        counted, started = self._fetched_bytes() + self.waited_bytes, self._token_started
        if tokens > 1:
            self._token_started, self._settling = None, SETTLING_TOKENS
            return
        if started is not None and self.prefetch and counted >= started and not self._settling:
            self.gate.update(counted - started)  # less than started: the stats were reset in between
        self._token_started, self._settling = counted, max(self._settling - 1, 0)

    def _fetched_bytes(self) -> int:
        """The bytes fetched so far into the cache that predictions fetch ahead into."""
        return self.cache.stats.fetched_bytes

    def _route(self, layer_idx: int, expert_tokens: dict[int, int]
               ) -> tuple[list[int], Iterator[tuple[int, Weights]]]:
        """(the experts that come through the cache, in the order to hand them over; the others,
        with their weights), given each active expert's token count."""
        raise NotImplementedError

    def _weights(self, payload) -> Weights:
        """The weights of an expert the cache holds (its payload), once they are there."""
        raise NotImplementedError

    def _on_disk(self, layer_idx: int, expert_id: int) -> bool:
        """Whether using the expert now would read it from disk (no cache holds it or reads it yet)."""
        raise NotImplementedError

    def _arrived(self, payload) -> bool:
        """Whether _weights(payload) has nothing left to wait for (a read in flight has)."""
        return True


class LayerExperts:
    """One MoE layer's view of an expert tier (runtime.compute.interfaces.Experts)."""

    def __init__(self, tier: ExpertTier, layer_idx: int):
        self.tier, self.layer_idx = tier, layer_idx

    def dropped(self, chosen: np.ndarray, weights: Activations, verifying: bool = False) -> np.ndarray | None:
        return self.tier.dropped(self.layer_idx, chosen, weights, verifying)

    def groups(self, chosen: np.ndarray, residual: Activations, dropped: np.ndarray | None = None
               ) -> Iterator[list[tuple[int, Weights]]]:
        return self.tier.step(self.layer_idx, chosen, residual, dropped)
