"""The expert cache: the experts of a MoE model that a byte budget allows, on the fast tier.

The unit is one expert, keyed by (layer_idx, expert_idx). The cache decides what stays (its policy,
offload/experts/policy.py) and counts what happened (CacheStats); it never moves bytes itself:
`fetch(key)` supplied by the caller returns the expert's payload, anything with an `nbytes` (a
numpy array read from the pack, a tensor uploaded to the GPU, a handle on a copy in flight), so
the same code serves the RAM tier (experts streamed from disk) and the GPU tier (experts copied
from RAM). `discard(key, payload)` is told of every expert dropped, so the caller can return its
buffer or abort a copy still in flight; it returns True when it cancelled a fetch before any byte
moved, which the stats then do not count as fetched.

Budget: the bytes of the resident payloads never exceed budget_bytes, not even during a fetch:
room is made (victims evicted) before fetch is called, using the expert's size known in advance
(`expert_bytes`). The experts of one get() are pinned from its start until the next get() or
release() (as LayerStreamer's layers are): fetching one of them never evicts another. After
release() the caller keeps no reference to the payloads: an evicted one's memory is what
discard() frees for the next fetch.

A MoE layer step, with inter-layer prediction of the following MoE layer (offload/experts/next_layer.py):

    cache.predict(following, predicted_ids, confidences)      # early router / affinity, no bytes yet
    payloads = cache.get(layer_idx, expert_ids)               # demand: hits, or fetched now
    cache.prefetch(following)                                 # fetch the predicted, overlapping compute
    ... compute layer_idx's experts ...
    cache.release()
    cache.next_token()                                        # after the last layer of a token

get() resolves the predictions made for its layer: each is right (used) or wrong (not used), and
with cancel_unused an expert fetched only for a wrong prediction is dropped at once (its fetch
cancelled) rather than left to be counted a hit later by luck.
"""

from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tierflow.errors import BudgetError
from tierflow.offload.experts.policy import CachePolicy, ExpertKey, make_policy
from tierflow.units import format_size


class Payload(Protocol):
    nbytes: int


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    fetched_bytes: int = 0  # demand and prefetch fetches of this layer's experts (not those cancelled
    # before they began)

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


@dataclass
class CacheStats:
    """What the cache did. Hits and misses count demand uses (get), one per distinct expert."""

    layers: dict[int, LayerStats] = field(default_factory=dict)
    tokens: int = 0
    evictions: int = 0  # by the policy, to make room (cancelled prefetches not included)
    predictions_right: int = 0  # predicted for a layer step and used by it
    predictions_wrong: int = 0  # predicted and not used
    prefetched: int = 0  # fetches started for a prediction
    prefetch_used: int = 0  # ... whose expert was then used while resident (a hit)
    prefetch_unused: int = 0  # ... dropped before any use: evicted or cancelled
    prefetch_cancelled: int = 0  # ... of which cancelled when their prediction proved wrong

    def layer(self, layer_idx: int) -> LayerStats:
        return self.layers.setdefault(layer_idx, LayerStats())

    @property
    def hits(self) -> int:
        return sum(s.hits for s in self.layers.values())

    @property
    def misses(self) -> int:
        return sum(s.misses for s in self.layers.values())

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0

    @property
    def fetched_bytes(self) -> int:
        return sum(s.fetched_bytes for s in self.layers.values())

    @property
    def bytes_per_token(self) -> float:
        return self.fetched_bytes / self.tokens if self.tokens else 0.0

    @property
    def prediction_precision(self) -> float:
        made = self.predictions_right + self.predictions_wrong
        return self.predictions_right / made if made else 0.0


class _Ranking:
    """A policy's victims, worst first (CachePolicy.victims), read one at a time: the next one can
    be looked at before it is taken, so that a victim one prefetch refused is the next one's to
    weigh. One ranking serves a layer step's misses, or a prefetch's predictions."""

    def __init__(self, victims: Iterator[ExpertKey]):
        self._victims, self._next = victims, None

    def peek(self) -> ExpertKey | None:
        if self._next is None:
            self._next = next(self._victims, None)
        return self._next

    def take(self) -> ExpertKey | None:
        victim, self._next = self.peek(), None
        return victim


