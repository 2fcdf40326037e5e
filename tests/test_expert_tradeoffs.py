"""The expert options that trade exactness for bytes, both off by default; a choice left out gives
its weight to the token's other experts, and a token's first choice is never left out:
- expert_skip (AdapMoE's skip): an expert that would be read from disk, which every token that chose
  it gives a small share of its router weight, is skipped;
- expert_union_cap: a pass verifying a token tree computes at most that many distinct experts per
  layer, dropping the lesser ones, those to be read from disk first.
Their quality against the exact model: benchmarks/moe_decode.py --expert-skip, --union-cap."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.support.budgets import ram_beside_weights
from tests.support.cli import run_tierflow
from tests.support.hand_tier import HandReadTier
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.errors import InvalidArgumentError
from tierflow.offload.experts.routing_trace import Routing, keep_routing, kept_routing
from tierflow.offload.experts.tier import ExpertTier
from tierflow.offload.plan.expert_plan import TIERS, skipped_share
from tierflow.runtime.compute.cpu import CPU_KERNELS
from tierflow.runtime.compute.interfaces import LayerPass, Weights
from tierflow.runtime.loading.loader import CacheOptions, plan_file
from tierflow.runtime.models.config import ModelConfig, RopeScaling
from tierflow.runtime.models.layers import routed_experts

PROMPT = "The history of the printing press begins in"
CONTEXT = 128
TOKENS = 16


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    spec = ModelSpec(num_layers=4, hidden_size=128, ffn_size=256, num_experts=8, experts_used=2,
                     weight_type="Q4_0", embedding_type="Q4_0", seed=7)
    return write_model(tmp_path_factory.mktemp("skip") / "moe.gguf", spec)


@pytest.fixture(scope="module")
def one_layer_of_experts(moe_path):
    """cpu_memory that leaves the expert cache room for one layer's experts (8), and that room."""
    with Engine.load(moe_path, threads=2, context_length=CONTEXT) as engine:
        packed = engine.weights.packed
        base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
        one = packed.experts[0][0].nbytes
    return base + ram_beside_weights(moe_path, CONTEXT) + 8 * one


class ListedExperts:
    """Experts that scale their rows by (id + 1), dropping the choices given."""

    def __init__(self, dropped: np.ndarray | None):
        self.drop, self.handed = dropped, []

    def dropped(self, chosen, weights, verifying=False):
        return self.drop

    def groups(self, chosen, residual, dropped=None):
        ids = np.unique(chosen if dropped is None else chosen[~dropped]).tolist()
        self.handed += ids
        yield [(e, Weights({"id": e})) for e in ids]


def scaled_rows(kernels, experts, xs):
    return [np.asarray(x) * (expert.id + 1) for expert, x in zip(experts, xs)]


def route(weights, chosen):
    return lambda logits, k: (torch.tensor(weights), torch.tensor(chosen))


def test_a_dropped_choice_gives_its_weight_to_the_tokens_other_experts_and_is_never_computed():
    h = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    experts = ListedExperts(np.array([[False, True], [False, False]]))
    weights = Weights({"router": lambda x: np.zeros((len(x), 4), np.float32)}, experts=experts)
    p = LayerPass(SimpleNamespace(experts_used=2), 0, CPU_KERNELS, None, None, ())
    out = routed_experts(p, weights, h, h, route([[0.6, 0.2], [0.7, 0.3]], [[0, 1], [2, 0]]), scaled_rows)
    # token 0 keeps expert 0 with the whole 0.8; token 1 is as routed
    assert np.allclose(out, [h[0] * 1 * 0.8, h[1] * (3 * 0.7 + 1 * 0.3)])
    assert sorted(experts.handed) == [0, 2]


def test_without_drops_the_experts_combine_as_routed():
    h = np.array([[1.0, 2.0]], np.float32)
    weights = Weights({"router": lambda x: np.zeros((1, 4), np.float32)}, experts=ListedExperts(None))
    p = LayerPass(SimpleNamespace(experts_used=2), 0, CPU_KERNELS, None, None, ())
    out = routed_experts(p, weights, h, h, route([[0.6, 0.4]], [[3, 1]]), scaled_rows)
    assert np.allclose(out, h * (4 * 0.6 + 2 * 0.4))


CONFIG = ModelConfig(arch="qwen3moe", name="skip", num_layers=2, hidden_size=8, ffn_size=8, num_heads=1,
                     num_kv_heads=1, head_dim=8, vocab_size=8, context_length=8, rms_norm_eps=1e-6,
                     rope_theta=1e4, rope_dim=8, rope_scaling=RopeScaling(), tied_embeddings=True,
                     num_experts=8, experts_used=3, expert_ffn_size=8)


