"""The expert cache: its budget, each policy's choice of victim, stats, prefetch and cancel, the
inter-layer predictors and the routing-trace format."""

import threading

import numpy as np
import pytest

from tests.support.hand_tier import HandReadTier
from tierflow.errors import BudgetError
from tierflow.offload.experts.expert_cache import ExpertCache
from tierflow.offload.experts.next_layer import (
    AffinityPredictor,
    NextLayerPredictor,
    merge_token_predictions,
    route_top_k,
)
from tierflow.offload.experts.policy import POLICIES, ScorePolicy
from tierflow.offload.experts.routing_trace import (
    SyntheticTraceSpec,
    check_trace,
    load_trace,
    make_synthetic_trace,
    save_trace,
)


def array_cache(budget_bytes: int, policy: str = "lru", expert_bytes=8, **options) -> ExpertCache:
    """A cache whose experts are numpy arrays of expert_bytes, as a RAM tier would hold."""
    size = expert_bytes if callable(expert_bytes) else (lambda key: expert_bytes)
    fetch = lambda key: np.zeros(size(key), np.uint8)  # noqa: E731
    return ExpertCache(budget_bytes, expert_bytes, fetch, policy, **options)


def resident(cache: ExpertCache, layer_idx: int, expert_ids) -> list[int]:
    return [e for e in expert_ids if (layer_idx, e) in cache]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_budget_is_never_exceeded_even_during_a_fetch(policy):
    rng = np.random.default_rng(0)
    budget, sizes = 100, {(layer, e): 8 + 4 * ((layer + e) % 4) for layer in range(4) for e in range(8)}
    live: dict = {}

    def fetch(key):
        assert sum(a.nbytes for a in live.values()) + sizes[key] <= budget
        live[key] = np.zeros(sizes[key], np.uint8)
        return live[key]

    cache = ExpertCache(budget, sizes.__getitem__, fetch, policy, discard=lambda key, payload: live.pop(key))
    for t in range(50):
        for layer_idx in range(4):
            cache.predict((layer_idx + 1) % 4, rng.choice(8, 2, replace=False), [0.5, 0.9])
            cache.get(layer_idx, rng.choice(8, 2, replace=False))
            cache.prefetch((layer_idx + 1) % 4)
            assert cache.used_bytes == sum(a.nbytes for a in live.values()) <= budget
        cache.next_token()


def test_lru_evicts_the_least_recently_used():
    cache = array_cache(16, "lru")  # two experts
    for e in (1, 2, 1, 3):
        cache.get(0, [e])
    assert resident(cache, 0, [1, 2, 3]) == [1, 3]


def test_lfu_evicts_the_least_often_used_and_remembers_counts_after_eviction():
    cache = array_cache(16, "lfu")
    for e in (1, 1, 1, 2, 2, 3):  # 3 evicts 2 (used twice, against 1's three times)
        cache.get(0, [e])
    assert resident(cache, 0, [1, 2, 3]) == [1, 3]
    cache.get(0, [2])  # 2 comes back with its count of 2 (now 3): 3, used once, goes
    assert resident(cache, 0, [1, 2, 3]) == [1, 2]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_experts_of_one_get_never_evict_each_other(policy):
    cache = array_cache(16, policy)  # two experts
    cache.get(0, [1, 2])
    cache.get(1, [5])  # evicts one of layer 0's
    cache.get(0, [1, 2])  # fetching that one again must evict (1, 5), not its partner
    assert resident(cache, 0, [1, 2]) == [1, 2]


@pytest.mark.parametrize("predicted", [None, 1, 2])
def test_score_policy_keeps_the_predicted_expert(predicted):
    cache = array_cache(16, "score")  # two experts
    cache.get(1, [1, 2])  # two experts of layer 1, with equal histories
    if predicted is not None:
        cache.predict(1, [predicted], [0.9])
    cache.get(0, [4])  # needs room: one of layer 1's goes
    kept = resident(cache, 1, [1, 2])
    assert kept == ([2] if predicted is None else [predicted])  # without a prediction: the older goes


