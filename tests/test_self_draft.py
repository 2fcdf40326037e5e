"""The self-draft (the target's own first layers and head) and `draft="auto"`: the target's own
greedy output, the draft's layers held and its KV cache within the budgets, bad depths refused;
what a load predicts of its draft, and how auto's trials count."""

import pytest

from tests.support.test_cache import TEST_PROFILE
from tierflow import Engine
from tierflow.errors import BudgetError, InvalidArgumentError
from tierflow.kv_types import kv_type
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan.budgets import layer_kv_bytes
from tierflow.offload.plan.planner import make_plan
from tierflow.offload.plan.profile import HardwareProfile
from tierflow.runtime.loading import loader
from tierflow.runtime.loading.overhead import shape_key
from tierflow.speculative.choice import NO_DRAFT, TRIAL_PASSES, Candidate

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
CONTEXT = 256
STREAMED = "70MiB"  # at CONTEXT positions the bundled model streams 18 of its 30 layers in this


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate(PROMPT, max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def opened(model_path):
    with open_model_file(model_path) as model:
        yield model, pack_sizes(model)


def plan(opened, cpu_memory: int, draft_layers: int = 0):
    model, sizes = opened
    return make_plan(model, sizes, HardwareProfile(threads=2, **TEST_PROFILE), gpu_budget=0,
                     cpu_budget=cpu_memory, context_length=CONTEXT, kv=kv_type(None),
                     draft_layers=draft_layers)


def test_self_draft_greedy_output_is_the_targets_own(model_path, plain):
    with Engine.load(model_path, threads=2, context_length=CONTEXT, draft="self:24",
                     draft_tokens=4) as engine:
        result = engine.generate(PROMPT, max_tokens=24, temperature=0)
    assert result.tokens == plain.tokens and result.stats.drafted_tokens > 0


def test_self_draft_greedy_output_is_the_targets_own_when_the_target_streams(model_path, plain):
    with Engine.load(model_path, threads=2, context_length=CONTEXT, draft="self:6", cpu_memory=STREAMED,
                     draft_tokens=4) as engine:
        assert engine.weights.streamed_layers
        result = engine.generate(PROMPT, max_tokens=24, temperature=0)
    assert result.tokens == plain.tokens and result.stats.drafted_tokens > 0


def test_self_draft_on_the_gpu_tier_keeps_its_cache_within_gpu_memory(model_path, plain):
    """With the CPU standing in for a GPU: the draft's layers there, its KV cache of them beside."""
    with Engine.load(model_path, threads=2, context_length=CONTEXT, draft="self:12", gpu_memory="40MiB",
                     gpu_device="cpu", draft_tokens=4) as engine:
        assert set(range(12)) <= set(engine.plan.gpu_layers)
        result = engine.generate(PROMPT, max_tokens=24, temperature=0)
        assert engine.weights.bytes_by_tier()["gpu"] <= 40 << 20
    assert result.tokens == plain.tokens and result.stats.drafted_tokens > 0


def test_self_draft_layers_are_planned_held_first(opened):
    assert set(range(8)) & set(plan(opened, 64 << 20).streamed_layers)  # spread between streamed ones
    assert not set(range(8)) & set(plan(opened, 64 << 20, draft_layers=8).streamed_layers)


def test_self_draft_kv_cache_is_counted_in_the_budget(opened):
    model, _ = opened
    draft_cache = sum(layer_kv_bytes(model.config, i, CONTEXT, kv_type(None)) for i in range(8))
    alone, drafting = plan(opened, 1 << 30), plan(opened, 1 << 30, draft_layers=8)
    assert drafting.kv_bytes == alone.kv_bytes + draft_cache
    assert drafting.used_bytes["cpu"] == alone.used_bytes["cpu"] + draft_cache


@pytest.mark.parametrize("depth", ["0", "30", "31", "x"])
def test_self_draft_of_a_depth_not_below_the_layer_count_is_refused_naming_both(model_path, depth):
    with pytest.raises(InvalidArgumentError, match=r"self:.*(from 1 to 29|the target has 30)"):
        Engine.load(model_path, draft=f"self:{depth}", context_length=CONTEXT)


def test_self_draft_whose_layers_and_cache_cannot_fit_is_refused_naming_them(model_path):
    with pytest.raises(BudgetError, match=r"self-draft's 29 layers .* KV cache of them, [\d.]+ MiB at 256"):
        Engine.load(model_path, draft="self:29", cpu_memory=STREAMED, context_length=CONTEXT)


@pytest.mark.slow
def test_seeded_sampling_with_a_self_draft_repeats_itself(model_path):
    with Engine.load(model_path, threads=2, context_length=CONTEXT, draft="self") as engine:
        first = engine.generate(PROMPT, max_tokens=16, temperature=0.8, seed=5)
        again = engine.generate(PROMPT, max_tokens=16, temperature=0.8, seed=5)
    assert first.tokens == again.tokens and first.stats.drafted_tokens > 0


@pytest.fixture(scope="module")
def auto_with_file(model_path):
    """auto:FILE with the bundled file drafting for its own streamed copy: it agrees fully and
    costs a resident pass, far below the disk's sweep. The predictions come from the test profile
    with its own per-layer overhead, not the one this machine measures for the shape (1.4e-4 s on
    an AVX2-only machine, where the self-draft is then predicted at 82% of the file's speed)."""
    key = shape_key(open_model_file(model_path).config)

    def pinned(threads: int, **_) -> HardwareProfile:
        return HardwareProfile(threads=threads, **TEST_PROFILE,
                               overhead_by_shape={key: TEST_PROFILE["layer_overhead_s"]})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "load_profile", pinned)
        with Engine.load(model_path, threads=2, context_length=CONTEXT, draft=model_path) as engine:
            draft_bytes = engine.draft.bytes_by_tier()["cpu"]
        with Engine.load(model_path, threads=2, context_length=CONTEXT, draft=f"auto:{model_path}",
                         cpu_memory=draft_bytes + (70 << 20)) as engine:
            assert engine.weights.streamed_layers
            yield engine


