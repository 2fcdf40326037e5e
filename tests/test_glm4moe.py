"""glm4moe (GLM-4.5/4.6/4.7, 4.5-Air): leading dense layers, sigmoid-scored experts chosen with a
selection-only bias, normalised and scaled, an ungated shared expert, partial neox rotary, optional
q/k norms, and next-token-prediction layers in the file that are skipped.

llama.cpp is the oracle on models from the project's generator: exact on F32 weights with its KV
cache in F32, within quantization noise on Q8_0 and Q4_K. A small model then runs through the MoE
tiers (resident, streamed experts through the cache, experts cached on a stand-in GPU, token
trees) and `tierflow plan`; test_gpu_layers.py runs it with the GPU kernels.
"""

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.support.budgets import ram_beside_weights
from tests.support.gguf_bytes import UINT32, Typed
from tests.support.gguf_writing import rewrite_metadata
from tests.support.make_model import ModelSpec, write_model
from tests.support.model_spec import architecture_metadata
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    PROMPTS,
    assert_greedy_agrees,
    assert_logits_agree,
    assert_moe_agrees_but_where_routing_is_a_near_tie,
    llama_cpp_model,
)
from tests.test_planner import PROFILE
from tierflow import Engine
from tierflow.cli.app import app
from tierflow.errors import ModelFileError
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan.planner import make_plan
from tierflow.runtime.models import architecture
from tierflow.runtime.models.config import ModelConfig, RopeScaling
from tierflow.runtime.models.layers import scored_top_k

# GLM's shape in small: one dense layer then MoE ones, rotary over half of each 32-wide head, and
# a next-token-prediction layer after the three that run.
SPEC = ModelSpec(arch="glm4moe", num_layers=3, hidden_size=128, ffn_size=256, num_heads=4, num_kv_heads=2,
                 num_experts=8, experts_used=2, expert_ffn_size=128, leading_dense_layers=1, nextn_layers=1,
                 rope_dim=16, qk_norm=True, tied_embeddings=False, context_length=512,
                 weight_type="F32", embedding_type="F32")
K_QUANT = dict(hidden_size=256, ffn_size=512, expert_ffn_size=256, rope_dim=32)  # rows of 256


def pair(tmp_path, f32_kv: bool, **changes):
    path = write_model(tmp_path / "glm4moe.gguf", ModelSpec(**(SPEC.__dict__ | changes)))
    return (Engine.load(path, threads=2, context_length=256, kv_cache_type="f32" if f32_kv else "f16"),
            llama_cpp_model(path, n_ctx=256, f32_kv=f32_kv))


@pytest.mark.parametrize("changes", [{}, dict(qk_norm=False, leading_dense_layers=0, nextn_layers=0)],
                         ids=["qk-norms-dense-first-nextn", "air-attention-all-moe"])
def test_f32_glm4moe_matches_llama_cpp_exactly(tmp_path, changes):
    engine, llama = pair(tmp_path, f32_kv=True, **changes)
    with engine:
        assert_logits_agree(engine, llama, engine.tokenize(LONG_TEXT)[:100], max_mean_diff=0.01,
                            near_tie=EXACT_TIE)
        assert_greedy_agrees(engine, llama, PROMPTS[0], near_tie=EXACT_TIE, max_tokens=16)
    llama.close()


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K"])
def test_quantized_glm4moe_matches_llama_cpp_but_where_routing_is_a_near_tie(tmp_path, weight_type):
    """As test_oracle's MoE families: llama.cpp's 8-bit activations flip a choice where two experts'
    biased scores nearly tie; elsewhere the logits agree within quantization noise."""
    engine, llama = pair(tmp_path, f32_kv=False, weight_type=weight_type, embedding_type=weight_type,
                         **K_QUANT)
    with engine:
        ids = engine.tokenize(LONG_TEXT)[:64]
        median = assert_moe_agrees_but_where_routing_is_a_near_tie(engine, llama, ids)
    llama.close()
    print(f"glm4moe {weight_type}: median |logit difference| vs llama.cpp {median:.4f}")


# -- the router ---------------------------------------------------------------------------------

def routing(**config) -> ModelConfig:
    return ModelConfig(arch="glm4moe", name="router", num_layers=1, hidden_size=8, ffn_size=8, num_heads=1,
                       num_kv_heads=1, head_dim=8, vocab_size=1, context_length=8, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_dim=8, rope_scaling=RopeScaling(), tied_embeddings=True,
                       num_experts=4, experts_used=2, expert_ffn_size=8, **config)


def test_the_selection_bias_chooses_the_experts_but_does_not_weigh_them():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    route = scored_top_k(routing(expert_gating="sigmoid"), np.array([5.0, 0.0, 0.0, 0.0], np.float32))
    weights, chosen = route(logits, 2)
    assert sorted(chosen[0].tolist()) == [0, 3]  # the bias lifts expert 0 past experts 1 and 2
    assert torch.allclose(weights[0].sort().values, torch.sigmoid(torch.tensor([0.0, 3.0])))


