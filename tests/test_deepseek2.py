"""deepseek2: multi-head latent attention over a latent KV cache, and routed plus shared experts,
against llama.cpp; its cache's size as the engine and the planner count it, and its context
shift; files whose tensors disagree with the latent widths. The expert tiers and token trees:
test_moe_families.py; the experts on the GPU kernels: test_gpu_layers.py.

Two forms are generated: DeepSeek-V2-Lite's (one attn_q, softmax gating, no selection bias, YaRN
without yarn_log_multiplier) and V3's (low-rank queries, a dense first layer, sigmoid gating with
the selection bias exp_probs_b, experts chosen within the better of two groups, weights
renormalised and scaled, YaRN with yarn_log_multiplier, whose attention scale and rotary magnitude
differ from YaRN's usual ones).
"""

import pytest

from tests.support.gguf_bytes import UINT32, Typed
from tests.support.gguf_writing import rewrite_metadata
from tests.support.kv_shift import shifted_and_fresh_keys, text_ids, within_float_error
from tests.support.make_model import ModelSpec, write_model
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    PROMPTS,
    assert_greedy_agrees,
    assert_logits_agree,
    assert_moe_agrees_but_where_routing_is_a_near_tie,
    llama_cpp_model,
)
from tierflow import Engine
from tierflow.errors import InvalidArgumentError, ModelFileError, UnsupportedModelError
from tierflow.kv_types import kv_type
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.plan.budgets import CacheFootprint, activation_bytes

LATENT, ROPE = 64, 16  # kv_lora_rank, rope dims: the cache holds 80 values per position and layer
LITE = dict(arch="deepseek2", num_layers=2, hidden_size=64, num_heads=4, head_size=48, num_experts=4,
            experts_used=2, expert_ffn_size=32, kv_lora_rank=LATENT, rope_dim=ROPE, context_length=512,
            rope_scaling="yarn", rope_scaling_factor=4.0)  # no yarn_log_multiplier: YaRN's usual scale
V3 = LITE | dict(num_layers=3, leading_dense_layers=1, q_lora_rank=32, expert_gating="sigmoid",
                 expert_weights_norm=True, expert_weights_scale=2.5, expert_groups=2, expert_groups_used=1,
                 rope_scaling_factor=40.0, yarn_log_multiplier=0.0707)
F32 = dict(weight_type="F32", embedding_type="F32")
CONTEXT = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek2")
    specs = {"lite-F32": ModelSpec(**LITE, **F32, seed=1), "v3-F32": ModelSpec(**V3, **F32, seed=2),
             "v3-Q8_0": ModelSpec(**V3, seed=3)}
    return {name: write_model(folder / f"{name}.gguf", spec) for name, spec in specs.items()}


def pair(path, f32_kv: bool):
    return (Engine.load(path, threads=2, context_length=CONTEXT, kv_cache_type="f32"),
            llama_cpp_model(path, n_ctx=CONTEXT, f32_kv=f32_kv))


@pytest.mark.parametrize("name", ["lite-F32", "v3-F32"])
def test_f32_deepseek2_matches_llama_cpp_exactly(models, name):
    engine, llama = pair(models[name], f32_kv=True)
    with engine:
        ids = engine.tokenize(LONG_TEXT)[:128]
        assert_logits_agree(engine, llama, ids, max_mean_diff=0.01, near_tie=EXACT_TIE)
        assert_greedy_agrees(engine, llama, PROMPTS[0], near_tie=EXACT_TIE, max_tokens=16)


def test_q8_0_deepseek2_matches_llama_cpp_but_where_routing_is_a_near_tie(models):
    """As for the other MoE families (test_oracle): llama.cpp's 8-bit activations flip a router's
    choice where two experts nearly tie; elsewhere the logits agree within quantization noise."""
    engine, llama = pair(models["v3-Q8_0"], f32_kv=False)
    with engine:
        ids = engine.tokenize(LONG_TEXT)[:64]
        median = assert_moe_agrees_but_where_routing_is_a_near_tie(engine, llama, ids)
    print(f"deepseek2 Q8_0: median |logit difference| vs llama.cpp {median:.4f}")


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_the_cache_holds_one_row_of_latent_and_rope_dims_per_position_and_layer(models, kv):
    row_bytes = (LATENT + ROPE) * kv_type(kv).block_bytes
    with Engine.load(models["lite-F32"], threads=2, context_length=CONTEXT, kv_cache_type=kv) as engine:
        assert engine.kv_cache_bytes == 2 * CONTEXT * row_bytes  # 2 layers; no per-head keys or values
        assert engine.plan.kv_bytes == engine.kv_cache_bytes
        assert all(values.shape[-1] == 0 for values in engine._generator.cache.values)  # read from the keys