def test_score_policy_does_not_thrash_where_lru_does():
    """Each token uses the same expert in each of 3 layers, and the cache holds 2. LRU evicts each
    expert just before its layer comes round again (no hits); the score evicts the one whose
    turn is furthest, as the offline optimum does (a hit every other step)."""
    rates = {}
    for policy in ("lru", "score"):
        cache = array_cache(16, policy)
        for t in range(30):
            for layer_idx in range(3):
                cache.get(layer_idx, [0])
            cache.next_token()
        rates[policy] = cache.stats.hit_rate
    assert rates["lru"] == 0
    assert rates["score"] > 0.45


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_one_ranking_names_the_victims_that_evicting_one_at_a_time_would(policy_name):
    rng = np.random.default_rng(0)
    policy = POLICIES[policy_name]()
    for now in range(40):  # 4 layers of 16 experts, 3 a step, skewed towards the low ids
        for layer_idx in range(4):
            policy.step(layer_idx, now)
            for expert in rng.choice(16, 3, replace=False, p=np.arange(16, 0, -1) / 136):
                policy.insert((layer_idx, int(expert)), now)
                policy.use((layer_idx, int(expert)), now)
    policy.set_predictions({(1, 0): 0.9, (2, 5): 0.4})
    protected = {(3, 0), (3, 1)}
    ranked = list(policy.victims(40, protected))
    one_at_a_time = []
    while (victim := policy.victim(40, protected)) is not None:
        one_at_a_time.append(victim)
        policy.remove(victim)
    assert ranked == one_at_a_time
    assert not protected & set(ranked)


def test_score_is_the_expected_reuse_distance():
    policy = ScorePolicy(half_life_tokens=1.0)
    policy.insert((0, 0), 0)
    policy.use((0, 0), 0)  # a decayed count of 1 at t = 0: f = 1 - 0.5 = 0.5
    assert policy.probability((0, 0), 0) == pytest.approx(0.5)
    assert policy.probability((0, 0), 1) == pytest.approx(0.25)
    assert policy.reuse_distance((0, 0), 1) == pytest.approx(1 + 1 / 0.25 - 1)  # a full round away


def test_stats_count_hits_misses_and_bytes_per_layer_and_token():
    cache = array_cache(80, "lru", expert_bytes=10)
    cache.get(0, [1, 2])  # 2 misses
    cache.get(1, [1])  # 1 miss
    cache.next_token()
    cache.get(0, [1, 3, 3])  # 1 hit, 1 miss (3 counted once)
    cache.get(1, [1])  # 1 hit
    cache.next_token()
    stats = cache.stats
    assert (stats.layer(0).hits, stats.layer(0).misses) == (1, 3)
    assert (stats.layer(1).hits, stats.layer(1).misses) == (1, 1)
    assert stats.layer(0).hit_rate == 0.25 and stats.hit_rate == pytest.approx(2 / 6)
    assert stats.fetched_bytes == 40 and stats.bytes_per_token == 20
    cache.reset_stats()
    assert cache.stats.hits == 0 and cache.stats.tokens == 0 and len(cache) == 4


def test_a_wrong_prediction_cancels_its_prefetch():
    dropped = []
    cache = array_cache(80, "score", discard=lambda key, payload: dropped.append(key))
    cache.predict(1, [4, 5], [0.9, 0.8])
    assert cache.prefetch(1) == [(1, 4), (1, 5)]
    cache.get(1, [4, 6])
    s = cache.stats
    assert (s.hits, s.misses) == (1, 1)  # 4 was prefetched and used; 6 was not predicted
    assert (s.predictions_right, s.predictions_wrong) == (1, 1)
    assert (s.prefetched, s.prefetch_used, s.prefetch_unused, s.prefetch_cancelled) == (2, 1, 1, 1)
    assert (1, 5) not in cache and dropped == [(1, 5)]
    cache.get(1, [5])
    assert cache.stats.misses == 2  # a cancelled prefetch is never a hit


class Copy:
    """A payload still being copied (to the GPU, say): the cache only needs its nbytes."""

    def __init__(self, key, nbytes: int):
        self.key, self.nbytes, self.cancelled = key, nbytes, False


def test_payloads_are_opaque_so_a_copy_in_flight_can_be_cancelled():
    copies = {}

    def fetch(key):
        copies[key] = Copy(key, 64)
        return copies[key]

    def discard(key, copy):
        copy.cancelled = True  # a real tier would abort the copy and free its buffer

    cache = ExpertCache(256, 64, fetch, "score", discard=discard)
    cache.predict(2, [0, 1])
    cache.prefetch()
    (copy,) = cache.get(2, [0])
    assert copy is copies[(2, 0)] and not copy.cancelled and copies[(2, 1)].cancelled


@pytest.mark.parametrize("began", [False, True])
def test_a_fetch_cancelled_before_it_began_is_not_counted_as_fetched(began):
    cache = array_cache(80, "score", discard=lambda key, payload: not began)  # True: nothing moved
    cache.predict(1, [4, 5], [0.9, 0.8])
    cache.prefetch(1)
    cache.get(1, [4])  # 5 was predicted wrongly: dropped
    assert cache.stats.fetched_bytes == (16 if began else 8)


