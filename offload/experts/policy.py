"""Expert-cache policies: which resident expert to evict, decided on host objects only.

The cache (offload/experts/expert_cache.py) owns the bytes; a policy only ranks keys, (layer_idx,
expert_idx) pairs, and names a victim when the cache needs room. A key's rank within its group
changes only when the key is touched, so each group is a heap with lazy deletion and a victim
costs O(groups + log n), however many experts are resident (a large MoE has thousands). A layer
step's misses share one ranking (`victims`): the cache tells the policy the step began (`step`),
evicts for all its misses, then records its uses, since only uses, predictions and time move ranks.

- LRU: the least recently touched expert goes first; the baseline.
- LFU: the expert used least often goes first (ties: least recent). Counts outlive eviction
  (the key space, layers x experts, is small), so a hot expert that was pushed out keeps its rank
  when it returns: the stronger LFU.
- Score, after HybriMoE's score-based caching: one number per expert blends recency, frequency
  and the prefetch prediction, and the expert with the worst score goes first. The score is the
  expected number of tokens until the expert is used again:

      D(x) = s(x) / L + 1 / p(x) - 1                     evict the largest D
      p(x) = 1 - (1 - h(x)) * (1 - prediction_weight * c(x))
      h(x) = max(f(x), r if x was used at its layer's latest step else 0), at most 1
      f(x) = (1 - decay) * sum over past uses u of x: w_u * decay ** (t - t_u)

  p(x) estimates the chance that x is used at its layer's next step, from three kinds of
  evidence. Frequency: f is a use count decayed per token (t counts tokens; decay =
  0.5 ** (1 / half_life_tokens)), scaled so an expert used at every token has f = 1; w_u is 1,
  or the router's probability when the caller passes one. Recency: r is the measured chance that
  an expert a layer step used is used again at that layer's next step (counted online over
  about the last thousand layer steps), so consecutive tokens sharing experts counts for exactly
  as much as it does in this model. Prediction: c(x) in [0, 1] is the confidence of a pending
  prediction that x is used in a coming step (0 when none), combined as a noisy OR, so a
  prediction only ever adds. Then s(x), the layer steps until x's layer comes round again: decode
  visits the layers in order, so an expert of the next layer is needed within one step and one
  of the layer just finished not for L (the MoE layers seen) steps; 1 / p - 1 is the expected
  number of further rounds to wait if each round uses x with probability p. A global LRU ignores
  s and thrashes (hit rate near 0) as soon as a token's experts outnumber the cache, evicting
  each expert just before its layer's turn; frequency alone (LFU) ignores both s and recency.

  Parameters: half_life_tokens (default 32), prediction_weight (default 1: trust a calibrated
  confidence, as AffinityPredictor's and the router's probabilities are), layer_cycle (default
  True; False drops s, an ablation). The half-life was chosen on synthetic traces (benchmarks/
  moe.py) of two shapes and two skews with topic changes every 128 to 256 tokens, several
  seeds: 8 to 32 tokens do about equally well (within 2 points), 2 lose up to 5 points and 128
  up to 3. Recorded traces should confirm it (benchmarks/moe.py --trace ... --half-life ...).

Within a group, a layer's keys that its latest step used or those it did not, s and the
recency term are shared and D falls as f rises; f changes at a use but its order does not
change with time, so the heap stores ln(count) + g * t_u with g = -ln(decay): comparing those
is comparing the decayed counts at any common later time. The victim is the worst of the
groups' lowest (the next one, the worst of those left, its group offering its next key);
predicted experts (a few per predicted layer) are ranked apart, by a scan.
"""

import heapq
import itertools
import math
from collections.abc import Collection, Container, Iterator, Mapping

ExpertKey = tuple[int, int]  # (layer_idx, expert_idx)