def cached_tier(held: set[int], skip_below: float) -> HandReadTier:
    """A tier whose cache holds the experts `held` (of layer 0); the others would be read from disk."""
    tier = HandReadTier()
    tier.skip_below = skip_below
    for expert in held:
        list(tier.step(0, np.array([[expert]]), np.zeros((1, 8), np.float32)))
    return tier


def dropped(tier: ExpertTier, chosen, weights, verifying: bool = False) -> list[list[bool]]:
    mask = tier.dropped(0, np.array(chosen), torch.tensor(weights), verifying)
    return np.zeros(np.shape(chosen), bool).tolist() if mask is None else mask.tolist()


def test_the_tier_skips_a_missed_expert_under_the_share():
    tier = cached_tier(held={0}, skip_below=0.2)
    assert dropped(tier, [[0, 1, 2]], [[0.5, 0.35, 0.15]]) == [[False, False, True]]
    assert tier.skipped == 1


def test_the_tier_never_skips_a_cached_expert_or_a_tokens_first_choice():
    tier = cached_tier(held={2}, skip_below=0.5)
    assert dropped(tier, [[1, 3, 2]], [[0.45, 0.4, 0.15]]) == [[False, True, False]]


def test_the_tier_keeps_a_missed_expert_that_any_token_ranks_high():
    tier = cached_tier(held=set(), skip_below=0.2)
    chosen, weights = [[0, 1, 2], [3, 2, 4]], [[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]
    assert dropped(tier, chosen, weights) == [[False, False, False], [False, False, True]]


def test_the_tier_skips_nothing_by_default():
    assert cached_tier(held=set(), skip_below=0.0).dropped(0, np.array([[0, 1, 2]]),
                                                          torch.tensor([[0.9, 0.05, 0.05]])) is None


def test_a_verify_pass_computes_at_most_the_cap_of_distinct_experts_those_on_disk_going_first():
    tier = cached_tier(held={3, 4}, skip_below=0.0)
    tier.union_cap = 4
    chosen = [[0, 3, 5], [1, 4, 6], [2, 3, 4]]  # 7 distinct; the firsts 0, 1 and 2 stay
    weights = [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]
    # 7 - 4 = 3 go: the two read from disk (6 with 0.1 in all, 5 with 0.2), then 4 (0.4) before 3 (0.7)
    assert dropped(tier, chosen, weights, verifying=True) == [[False, False, True], [False, True, True],
                                                               [False, False, True]]
    assert tier.capped == 3


def test_the_cap_never_drops_a_tokens_first_choice():
    tier = cached_tier(held=set(), skip_below=0.0)
    tier.union_cap = 3
    chosen, weights = [[0, 5, 6], [1, 5, 6], [2, 5, 6]], [[0.4, 0.3, 0.3]] * 3
    assert dropped(tier, chosen, weights, verifying=True) == [[False, True, True]] * 3


def test_the_cap_leaves_a_pass_that_verifies_no_tree_alone():
    tier = cached_tier(held=set(), skip_below=0.0)
    tier.union_cap = 3
    assert tier.dropped(0, np.array([[0, 1, 2], [3, 4, 5]]), torch.ones(2, 3), verifying=False) is None


def test_expert_skip_reads_fewer_experts_than_the_exact_model(moe_path, one_layer_of_experts):
    fetched = {}
    for skip in (0.0, 0.45):
        with Engine.load(moe_path, threads=2, context_length=CONTEXT, cpu_memory=one_layer_of_experts,
                         expert_skip=skip) as engine:
            engine.generate(PROMPT, max_tokens=TOKENS, temperature=0)
            fetched[skip] = engine.expert_stats.fetched_bytes, engine.weights.experts.skipped
    assert fetched[0.0][1] == 0 and fetched[0.45][1] > 0
    assert fetched[0.45][0] < fetched[0.0][0]


def test_expert_skip_leaves_experts_held_in_ram_exact(moe_path):
    tokens = []
    for skip in (0.0, 0.45):
        with Engine.load(moe_path, threads=2, context_length=CONTEXT, expert_skip=skip) as engine:
            tokens.append(engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens)
    assert tokens[0] == tokens[1]


def test_a_union_cap_leaves_experts_out_of_verify_passes_only(moe_path, one_layer_of_experts):
    with Engine.load(moe_path, threads=2, context_length=CONTEXT, cpu_memory=one_layer_of_experts,
                     expert_union_cap=2) as engine:
        prompt, experts = engine.tokenize(PROMPT), engine.weights.experts
        with engine.exclusive(prompt_ids=prompt) as generator:
            generator.prefill(prompt, threading.Event(), reuse_prefix=False)
            for token in prompt[:4]:
                generator.decode_step(token)
            assert experts.capped == 0  # the prompt's pass and decode steps verify no tree
            generator.verify_tree(prompt[:6], parents=[-1, 0, 1, 2, 3, 4])
            assert experts.capped > 0


@pytest.mark.parametrize("cap", [-1, 1.5, True])
def test_a_union_cap_that_is_no_count_is_refused(moe_path, cap):
    with pytest.raises(InvalidArgumentError, match="expert_union_cap is a count"):
        Engine.load(moe_path, threads=2, context_length=CONTEXT, expert_union_cap=cap)


def test_a_union_cap_under_one_tokens_experts_is_refused_naming_both(moe_path):
    with pytest.raises(InvalidArgumentError, match=r"expert_union_cap 1 is fewer experts than one token .* "
                                                   r"uses \(2\)"):
        Engine.load(moe_path, threads=2, context_length=CONTEXT, expert_union_cap=1)


def test_a_union_cap_on_a_dense_model_is_refused_naming_why(model_path):
    with pytest.raises(InvalidArgumentError, match="expert_union_cap leaves experts out.*not a mixture"):
        Engine.load(model_path, threads=2, context_length=CONTEXT, expert_union_cap=4)


@pytest.mark.parametrize("skip", [-0.1, 1.0, "0.2", True])
def test_an_expert_skip_outside_0_to_1_is_refused(moe_path, skip):
    with pytest.raises(InvalidArgumentError, match="expert_skip is a share"):
        Engine.load(moe_path, threads=2, context_length=CONTEXT, expert_skip=skip)


def test_expert_skip_on_a_dense_model_is_refused_naming_why(model_path):
    with pytest.raises(InvalidArgumentError, match="expert_skip leaves experts out.*not a mixture-of-experts "
                                                   "model: it has none"):
        Engine.load(model_path, threads=2, context_length=CONTEXT, expert_skip=0.1)


def test_the_plan_predicts_the_reads_expert_skip_saves_and_a_faster_decode(moe_path, one_layer_of_experts):
    plans = [plan_file(moe_path, threads=2, cpu_memory=one_layer_of_experts, cache=CacheOptions(CONTEXT),
                       expert_skip=skip)
             for skip in (0.0, 0.6)]
    exact, skipping = (plan.experts for plan in plans)
    assert exact.skipped == 0 and skipping.skipped > 0  # uniform routing: the second choice of each miss
    assert skipping.bytes_per_token["disk"] < exact.bytes_per_token["disk"]
    assert plans[1].predicted_decode_tps > plans[0].predicted_decode_tps


def test_recorded_routing_holds_each_choices_share_of_its_router_weight(moe_path):
    with Engine.load(moe_path, threads=2, context_length=CONTEXT) as engine:
        with engine.record_routing() as recorder:
            engine.generate(PROMPT, max_tokens=4, temperature=0)
    shares = recorder.routing().shares
    assert shares.shape == recorder.trace().shape
    assert np.allclose(shares.sum(axis=-1), 1.0, atol=1e-5) and (shares[..., 0] >= shares[..., 1]).all()


def test_the_plan_takes_the_skipped_share_from_the_recorded_router_shares():
    trace = np.zeros((10, 2, 3), np.int32) + [0, 1, 2]
    shares = np.zeros((10, 2, 3), np.float32) + [0.8, 0.15, 0.05]
    shares[6:] = [0.4, 0.3, 0.3]  # the last 4 tokens give no choice under 0.2
    on_disk = np.full((2, 8), TIERS.index("disk"), np.int8)
    assert skipped_share(CONFIG, Routing(trace, shares=shares), on_disk, 0.2) == pytest.approx(12 / 30)
    on_disk[:, 2] = TIERS.index("cpu")  # the third choice's expert is in RAM: only the second is read
    assert skipped_share(CONFIG, Routing(trace, shares=shares), on_disk, 0.2) == pytest.approx(6 / 30)


def test_without_recorded_shares_the_plan_gives_every_choice_an_equal_share():
    on_disk = np.full((2, 8), TIERS.index("disk"), np.int8)
    assert skipped_share(CONFIG, None, on_disk, 0.3) == 0  # 1/3 each: none under 0.3
    assert skipped_share(CONFIG, None, on_disk, 0.4) == pytest.approx(2 / 3)  # all but the first


def test_kept_routing_keeps_the_router_shares(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"a model")
    shares = np.zeros((4, 1, 3), np.float32) + [0.7, 0.2, 0.1]
    keep_routing(path, Routing(np.zeros((4, 1, 3), np.int32) + [0, 1, 2], shares=shares))
    assert np.allclose(kept_routing(path).shares, shares, atol=1e-3)


def test_tierflow_plan_says_what_expert_skip_saves(moe_path, one_layer_of_experts):
    done = run_tierflow("plan", str(moe_path), "--threads", "2", "--cpu-memory", str(one_layer_of_experts),
                        "--ctx", str(CONTEXT), "--expert-skip", "0.6")
    assert done.returncode == 0, done.stderr
    assert "experts skipped" in done.stdout and "not exact" in done.stdout