@dataclass
class _Entry:
    payload: Payload
    nbytes: int
    prefetched: bool  # fetched for a prediction and not used since


class ExpertCache:
    def __init__(self, budget_bytes: int, expert_bytes: int | Callable[[ExpertKey], int],
                 fetch: Callable[[ExpertKey], Payload], policy: CachePolicy | str = "score",
                 discard: Callable[[ExpertKey, Payload], bool | None] | None = None,
                 cancel_unused: bool = True):
        """budget_bytes: the most the resident payloads may hold. expert_bytes: every expert's
        size, or a function giving each one's (known before it is fetched). fetch(key): the
        expert's payload, anything with an nbytes of that size. policy: a CachePolicy or its
        name ("lru", "lfu", "score"). discard(key, payload): told of each expert dropped; True if
        it stopped the fetch before any byte moved.
        cancel_unused: drop a prefetched expert as soon as its prediction proves wrong."""
        self.budget_bytes = budget_bytes
        self._expert_bytes = expert_bytes if callable(expert_bytes) else (lambda key: expert_bytes)
        if not callable(expert_bytes):
            self._check_fits(expert_bytes, None)
        self.fetch, self.discard, self.cancel_unused = fetch, discard, cancel_unused
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.stats = CacheStats()
        self.tokens = 0  # the policy's clock; stats.tokens restarts with the stats, this does not
        self.used_bytes = 0
        self._entries: dict[ExpertKey, _Entry] = {}
        self._pinned: set[ExpertKey] = set()
        self._predicted: dict[ExpertKey, float] = {}  # pending predictions: key -> confidence

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, layer_idx: int, expert_ids: Sequence[int],
            weights: Sequence[float] | None = None) -> list[Payload]:
        """The payloads of one layer step's experts (distinct, in order), valid until the next
        get() or release(); `weights` (router probabilities) feed the score policy."""
        self.release()
        ids = [int(e) for e in expert_ids]
        if weights is not None and len(weights) != len(ids):
            raise ValueError(f"{len(ids)} experts but {len(weights)} weights")
        step = dict(zip(ids, weights if weights is not None else [1.0] * len(ids)))  # distinct, in order
        self._resolve_predictions(layer_idx, step)
        self._pinned = {(layer_idx, e) for e in step}  # none of them is evicted to make room for another
        now, stats, payloads = self.tokens, self.stats.layer(layer_idx), []
        self.policy.step(layer_idx, now)
        ranked = None  # the policy's ranking for the step's misses, made at the first
        for e in step:
            key = (layer_idx, e)
            entry = self._entries.get(key)
            if entry is None:
                stats.misses += 1
                ranked = ranked or _Ranking(self.policy.victims(now, self._pinned))
                entry = self._admit(key, ranked, prefetch=False)
            else:
                stats.hits += 1
                if entry.prefetched:
                    entry.prefetched = False
                    self.stats.prefetch_used += 1
            payloads.append(entry.payload)
        for e, weight in step.items():  # after the misses: a use moves ranks, and one ranking served them
            self.policy.use((layer_idx, e), now, weight)
        return payloads

    def release(self) -> None:
        """The experts last returned are done with: they may be evicted again."""
        self._pinned.clear()

    def predict(self, layer_idx: int, expert_ids: Sequence[int],
                confidences: Sequence[float] | None = None) -> None:
        """Records that layer `layer_idx`'s coming step is expected to use `expert_ids`
        (confidence in [0, 1] each, 1 if not given), replacing earlier predictions for it."""
        for key in [k for k in self._predicted if k[0] == layer_idx]:
            del self._predicted[key]
        for e, c in zip(expert_ids, confidences if confidences is not None else [1.0] * len(expert_ids)):
            key = (layer_idx, int(e))
            self._predicted[key] = max(float(c), self._predicted.get(key, 0.0))
        self.policy.set_predictions(self._predicted)

    def prefetch(self, layer_idx: int | None = None, min_confidence: float = 0.0) -> list[ExpertKey]:
        """Fetches the predicted experts (of one layer, or all) that are not resident and were
        predicted with at least min_confidence, most confident first, as far as the policy admits
        them; returns the keys fetched."""
        wanted = sorted((k for k, confidence in self._predicted.items() if k not in self._entries
                         and (layer_idx is None or k[0] == layer_idx) and confidence >= min_confidence),
                        key=lambda k: -self._predicted[k])
        protected = self._pinned | self._predicted.keys()  # never evict one prediction for another
        ranked = _Ranking(self.policy.victims(self.tokens, protected))  # ranks nothing until read
        return [key for key in wanted if self._admit(key, ranked, prefetch=True) is not None]

    def forget(self, unusable: Callable[[Payload], bool]) -> None:
        """Drops every expert whose payload `unusable` says never arrived (a read that failed), so
        that none is kept as if it had the expert; the next use fetches it again."""
        for key in [key for key, entry in self._entries.items() if unusable(entry.payload)]:
            self._drop(key)

    def next_token(self, count: int = 1) -> None:
        """The current step's last layer is done: the clock moves on by the tokens it computed
        (1 in decode; the chunk's length in prefill, or the accepted tokens of a verify pass)."""
        self.tokens += count
        self.stats.tokens += count

    def reset_stats(self) -> None:
        """Starts counting afresh (after a warm-up), keeping the contents and the clock."""
        self.stats = CacheStats()

    def _resolve_predictions(self, layer_idx: int, used: Container[int]) -> None:
        resolved = [k for k in self._predicted if k[0] == layer_idx]
        for key in resolved:
            del self._predicted[key]
            if key[1] in used:
                self.stats.predictions_right += 1
                continue
            self.stats.predictions_wrong += 1
            entry = self._entries.get(key)
            if self.cancel_unused and entry is not None and entry.prefetched:
                self.stats.prefetch_cancelled += 1
                self._drop(key)
        if resolved:
            self.policy.set_predictions(self._predicted)

    def _admit(self, key: ExpertKey, ranked: _Ranking, prefetch: bool) -> _Entry | None:
        """Makes room for `key`, evicting from `ranked` (the policy's victims, worst first), and
        fetches it. A prefetch evicts only experts the policy ranks below it; if it cannot have
        the room it needs, it evicts nothing and returns None (a victim it refused stays first in
        the ranking)."""
        nbytes = self._expert_bytes(key)
        self._check_fits(nbytes, key)
        now, victims, freed = self.tokens, [], 0
        while self.used_bytes - freed + nbytes > self.budget_bytes:
            victim = ranked.peek()
            if prefetch and (victim is None or not self.policy.admits(key, victim, now)):
                return None
            ranked.take()
            if victim is None:
                raise BudgetError(f"the expert cache ({format_size(self.budget_bytes)}) cannot take expert "
                                  f"{key}: the {len(self._pinned)} experts of one get() do not fit; "
                                  f"get fewer at once")
            victims.append(victim)
            freed += self._entries[victim].nbytes
        for victim in victims:
            self.stats.evictions += 1
            self._drop(victim)
        payload = self.fetch(key)
        if payload.nbytes != nbytes:
            raise ValueError(f"expert {key}: fetch returned {payload.nbytes} bytes, expected {nbytes}")
        entry = self._entries[key] = _Entry(payload, nbytes, prefetch)
        self.used_bytes += nbytes
        self.stats.layer(key[0]).fetched_bytes += nbytes
        self.stats.prefetched += prefetch
        self.policy.insert(key, now)
        return entry

    def _drop(self, key: ExpertKey) -> None:
        entry = self._entries.pop(key)
        self.used_bytes -= entry.nbytes
        self.policy.remove(key)
        self.stats.prefetch_unused += entry.prefetched
        if self.discard is not None and self.discard(key, entry.payload) is True:  # never fetched after all
            self.stats.layer(key[0]).fetched_bytes -= entry.nbytes

    def _check_fits(self, nbytes: int, key: ExpertKey | None) -> None:
        if nbytes > self.budget_bytes:
            which = f"expert {key}" if key is not None else "one expert"
            raise BudgetError(f"the expert cache budget ({format_size(self.budget_bytes)}) is smaller than "
                              f"{which} ({format_size(nbytes)}): give it room for at least one expert")