class CachePolicy:
    """Ranks resident keys; `victim` returns the one to evict.

    Keys fall into groups (one for the baselines, two per layer for the score policy), each a
    heap on the key's `_priority`; the baselines evict the lowest of all."""

    name = ""

    def __init__(self) -> None:
        self._heaps: dict[object, list[tuple[object, int, ExpertKey]]] = {}  # group -> heap
        self._stamp: dict[ExpertKey, int] = {}  # resident key -> sequence number of its live heap entry
        self._seq = self._num_entries = 0  # entries in all heaps, live and stale

    def insert(self, key: ExpertKey, now: int) -> None:
        """`key` became resident (a demand miss or a prefetch), before any use is recorded."""
        self._push(key, now)

    def step(self, layer_idx: int, now: int) -> None:
        """Layer `layer_idx`'s step at token `now` begins: its evictions and uses follow."""

    def use(self, key: ExpertKey, now: int, weight: float = 1.0) -> None:
        """`key` was used by its layer's step at token `now` (with its router weight, if known)."""
        self._record_use(key, now, weight)
        self._push(key, now)

    def remove(self, key: ExpertKey) -> None:
        self._stamp.pop(key, None)

    def set_predictions(self, predictions: Mapping[ExpertKey, float]) -> None:
        """Pending predictions (key -> confidence); the baselines ignore them."""

    def admits(self, key: ExpertKey, victim: ExpertKey, now: int) -> bool:
        """Whether a prefetch of `key` may evict `victim`."""
        return True

    def victim(self, now: int, protected: Collection[ExpertKey] = ()) -> ExpertKey | None:
        """The resident key to evict, outside `protected`; None when there is none."""
        lowest = [entry for heap in self._heaps.values() if (entry := self._lowest(heap, protected))]
        return min(lowest)[2] if lowest else None

    def victims(self, now: int, protected: Collection[ExpertKey] = ()) -> Iterator[ExpertKey]:
        """The resident keys outside `protected`, worst first, as far as the caller reads: what
        victim() names again and again as each is evicted. One ranking serves the misses of a layer
        step, whose uses are recorded after them (ranks move only with uses, predictions and time)."""
        taken: set[ExpertKey] = set()
        while (key := self.victim(now, {*protected, *taken})) is not None:
            taken.add(key)
            yield key

    def _lowest(self, heap: list, protected: Container[ExpertKey]) -> tuple[object, int, ExpertKey] | None:
        """The heap's lowest live entry outside `protected`, left in the heap."""
        while heap and self._stamp.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)  # stale: touched again since, or evicted
            self._num_entries -= 1
        if not heap or heap[0][2] not in protected:
            return heap[0] if heap else None
        skipped, found = [], None
        while heap:
            entry = heapq.heappop(heap)
            if self._stamp.get(entry[2]) != entry[1]:
                self._num_entries -= 1
                continue
            skipped.append(entry)
            if entry[2] not in protected:
                found = entry
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def _push(self, key: ExpertKey, now: int) -> None:
        self._seq += 1
        self._stamp[key] = self._seq
        heap = self._heaps.setdefault(self._group(key), [])
        heapq.heappush(heap, (self._priority(key, now), self._seq, key))
        self._num_entries += 1
        if self._num_entries > 4 * len(self._stamp) + 256:  # mostly stale: rebuild, amortised O(1) a push
            for heap in self._heaps.values():
                heap[:] = [e for e in heap if self._stamp.get(e[2]) == e[1]]
                heapq.heapify(heap)
            self._num_entries = sum(map(len, self._heaps.values()))

    def _group(self, key: ExpertKey) -> object:
        return 0

    def _record_use(self, key: ExpertKey, now: int, weight: float) -> None:
        pass

    def _priority(self, key: ExpertKey, now: int) -> object:
        raise NotImplementedError


class LRUPolicy(CachePolicy):
    name = "lru"

    def _priority(self, key: ExpertKey, now: int) -> object:
        return self._seq


class LFUPolicy(CachePolicy):
    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._count: dict[ExpertKey, int] = {}

    def _record_use(self, key: ExpertKey, now: int, weight: float) -> None:
        self._count[key] = self._count.get(key, 0) + 1

    def _priority(self, key: ExpertKey, now: int) -> object:
        return self._count.get(key, 0)  # ties go to the heap's sequence number: least recent first