def test_normalised_weights_sum_to_the_scale():
    config = routing(expert_gating="sigmoid", expert_weights_norm=True, expert_weights_scale=2.5)
    weights, chosen = scored_top_k(config)(torch.tensor([[0.5, -1.0, 2.0, 0.0]]), 2)
    assert sorted(chosen[0].tolist()) == [0, 2]
    assert torch.allclose(weights.sum(-1), torch.tensor([2.5]))


# -- the tiers ----------------------------------------------------------------------------------

PROMPT = "The history of the printing press begins in"
CONTEXT = 128
TOKENS = 16


@pytest.fixture(scope="module")
def glm_path(tmp_path_factory):
    """One dense layer, then two of 8 experts (top-2) and a shared one; a nextn layer after them."""
    spec = ModelSpec(arch="glm4moe", num_layers=3, hidden_size=64, ffn_size=128, num_experts=8,
                     experts_used=2, expert_ffn_size=64, leading_dense_layers=1, nextn_layers=1, rope_dim=8,
                     qk_norm=True, tied_embeddings=False, weight_type="Q4_0", embedding_type="Q4_0", seed=5)
    return write_model(tmp_path_factory.mktemp("glm4moe") / "glm4moe.gguf", spec)


@pytest.fixture(scope="module")
def resident(glm_path):
    with Engine.load(glm_path, threads=2, context_length=CONTEXT) as engine:
        tokens = engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens
        return tokens, engine.logits(engine.tokenize(PROMPT) + tokens)


@pytest.fixture(scope="module")
def budgets(glm_path):
    """(cpu_memory that leaves no byte to the experts, one expert's bytes)."""
    with Engine.load(glm_path, threads=2, context_length=CONTEXT) as engine:
        packed = engine.weights.packed
        base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
        return base + ram_beside_weights(glm_path, CONTEXT), packed.experts[1][0].nbytes


def test_the_pack_holds_experts_for_the_moe_layers_only_and_no_nextn_layer(glm_path):
    with Engine.load(glm_path, threads=2, context_length=CONTEXT) as engine:
        packed = engine.weights.packed
        assert len(packed.layers) == 3 and [len(experts) for experts in packed.experts] == [0, 8, 8]
        assert "gate_up" in packed.layers[0].weights and "router" not in packed.layers[0].weights


def test_streamed_glm4moe_experts_give_the_resident_tokens_and_logits_bit_for_bit(glm_path, budgets,
                                                                                  resident):
    base, one = budgets
    with Engine.load(glm_path, threads=2, context_length=CONTEXT, cpu_memory=base + 10 * one) as engine:
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]
        assert np.array_equal(engine.logits(engine.tokenize(PROMPT) + resident[0]), resident[1])
        stats = engine.expert_stats
    assert sorted(stats.layers) == [1, 2] and stats.misses > 0
    assert stats.predictions_right + stats.predictions_wrong > 0  # layer 2's, predicted at layer 1


def test_glm4moe_token_trees_over_streamed_experts_give_the_resident_tokens(glm_path, budgets, resident):
    base, one = budgets
    with Engine.load(glm_path, threads=2, context_length=CONTEXT, cpu_memory=base + 10 * one,
                     draft="ngram") as engine:
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]


def test_glm4moe_experts_cached_on_the_stand_in_gpu_give_the_resident_tokens_and_logits(glm_path, budgets,
                                                                                      resident):
    _, one = budgets
    with Engine.load(glm_path, threads=2, context_length=CONTEXT, gpu_memory=6 * one,
                     gpu_device="cpu") as engine:
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == resident[0]
        assert np.array_equal(engine.logits(engine.tokenize(PROMPT) + resident[0]), resident[1])
        assert engine.weights.experts.schedules.on_gpu + engine.weights.experts.schedules.fetched > 0


def test_recorded_routing_has_the_moe_layers_only(glm_path):
    with Engine.load(glm_path, threads=2, context_length=CONTEXT) as engine:
        prompt = engine.tokenize(PROMPT)
        with engine.record_routing() as recorder:
            engine.logits(prompt)
    assert recorder.trace().shape == (len(prompt), 2, 2)


def test_plan_command_places_experts_in_the_moe_layers_only(glm_path, budgets, monkeypatch):
    base, one = budgets
    monkeypatch.setattr("tierflow.offload.plan.probe.load_profile", lambda threads, **kwargs: PROFILE)
    done = CliRunner().invoke(app, ["plan", str(glm_path), "--cpu-memory", str(base + 10 * one),
                                    "--threads", "2", "--ctx", str(CONTEXT)])
    assert done.exit_code == 0, done.output
    for text in ("layers 1-2 experts 0-7", "16 x", "experts on disk", "a cache of 10"):
        assert text in done.output


