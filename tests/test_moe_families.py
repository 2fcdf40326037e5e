"""Every mixture-of-experts family through every tier: its experts resident, streamed from the pack
through the expert cache, cached on the (stand-in) GPU, and verifying speculative token trees, each
giving the resident engine's greedy tokens. llama.cpp is the oracle for the resident engine
(test_oracle.py and each family's own tests); here each tier must agree with it bit for bit.
"""

import pytest

from tests.support.budgets import ram_beside_weights
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine

PROMPT = "The history of the printing press begins in"
CONTEXT = 128
TOKENS = 16
SHAPE = dict(num_layers=3, hidden_size=128, ffn_size=128, num_experts=8, experts_used=2,
             weight_type="Q8_0", embedding_type="Q8_0", seed=3)
FAMILIES = {
    "mixtral": ModelSpec(arch="llama", **SHAPE),
    "qwen2moe": ModelSpec(arch="qwen2moe", **SHAPE),
    "olmoe": ModelSpec(arch="olmoe", num_kv_heads=4, **SHAPE),
    "qwen3moe": ModelSpec(arch="qwen3moe", expert_ffn_size=64, head_size=48, **SHAPE),
    "gpt-oss": ModelSpec(arch="gpt-oss", sliding_window=16, **SHAPE),
    # as shipped: MXFP4 experts, packed as 4-bit indices into their codebook
    "gpt-oss-mxfp4": ModelSpec(arch="gpt-oss", sliding_window=16, expert_type="MXFP4", **SHAPE),
    # V3's form: latent attention with low-rank queries, a dense first layer, sigmoid gating with
    # the selection bias
    "deepseek2": ModelSpec(arch="deepseek2", expert_ffn_size=64, head_size=48, rope_dim=16, q_lora_rank=32,
                           leading_dense_layers=1, expert_gating="sigmoid", expert_weights_norm=True,
                           **SHAPE),
    # Qwen3.5's: Gated DeltaNet layers with a recurrent state, a gated shared expert
    "qwen35moe": ModelSpec(arch="qwen35moe", expert_ffn_size=64, head_size=32, rope_dim=16, **SHAPE),
    "qwen3next": ModelSpec(arch="qwen3next", expert_ffn_size=64, head_size=32, rope_dim=16, **SHAPE),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(the model's path, the resident engine's greedy tokens, (room beside the experts, one
    expert's bytes))."""
    path = write_model(tmp_path_factory.mktemp(request.param) / "model.gguf", FAMILIES[request.param])
    with Engine.load(path, threads=2, context_length=CONTEXT) as engine:
        tokens = engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens
        packed = engine.weights.packed
        base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
        one = max(x.nbytes for layer in packed.experts for x in layer)
    return path, tokens, (base + ram_beside_weights(path, CONTEXT), one)


def greedy(engine: Engine) -> list[int]:
    return engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens


def test_each_familys_streamed_experts_give_its_resident_tokens(family):
    path, resident, (base, one) = family
    with Engine.load(path, threads=2, context_length=CONTEXT, cpu_memory=base + 12 * one) as engine:
        assert greedy(engine) == resident
        assert engine.expert_stats.misses > 0 and engine.expert_stats.hits > 0


def test_each_familys_experts_cached_on_the_stand_in_gpu_give_its_resident_tokens(family):
    path, resident, (_, one) = family
    with Engine.load(path, threads=2, context_length=CONTEXT, gpu_memory=8 * one, gpu_device="cpu") as engine:
        assert greedy(engine) == resident
        runs = engine.weights.experts.schedules
        assert runs.on_gpu > 0 and runs.on_cpu > 0


def test_each_familys_token_trees_over_streamed_experts_give_its_resident_tokens(family):
    path, resident, (base, one) = family
    with Engine.load(path, threads=2, context_length=CONTEXT, cpu_memory=base + 12 * one,
                     draft="ngram") as engine:
        assert greedy(engine) == resident


def test_each_familys_own_file_as_a_draft_model_gives_its_resident_tokens(family):
    # a draft model's trees are verified many tokens at a pass: its experts' bits must not depend on that
    path, resident, _ = family
    with Engine.load(path, threads=2, context_length=CONTEXT, draft=path) as engine:
        assert greedy(engine) == resident


def test_the_plan_puts_each_familys_experts_on_disk_with_a_cache_in_ram(family):
    path, _, (base, one) = family
    with Engine.load(path, threads=2, context_length=CONTEXT, cpu_memory=base + 12 * one) as engine:
        experts = engine.plan.experts
        assert experts.home == "disk" and experts.cached_experts >= 12
        assert "experts" in dict(engine.plan.summary())