class ScorePolicy(CachePolicy):
    """The score D(x) of the module docstring; see there for the formula and parameters."""

    name = "score"
    REUSE_DECAY = 0.999  # per layer step: the reuse rate follows about the last thousand layer steps

    def __init__(self, half_life_tokens: float = 32.0, prediction_weight: float = 1.0,
                 layer_cycle: bool = True) -> None:
        super().__init__()
        if half_life_tokens <= 0 or not 0 <= prediction_weight <= 1:
            raise ValueError(f"half_life_tokens must be > 0 and prediction_weight in [0, 1], got "
                             f"{half_life_tokens} and {prediction_weight}")
        self.half_life_tokens, self.prediction_weight = half_life_tokens, prediction_weight
        self.layer_cycle = layer_cycle
        self._g = math.log(2) / half_life_tokens  # -ln(decay), decay = 0.5 ** (1 / half_life)
        self._rate = -math.expm1(-self._g)  # 1 - decay: a decayed count times this is a rate per token
        self._key: dict[ExpertKey, float] = {}  # ln(count) + g * t at the last use; kept after eviction
        self._predicted: Mapping[ExpertKey, float] = {}
        self._layer_idx, self._num_layers = 0, 1  # the layer last used; layers seen so far
        # layer -> (the token of its latest step, the keys its previous step used, those its latest used)
        self._steps: dict[int, tuple[int, set[ExpertKey], set[ExpertKey]]] = {}
        self._reused = self._offered = 0.0  # decayed: experts a step used, and those its next step used again

    @property
    def reuse_rate(self) -> float:
        """r: the chance that an expert used at a layer's step is used again at its next step."""
        return self._reused / self._offered if self._offered else 0.0

    def probability(self, key: ExpertKey, now: int) -> float:
        """p(x): the estimated chance that `key` is used at its layer's next step."""
        log_count = self._key.get(key)
        history = self._rate * math.exp(log_count - self._g * now) if log_count is not None else 0.0
        if self._latest(key):
            history = max(history, self.reuse_rate)
        bonus = self._predicted.get(key)
        if bonus is None:
            return min(history, 1.0)
        return 1 - (1 - min(history, 1.0)) * (1 - self.prediction_weight * bonus)

    def reuse_distance(self, key: ExpertKey, now: int) -> float:
        """D(x): the expected number of tokens until `key` is next used (the score; higher goes)."""
        return self._steps_to(key[0]) + 1 / max(self.probability(key, now), 1e-9) - 1

    def step(self, layer_idx: int, now: int) -> None:
        self._layer_idx, self._num_layers = layer_idx, max(self._num_layers, layer_idx + 1)
        token, previous, latest = self._steps.get(layer_idx, (-1, set(), set()))
        if token != now:  # this layer's first step at this token
            self._steps[layer_idx] = (now, latest, set())
            self._reused *= self.REUSE_DECAY
            self._offered = self._offered * self.REUSE_DECAY + len(latest)
            for old in latest & self._stamp.keys():
                self._push(old, now)  # into the layer's heap of keys its latest step did not use

    def use(self, key: ExpertKey, now: int, weight: float = 1.0) -> None:
        self.step(key[0], now)
        _, previous, latest = self._steps[key[0]]
        self._reused += key in previous and key not in latest
        latest.add(key)
        super().use(key, now, weight)

    def set_predictions(self, predictions: Mapping[ExpertKey, float]) -> None:
        self._predicted = predictions

    def admits(self, key: ExpertKey, victim: ExpertKey, now: int) -> bool:
        return self.reuse_distance(key, now) < self.reuse_distance(victim, now)

    def victim(self, now: int, protected: Collection[ExpertKey] = ()) -> ExpertKey | None:
        return next(self.victims(now, protected), None)

    def victims(self, now: int, protected: Collection[ExpertKey] = ()) -> Iterator[ExpertKey]:
        # Each group's lowest key ranked by its distance, merged: a victim's group offers its next
        # one. A prediction changes a key's rank within its heap, so predicted keys are ranked apart.
        skip = {*protected, *self._predicted}
        reuse, decayed, order = self.reuse_rate, self._g * now, itertools.count()
        ranked: list[tuple[float, int, object, ExpertKey]] = []  # (-distance, order, group or None, key)

        def offer(group: tuple[int, bool]) -> None:
            entry = self._lowest(self._heaps[group], skip)
            if entry is None:
                return
            # reuse_distance from the heap entry (its priority is the live log-count) and the group
            history = self._rate * math.exp(entry[0] - decayed) if entry[0] > -math.inf else 0.0
            p = min(max(history, reuse) if group[1] else history, 1.0)
            distance = self._steps_to(group[0]) + 1 / max(p, 1e-9) - 1
            heapq.heappush(ranked, (-distance, next(order), group, entry[2]))

        for group in list(self._heaps):
            offer(group)
        for key in self._predicted:
            if key in self._stamp and key not in protected:
                heapq.heappush(ranked, (-self.reuse_distance(key, now), next(order), None, key))
        while ranked:
            _, _, group, key = heapq.heappop(ranked)
            yield key
            skip.add(key)
            if group is not None:
                offer(group)

    def _steps_to(self, layer_idx: int) -> float:
        """s(x) / L for a key of layer `layer_idx`: the share of a token until its layer comes round."""
        if not self.layer_cycle:
            return 0.0
        return ((layer_idx - self._layer_idx - 1) % self._num_layers + 1) / self._num_layers

    def _latest(self, key: ExpertKey) -> bool:
        step = self._steps.get(key[0])
        return step is not None and key in step[2]

    def _group(self, key: ExpertKey) -> object:
        # Per layer, apart the keys its latest step used (p >= r): in each group the order is h's.
        return key[0], self._latest(key)

    def _record_use(self, key: ExpertKey, now: int, weight: float) -> None:
        total = (math.exp(self._key[key] - self._g * now) if key in self._key else 0.0) + weight
        self._key[key] = math.log(total) + self._g * now if total > 0 else -math.inf

    def _priority(self, key: ExpertKey, now: int) -> object:
        return self._key.get(key, -math.inf)


POLICIES = {policy.name: policy for policy in (LRUPolicy, LFUPolicy, ScorePolicy)}


def make_policy(name: str, **options: float | bool) -> CachePolicy:
    """A policy by name ("lru", "lfu", "score"); options go to its constructor."""
    if name not in POLICIES:
        raise ValueError(f"unknown expert-cache policy {name!r}: choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**options)