@pytest.mark.slow
def test_auto_with_a_draft_file_picks_it_first_for_a_streamed_target(auto_with_file, model_path):
    assert auto_with_file.notices[-1].startswith(f"draft: {model_path.name} first")


def test_auto_holds_no_layers_for_a_self_draft_predicted_far_slower(auto_with_file):
    assert auto_with_file.plan.draft_layers == 0 and "self:" not in auto_with_file.notices[-1]


@pytest.mark.slow
def test_auto_measures_a_close_call_and_keeps_the_target_output(model_path, plain):
    with Engine.load(model_path, threads=2, context_length=CONTEXT, draft="auto",
                     cpu_memory=STREAMED) as engine:
        assert NO_DRAFT in engine.notices[-1]  # plain steps are predicted within CLOSE_CALL of a draft
        results = [engine.generate(PROMPT, max_tokens=24, temperature=0) for _ in range(3)]
        assert sum(c.measured is not None for c in engine.speculator.candidates) > 1
    assert all(result.tokens == plain.tokens for result in results)


def test_a_draft_files_load_says_its_predicted_speedup(model_path):
    with Engine.load(model_path, threads=2, context_length=CONTEXT, draft=model_path) as engine:
        speedup = engine.speculator.predicted_speedup()
        assert speedup >= 1.0  # a tree of no guesses, a plain decode step, is one of its sizes
        said = f"draft: {model_path.name}, predicted {speedup:.2f}x a decode without a draft"
        assert said in engine.notices


def test_a_candidates_first_pass_is_not_counted_in_its_trial():
    candidate = Candidate("draft.gguf", speculator=None, predicted=10.0)
    assert not candidate.count(1, 5.0, bar=1.0)  # the draft reading the prompt it had not seen
    for _ in range(TRIAL_PASSES - 1):
        assert not candidate.count(3, 0.5, bar=1.0)
    assert candidate.count(3, 0.5, bar=1.0) and candidate.measured == pytest.approx(6.0)


def test_a_trial_running_below_the_bar_ends_after_two_passes():
    candidate = Candidate("self:14", speculator=None, predicted=17.0)
    assert not candidate.count(1, 2.0, bar=6.0)
    assert not candidate.count(2, 1.0, bar=6.0)
    assert candidate.count(2, 1.0, bar=6.0) and candidate.measured == pytest.approx(2.0)


def test_auto_settled_on_no_draft_decodes_the_targets_own_tokens_one_a_pass(model_path, plain):
    with Engine.load(model_path, threads=2, context_length=CONTEXT, draft="auto") as engine:
        chooser = engine.speculator
        chooser.current = next(c for c in chooser.candidates if c.name == NO_DRAFT)
        chooser.settled = True
        result = engine.generate(PROMPT, max_tokens=24, temperature=0)
    assert result.tokens == plain.tokens and result.stats.drafted_tokens == 0