def test_the_planner_sizes_a_latent_cache_by_its_rows(models):
    with open_model_file(models["lite-F32"]) as model:
        footprint = CacheFootprint.of(model.config, 1000, kv_type("f16"), on_cpu=False)
    assert footprint.layer_bytes == (1008 * (LATENT + ROPE) * 2,) * 2  # 1000 positions rounded up to 16


def test_the_context_chosen_under_a_budget_is_the_longest_whose_latent_cache_fits(models):
    """cpu_memory for the experts streamed through a one-layer cache, the activations and a latent
    cache of 256 positions: of the model's 512 trained positions, 256 are given (a cache counted
    per head, 4 heads' keys and values, would not fit even those), and the plan counts that cache."""
    path = models["lite-F32"]
    with Engine.load(path, threads=2, context_length=CONTEXT) as engine:
        packed, config = engine.weights.packed, engine.config
        base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
        one_layer = sum(x.nbytes for x in packed.experts[0])
    latent_cache = 2 * 256 * (LATENT + ROPE) * 2  # 2 layers, f16
    budget = base + one_layer + latent_cache + activation_bytes(config, 256)
    with Engine.load(path, threads=2, cpu_memory=budget) as engine:
        assert engine.context_length == 256 and engine.kv_cache_bytes == engine.plan.kv_bytes == latent_cache
        assert "256 positions, not the model's 512" in engine.notices[0]


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_quantized_cache_type_is_refused_where_a_part_of_the_latent_rows_is_not_whole_blocks(models, kv):
    """A rotary part of 16: blocks of 32 would straddle it and the latent (test_latent_cache.py
    runs the quantized types where both parts are whole blocks)."""
    refusal = f"{kv} stores blocks of 32 values, but this model's latent cache rows hold a rotary part of 16"
    with pytest.raises(InvalidArgumentError, match=refusal):
        Engine.load(models["lite-F32"], threads=2, context_length=CONTEXT, kv_cache_type=kv)


@pytest.mark.parametrize("key, value, tensor, shapes", [
    ("attention.kv_lora_rank", 32, "attn_kv_a_mqa", r"\[64, 80\], the metadata implies \[64, 48\]"),
    ("rope.dimension_count", 8, "attn_kv_a_mqa", r"\[64, 80\], the metadata implies \[64, 72\]"),
    ("attention.value_length_mla", 16, "attn_v_b", r"\[64, 32, 4\], the metadata implies \[64, 16, 4\]"),
])
def test_tensors_that_disagree_with_the_latent_widths_are_named_with_both_shapes(models, tmp_path, key,
                                                                               value, tensor, shapes):
    broken = rewrite_metadata(models["lite-F32"], tmp_path / "broken.gguf", {
        f"deepseek2.{key}": Typed(UINT32, value), "deepseek2.attention.key_length": None,
        "deepseek2.attention.value_length": None})
    with pytest.raises(ModelFileError, match=f"'blk.0.{tensor}.weight' has shape {shapes}"):
        Engine.load(broken, threads=2, context_length=CONTEXT)


def test_a_file_in_the_older_form_with_one_kv_b_projection_is_refused_naming_the_fix(models, tmp_path):
    older = rewrite_metadata(models["lite-F32"], tmp_path / "older.gguf", {
        "deepseek2.attention.key_length_mla": None, "deepseek2.attention.value_length_mla": None})
    with pytest.raises(UnsupportedModelError, match="attn_kv_b.*convert it again"):
        Engine.load(older, threads=2, context_length=CONTEXT)


def test_a_context_shift_turns_the_rotary_part_of_the_latent_rows_as_a_fresh_prefill_writes_it(models):
    with Engine.load(models["lite-F32"], threads=2, context_length=CONTEXT, kv_cache_type="f32") as engine:
        shifted, fresh = shifted_and_fresh_keys(engine, text_ids(engine, 120), keep=10, drop=30)
    assert shifted.shape[-1] == LATENT + ROPE
    assert within_float_error(shifted, fresh)


def test_a_gating_function_the_family_does_not_define_is_named(models, tmp_path):
    broken = rewrite_metadata(models["lite-F32"], tmp_path / "gating.gguf",
                              {"deepseek2.expert_gating_func": Typed(UINT32, 4)})
    with pytest.raises(ModelFileError, match="deepseek2.expert_gating_func is 4: .*softmax.*sigmoid"):
        Engine.load(broken, threads=2, context_length=CONTEXT)


def test_expert_groups_that_do_not_divide_the_experts_are_named(models, tmp_path):
    broken = rewrite_metadata(models["lite-F32"], tmp_path / "groups.gguf",
                              {"deepseek2.expert_group_count": Typed(UINT32, 3)})
    with pytest.raises(ModelFileError, match="expert_group_count 3 must divide the 4 experts"):
        Engine.load(broken, threads=2, context_length=CONTEXT)
