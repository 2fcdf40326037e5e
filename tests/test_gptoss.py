"""gpt-oss against llama.cpp (exact on F32 with an F32 KV cache, within quantization noise on Q8_0),
through the MoE tiers (resident, streamed experts behind the cache, experts cached on the stand-in
GPU), and its malformed files. Prompts are longer than the window, so the local layers' rings wrap."""

import numpy as np
import pytest

from tests.support.budgets import ram_beside_weights
from tests.support.gguf_writing import TensorEntry, encoded_kvs, write_gguf
from tests.support.make_model import ModelSpec, write_model
from tests.support.model_spec import spec_config
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    PROMPTS,
    assert_greedy_agrees,
    assert_logits_agree,
    llama_cpp_logits,
    llama_cpp_model,
    top2_margin,
)
from tierflow import Engine
from tierflow.errors import ModelFileError
from tierflow.offload.gguf.reader import read_gguf

WINDOW = 16
# 4 heads of 32 over 2 KV heads, 4 experts of width 128 (top-2), YaRN as gpt-oss's files have it
F32_SPEC = ModelSpec(arch="gpt-oss", num_layers=3, hidden_size=128, ffn_size=128, num_heads=4, num_kv_heads=2,
                     num_experts=4, experts_used=2, context_length=512, sliding_window=WINDOW,
                     rope_scaling="yarn", rope_scaling_factor=4.0, weight_type="F32", embedding_type="F32")
# the tiers' model: 8 experts of width 64, two layers, Q8_0
TIER_SPEC = ModelSpec(arch="gpt-oss", num_layers=2, hidden_size=64, ffn_size=64, num_heads=4, num_kv_heads=2,
                      num_experts=8, experts_used=2, sliding_window=WINDOW, weight_type="Q8_0",
                      embedding_type="Q8_0", seed=5)
CONTEXT = 256
TOKENS = 24


@pytest.fixture(scope="module")
def f32_pair(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("gptoss") / "gpt-oss-f32.gguf", F32_SPEC)
    engine = Engine.load(path, threads=2, context_length=CONTEXT, kv_cache_type="f32")
    llama = llama_cpp_model(path, n_ctx=CONTEXT, f32_kv=True)
    yield engine, llama
    llama.close()
    engine.close()


def test_even_layers_are_local_with_the_files_window():
    """llama.cpp's swa pattern 2 for gpt-oss: layers 0, 2, ... slide, the others see everything."""
    assert spec_config(F32_SPEC, 1000).layer_windows == (WINDOW, 0, WINDOW)


def test_f32_gpt_oss_logits_match_llama_cpp_exactly(f32_pair):
    engine, llama = f32_pair
    ids = engine.tokenize(LONG_TEXT)[:200]
    assert_logits_agree(engine, llama, ids, max_mean_diff=0.01, near_tie=EXACT_TIE)


def test_f32_gpt_oss_greedy_tokens_match_llama_cpp_exactly(f32_pair):
    assert_greedy_agrees(*f32_pair, PROMPTS[0], near_tie=EXACT_TIE, max_tokens=32)


def test_q8_0_gpt_oss_matches_llama_cpp_within_quantization_noise(tmp_path):
    """llama.cpp's 8-bit activations move the logits; where the router's k-th and (k+1)-th
    experts nearly tie they flip a choice, so a few positions may differ more (as test_oracle's
    quantized MoE models)."""
    spec = ModelSpec(**(vars(F32_SPEC) | dict(weight_type="Q8_0", embedding_type="Q8_0")))
    path = write_model(tmp_path / "gpt-oss-q8_0.gguf", spec)
    with Engine.load(path, threads=2, context_length=CONTEXT, kv_cache_type="f32") as engine:
        ids = engine.tokenize(LONG_TEXT)[:64]
        ours, llama = engine.logits(ids), llama_cpp_model(path, n_ctx=CONTEXT)
        theirs = llama_cpp_logits(llama, ids)
        llama.close()
    per_position = np.abs(ours - theirs).mean(-1)
    decided = top2_margin(theirs) > 1.0
    assert np.median(per_position) < 0.35 and (per_position > 1.0).mean() <= 0.05
    assert (ours.argmax(-1)[decided] == theirs.argmax(-1)[decided]).mean() >= 0.95