def test_without_cancel_an_unused_prefetch_stays_until_evicted():
    cache = array_cache(80, "lru", cancel_unused=False)
    cache.predict(1, [5])
    cache.prefetch()
    cache.get(1, [4])
    assert (1, 5) in cache and cache.stats.prefetch_cancelled == 0 and cache.stats.predictions_wrong == 1


def test_a_prefetch_never_evicts_an_expert_the_score_ranks_higher():
    cache = array_cache(16, "score")
    for t in range(4):
        cache.get(0, [1, 2])  # both used at every token
        cache.next_token()
    cache.release()
    cache.predict(1, [3], [0.05])  # a weak prediction
    assert cache.prefetch(1) == [] and resident(cache, 0, [1, 2]) == [1, 2]


def test_a_budget_below_one_expert_is_a_clear_error():
    with pytest.raises(BudgetError, match="smaller than one expert"):
        array_cache(7, expert_bytes=8)
    cache = array_cache(20, expert_bytes=lambda key: 8 if key[1] else 32)
    with pytest.raises(BudgetError, match=r"smaller than expert \(0, 0\)"):
        cache.get(0, [0])


def test_more_experts_in_one_get_than_fit_is_a_clear_error():
    cache = array_cache(16)
    with pytest.raises(BudgetError, match="do not fit"):
        cache.get(0, [1, 2, 3])
    cache.get(0, [1])  # one at a time works
    cache.get(0, [2])
    cache.get(0, [3])


def test_a_fetch_of_the_wrong_size_is_an_error():
    cache = ExpertCache(64, 8, lambda key: np.zeros(16, np.uint8))
    with pytest.raises(ValueError, match="returned 16 bytes, expected 8"):
        cache.get(0, [0])


def test_affinity_predictor_learns_a_deterministic_chain():
    predictor = AffinityPredictor(num_layers=4, num_experts=6)
    assert len(predictor.predict(0, [0], 1)[0]) == 0  # nothing seen: no prediction
    for e in range(6):
        predictor.observe_token(np.array([[e], [(e + 1) % 6], [(e + 2) % 6], [(e + 3) % 6]]))
    for layer_idx in range(3):
        for e in range(6):
            ids, confidence = predictor.predict(layer_idx, [e], 1)
            assert ids.tolist() == [(e + 1) % 6] and confidence.tolist() == [1.0]


@pytest.mark.parametrize("normed", [False, True])
def test_early_router_matches_a_numpy_top_k(normed):
    rng = np.random.default_rng(1)
    weight, hidden, norm = rng.normal(size=(8, 16)), rng.normal(size=(5, 16)), rng.uniform(0.5, 2, 16)
    ids, probs = route_top_k(weight, hidden, 3, norm if normed else None)
    x = hidden / np.sqrt(np.mean(hidden**2, axis=-1, keepdims=True) + 1e-6) * norm if normed else hidden
    logits = x @ weight.T
    expected = np.argsort(-logits, axis=-1)[:, :3]
    softmax = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    assert (ids == expected).all()
    np.testing.assert_allclose(probs, np.take_along_axis(softmax, expected, axis=-1), rtol=1e-4)
    merged, confidence = merge_token_predictions(ids, probs)
    assert set(merged.tolist()) == set(ids.ravel().tolist()) and (np.diff(confidence) <= 0).all()


def test_synthetic_traces_are_valid_reproducible_and_round_trip(tmp_path):
    spec = SyntheticTraceSpec(num_tokens=64, num_layers=4, num_experts=8, top_k=2, seed=3)
    trace = make_synthetic_trace(spec)
    assert trace.shape == (64, 4, 2) and check_trace(trace, 8) is trace
    assert (trace == make_synthetic_trace(spec)).all()
    save_trace(tmp_path / "trace.npy", trace)
    assert (load_trace(tmp_path / "trace.npy") == trace).all()


def test_a_trace_with_a_repeated_expert_is_rejected():
    with pytest.raises(ValueError, match="appears twice"):
        check_trace(np.array([[[1, 1]]]))


def test_the_next_layer_predictor_applies_the_next_router_to_this_layers_stream():
    predictor = NextLayerPredictor(num_layers=2, num_experts=4, top_k=1, eps=1e-6)
    router = np.eye(4, 8, dtype=np.float32) * 10  # expert e reads feature e
    predictor.add_router(1, router, np.ones(8, np.float32))
    residual = np.zeros((2, 8), np.float32)
    residual[0, 2], residual[1, 3] = 1.0, 1.0
    ids, confidences = predictor.step(0, np.array([[0], [1]]), residual)
    assert sorted(ids.tolist()) == [2, 3] and (confidences > 0.9).all()
    assert predictor.step(1, np.array([[2], [3]]), residual) is None  # no layer after the last


