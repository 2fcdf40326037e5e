"""Every mixture-of-experts family through every tier: its experts resident, streamed from the pack
through the expert cache, on three tiers at once (its layers and a cache of experts on the stand-in
GPU, a cache in RAM, the rest on disk), placed by hand, and verifying speculative token trees, each
giving the resident engine's greedy tokens. llama.cpp is the oracle for the resident engine
(test_oracle.py and each family's own tests); here each tier must agree with it bit for bit.
"""

import pytest

from tests.support.budgets import moe_bytes
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
    # Nemotron 3 Super's: a Mamba-2 layer, then squared-ReLU experts in a latent width with a shared one
    "nemotron_h_moe": ModelSpec(arch="nemotron_h_moe", layer_pattern="M--", ssm_inner_size=128,
                                ssm_state=16, ssm_value_heads=8, ssm_key_heads=2, expert_ffn_size=64,
                                shared_expert_ffn_size=96, moe_latent_size=64, **SHAPE),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(the model's path, the resident engine's greedy tokens, its bytes: MoeBytes)."""
    path = write_model(tmp_path_factory.mktemp(request.param) / "model.gguf", FAMILIES[request.param])
    with Engine.load(path, threads=2, context_length=CONTEXT) as engine:
        tokens = engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens
    return path, tokens, moe_bytes(path, CONTEXT)


def greedy(engine: Engine) -> list[int]:
    return engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens


@pytest.mark.slow
def test_each_familys_streamed_experts_give_its_resident_tokens(family):
    path, resident, size = family
    with Engine.load(path, threads=2, context_length=CONTEXT,
                     cpu_memory=size.in_ram(12, layers_on_gpu=False)) as engine:
        assert greedy(engine) == resident
        assert engine.expert_stats.misses > 0 and engine.expert_stats.hits > 0


def test_each_familys_experts_on_three_tiers_give_its_resident_tokens(family):
    # the layers on the (stand-in) GPU with a cache of 6 experts, 12 cached in RAM, the rest on disk
    path, resident, size = family
    with Engine.load(path, threads=2, context_length=CONTEXT, gpu_memory=size.on_gpu(6),
                     cpu_memory=size.in_ram(12), gpu_device="cpu") as engine:
        assert engine.plan.gpu_layers == tuple(range(SHAPE["num_layers"]))
        assert engine.plan.experts.home == "disk" and engine.plan.experts.gpu_cached_experts == 6
        assert greedy(engine) == resident
        runs, ram = engine.weights.experts.schedules, engine.weights.experts.ram_stats
        assert runs.on_gpu > 0 and runs.on_cpu > 0
        assert ram.hits > 0 and ram.misses > 0


def test_each_familys_experts_placed_by_hand_give_its_resident_tokens(family):
    # llama.cpp's --n-cpu-moe 2: the experts of layers 0 and 1 in RAM, the last layer's on the GPU
    path, resident, size = family
    with Engine.load(path, threads=2, context_length=CONTEXT, gpu_memory=size.on_gpu(8),
                     expert_placement=2, gpu_device="cpu") as engine:
        assert engine.plan.experts.gpu_layers == (2,)
        assert greedy(engine) == resident


def test_each_familys_token_trees_over_streamed_experts_give_its_resident_tokens(family):
    path, resident, size = family
    with Engine.load(path, threads=2, context_length=CONTEXT, cpu_memory=size.in_ram(12, layers_on_gpu=False),
                     draft="ngram") as engine:
        assert greedy(engine) == resident


def test_each_familys_own_file_as_a_draft_model_gives_its_resident_tokens(family):
    # a draft model's trees are verified many tokens at a pass: its experts' bits must not depend on that
    path, resident, _ = family
    with Engine.load(path, threads=2, context_length=CONTEXT, draft=path) as engine:
        assert greedy(engine) == resident


def test_the_plan_puts_each_familys_experts_on_disk_with_a_cache_in_ram(family):
    path, _, size = family
    with Engine.load(path, threads=2, context_length=CONTEXT,
                     cpu_memory=size.in_ram(12, layers_on_gpu=False)) as engine:
        experts = engine.plan.experts
        assert experts.home == "disk" and experts.ram_cached_experts >= 12
        assert "experts" in dict(engine.plan.summary())