# -- the MoE tiers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tier_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("gptoss-tiers") / "gpt-oss-q8_0.gguf", TIER_SPEC)


@pytest.fixture(scope="module")
def resident(tier_path):
    """Greedy tokens and the logits of prompt + them with every expert in RAM, and the bytes of
    everything but the experts (with what cpu_memory keeps beside them) and of one expert."""
    with Engine.load(tier_path, threads=2, context_length=CONTEXT) as engine:
        tokens = engine.generate(PROMPTS[0], max_tokens=TOKENS, temperature=0).tokens
        packed = engine.weights.packed
        base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
        return (tokens, engine.logits(engine.tokenize(PROMPTS[0]) + tokens),
                base + ram_beside_weights(tier_path, CONTEXT), packed.experts[0][0].nbytes)


def assert_resident_results(engine: Engine, resident) -> None:
    tokens, logits = resident[:2]
    assert engine.generate(PROMPTS[0], max_tokens=TOKENS, temperature=0).tokens == tokens
    assert np.array_equal(engine.logits(engine.tokenize(PROMPTS[0]) + tokens), logits)


def test_streamed_gpt_oss_experts_give_the_resident_tokens_and_logits_bit_for_bit(tier_path, resident):
    base, one = resident[2:]
    with Engine.load(tier_path, threads=2, context_length=CONTEXT, cpu_memory=base + 10 * one) as engine:
        assert_resident_results(engine, resident)
        assert engine.expert_stats.misses > 0


def test_gpt_oss_experts_cached_on_the_stand_in_gpu_give_the_resident_tokens_and_logits(tier_path, resident):
    one = resident[3]
    with Engine.load(tier_path, threads=2, context_length=CONTEXT, gpu_memory=6 * one,
                     gpu_device="cpu") as engine:
        assert_resident_results(engine, resident)
        assert engine.weights.experts.schedules.on_gpu > 0


def test_gpt_oss_verifies_ngram_drafts_with_the_resident_tokens(tier_path, resident):
    """Token trees: each verify pass attends with the sinks over its tree's paths."""
    with Engine.load(tier_path, threads=2, context_length=CONTEXT, draft="ngram") as engine:
        assert engine.generate(PROMPTS[0], max_tokens=TOKENS, temperature=0).tokens == resident[0]


# -- malformed files --------------------------------------------------------------------------


def with_shape(path, tmp_path, tensor: str, shape: tuple[int, ...]):
    """A copy of the file whose tensor `tensor` (F32) has the shape `shape` (GGUF order), zeros."""
    with read_gguf(path) as model:
        infos = list(model.tensors.values())
        entries = [TensorEntry(i.name, shape if i.name == tensor else i.shape, i.ggml_type) for i in infos]
        data = (np.zeros(shape, np.float32) if i.name == tensor else model.tensor_data(i.name) for i in infos)
        return write_gguf(tmp_path / "broken.gguf", list(encoded_kvs(path).values()), entries, data,
                          model.alignment)


@pytest.mark.parametrize("tensor,shape,expected", [
    ("blk.1.attn_sinks.weight", (3,), (4,)),
    ("blk.0.ffn_up_exps.bias", (64, 4), (64, 8)),
    ("blk.0.attn_output.bias", (32,), (64,)),
])
def test_a_sink_or_bias_of_the_wrong_shape_is_a_model_file_error_naming_both_shapes(
        tier_path, tmp_path, tensor, shape, expected):
    listed = ", ".join(map(str, shape)), ", ".join(map(str, expected))
    with pytest.raises(ModelFileError, match=rf"'{tensor}' has shape \[{listed[0]}\], the metadata implies "
                                             rf"\[{listed[1]}\]"):
        Engine.load(with_shape(tier_path, tmp_path, tensor, shape))