def test_the_planned_expert_misses_per_token_count_the_moe_layers_only(glm_path, budgets):
    base, one = budgets
    with open_model_file(glm_path) as model:
        plan = make_plan(model, pack_sizes(model), PROFILE, gpu_budget=0, cpu_budget=base + 10 * one,
                         context_length=CONTEXT)
    experts = plan.experts
    assert experts.total_experts == 16 and experts.ram_cached_experts == 10
    uses_per_token = 2 * 2  # 2 MoE layers, top-2 each: each use read from disk at the disk's share
    assert experts.served["disk"] == pytest.approx(6 / 16)
    assert experts.bytes_per_token["disk"] == pytest.approx(uses_per_token * 6 / 16 * experts.expert_bytes)


# -- bad input ----------------------------------------------------------------------------------

def read_config(**changes) -> ModelConfig:
    """The config tierflow reads from the generator's glm4moe metadata with `changes` (None removes
    a key)."""
    metadata = {key: typed.value for key, typed in architecture_metadata(SPEC, 1000)}
    metadata.update({f"glm4moe.{key}": value for key, value in changes.items()})
    kept = {key: value for key, value in metadata.items() if value is not None}
    return architecture("glm4moe").read_config(kept, 1000, False)


def test_gating_is_sigmoid_without_the_key_and_softmax_where_it_says_so():
    assert read_config(expert_gating_func=None).expert_gating == "sigmoid"
    assert read_config(expert_gating_func=1).expert_gating == "softmax"


@pytest.mark.parametrize("code", [3, 9])
def test_a_gating_function_glm4moe_does_not_define_is_a_model_file_error_naming_it(code):
    with pytest.raises(ModelFileError, match=f"glm4moe.expert_gating_func is {code}: .*sigmoid"):
        read_config(expert_gating_func=code)


@pytest.mark.parametrize("changes, message", [
    (dict(expert_weights_norm="yes"), "'glm4moe.expert_weights_norm' must be a boolean, got 'yes'"),
    (dict(expert_weights_scale=-2.5), "expert_weights_scale must be a positive number, got -2.5")],
    ids=["norm-not-a-boolean", "negative-scale"])
def test_routing_keys_of_the_wrong_kind_are_model_file_errors_naming_them(changes, message):
    with pytest.raises(ModelFileError, match=message):
        read_config(**changes)


def test_nextn_layers_that_leave_no_layer_to_run_are_a_model_file_error():
    with pytest.raises(ModelFileError, match="nextn_predict_layers must be below block_count 4"):
        read_config(nextn_predict_layers=4)


def test_more_leading_dense_layers_than_layers_is_a_model_file_error():
    with pytest.raises(ModelFileError, match="leading_dense_block_count' must be in 0..3"):
        read_config(leading_dense_block_count=4)


def with_metadata(path, tmp_path, **changes):
    return rewrite_metadata(path, tmp_path / "changed.gguf",
                            {f"glm4moe.{key}": Typed(UINT32, value) for key, value in changes.items()})


@pytest.mark.parametrize("changes, shapes", [
    (dict(expert_count=6),
     r"'blk.1.ffn_gate_inp.weight' has shape \[64, 8\], the metadata implies \[64, 6\]"),
    (dict(expert_feed_forward_length=32),
     r"'blk.1.ffn_gate_shexp.weight' has shape \[64, 64\], the metadata implies \[64, 32\]"),
    (dict(expert_shared_count=0, expert_feed_forward_length=32),
     r"'blk.1.ffn_gate_exps.weight' has shape \[64, 64, 8\], the metadata implies \[64, 32, 8\]")],
    ids=["count", "shared-width", "expert-width"])
def test_expert_tensors_that_disagree_with_the_metadata_are_named_with_both_shapes(glm_path, tmp_path,
                                                                                 changes, shapes):
    with pytest.raises(ModelFileError, match=shapes):
        Engine.load(with_metadata(glm_path, tmp_path, **changes))


def test_more_experts_used_than_exist_is_a_model_file_error(glm_path, tmp_path):
    with pytest.raises(ModelFileError, match="expert_used_count' must be in 1..8, got 9"):
        Engine.load(with_metadata(glm_path, tmp_path, expert_used_count=9))


def test_an_exp_probs_b_of_the_wrong_shape_is_named_with_both_shapes(glm_path, tmp_path):
    name = b"blk.2.exp_probs_b.bias"
    data = bytearray(glm_path.read_bytes())
    at = data.index(name) + len(name)  # then its dimension count (uint32) and dimensions (uint64)
    assert int.from_bytes(data[at:at + 4], "little") == 1
    data[at + 4:at + 12] = (4).to_bytes(8, "little")
    broken = tmp_path / "bias-of-4.gguf"
    broken.write_bytes(bytes(data))
    shapes = r"'blk.2.exp_probs_b.bias' has shape \[4\], the metadata implies \[8\]"
    with pytest.raises(ModelFileError, match=shapes):
        Engine.load(broken)