def test_the_next_layer_predictor_predicts_the_next_moe_layer_past_dense_ones():
    predictor = NextLayerPredictor(num_layers=4, num_experts=4, top_k=1, eps=1e-6)
    predictor.add_router(1, np.eye(4, 8, dtype=np.float32) * 10, np.ones(8, np.float32))
    predictor.add_router(3, np.eye(4, 8, dtype=np.float32) * 10, np.ones(8, np.float32))
    residual = np.zeros((1, 8), np.float32)
    residual[0, 2] = 1.0
    ids, _ = predictor.step(1, np.array([[0]]), residual)  # layer 2's FFN is dense: layer 3 is next
    assert predictor.following(1) == 3 and ids.tolist() == [2]
    assert predictor.step(3, np.array([[2]]), residual) is None


def test_the_next_layer_predictor_chooses_as_a_sigmoid_router_with_a_selection_bias_does():
    predictor = NextLayerPredictor(num_layers=2, num_experts=4, top_k=1, eps=1e-6, gating="sigmoid")
    bias = np.array([0.0, 0.0, 0.0, 2.0], np.float32)  # lifts expert 3 past any sigmoid score
    predictor.add_router(1, np.eye(4, 8, dtype=np.float32) * 10, np.ones(8, np.float32), bias)
    residual = np.zeros((1, 8), np.float32)
    residual[0, 2] = 1.0  # the router alone says expert 2
    ids, confidences = predictor.step(0, np.array([[0]]), residual)
    assert ids.tolist() == [3] and confidences.tolist() == [0.5]  # expert 3's score: sigmoid(0)


def confidence_after(rounds: int, used_at_layer_1: int) -> float:
    """The early router's confidence in expert 2 at layer 1 (a weak pick: softmax score 0.31 of 4)
    after `rounds` tokens that then used expert `used_at_layer_1` there."""
    predictor = NextLayerPredictor(num_layers=2, num_experts=4, top_k=1, eps=1e-6)
    predictor.add_router(1, np.eye(4, 8, dtype=np.float32) * 0.1, np.ones(8, np.float32))
    residual = np.zeros((1, 8), np.float32)
    residual[0, 2] = 1.0
    for _ in range(rounds):
        predictor.step(0, np.array([[0]]), residual)
        predictor.step(1, np.array([[used_at_layer_1]]), residual)
    ids, confidences = predictor.step(0, np.array([[0]]), residual)
    return float(confidences[ids.tolist().index(2)])


def test_an_early_pick_is_first_as_confident_as_the_routers_score():
    assert confidence_after(0, used_at_layer_1=2) == pytest.approx(0.31, abs=0.01)


def test_an_early_pick_that_proves_right_grows_confident_beyond_its_score():
    assert confidence_after(50, used_at_layer_1=2) > 0.95


def test_an_early_pick_that_proves_wrong_loses_its_confidence():
    assert confidence_after(50, used_at_layer_1=1) < 0.05


def test_the_next_layer_predictor_adds_experts_that_affinity_makes_likely():
    predictor = NextLayerPredictor(num_layers=2, num_experts=4, top_k=1, eps=1e-6)
    predictor.add_router(1, np.eye(4, 8, dtype=np.float32) * 10, np.ones(8, np.float32))
    residual = np.zeros((1, 8), np.float32)
    residual[0, 0] = 1.0  # the early router says expert 0
    for _ in range(20):  # yet tokens on expert 1 at layer 0 have always gone on to expert 3
        predictor.step(0, np.array([[1]]), residual)
        predictor.step(1, np.array([[3]]), residual)
    ids, _ = predictor.step(0, np.array([[1]]), residual)
    assert sorted(ids.tolist()) == [0, 3]


def test_a_tier_hands_over_the_experts_at_hand_before_a_read_in_flight_arrives():
    tier, residual = HandReadTier(), np.zeros((1, 8), np.float32)
    assert list(tier.step(0, np.array([[0, 1]]), residual)) == [[(0, "expert 0"), (1, "expert 1")]]
    tier.held.add(2)
    groups = tier.step(0, np.array([[0, 1, 2]]), residual)
    # expert 2's read completes late: in 5 s, if the tier waits for it
    late = threading.Timer(5.0, lambda: tier.reads[2].set_result("expert 2"))
    late.start()
    first, in_flight = next(groups), not tier.reads[2].done()
    late.cancel()
    assert [e for e, _ in first] == [0, 1] and in_flight
    tier.reads[2].set_result("expert 2")
    assert next(groups) == [(2, "expert 2")]
