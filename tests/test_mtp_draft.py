"""draft="mtp": the multi-token-prediction block of Qwen3.5 and Qwen3-Next files as a draft, against
llama.cpp's graph_mtp, and the target's output unchanged by it."""

import dataclasses

import numpy as np
import pytest

from tests.support.budgets import ram_beside_weights
from tests.support.gguf_bytes import UINT32, Typed
from tests.support.gguf_writing import rewrite_metadata
from tests.support.make_model import ModelSpec, write_f32_copy, write_model
from tests.support.oracle import PROMPTS, llama_cpp_mtp_logits
from tests.support.together import generate_together
from tierflow import Engine
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.errors import BudgetError, InvalidArgumentError, ModelFileError
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.gguf.reader import read_gguf
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.store.model_path import bundled_model_path

SHAPE = dict(num_layers=4, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2, head_size=32,
             rope_dim=16, context_length=2048, nextn_layers=1)
MOE = dict(num_experts=4, experts_used=2, expert_ffn_size=64, shared_expert_ffn_size=96)
SPECS = {"qwen35": ModelSpec(arch="qwen35", **SHAPE),
         "qwen35moe": ModelSpec(arch="qwen35moe", **SHAPE, **MOE),
         "qwen3next": ModelSpec(arch="qwen3next", **SHAPE, **MOE)}
F32 = dict(weight_type="F32", embedding_type="F32")
LOAD = dict(threads=2, context_length=256, kv_cache_type="f32")
TOKENS = [50, 60, 70, 80, 90, 100, 110, 120]


@pytest.fixture(scope="module", params=SPECS)
def f32_model(request, tmp_path_factory):
    spec = dataclasses.replace(SPECS[request.param], **F32)
    return write_model(tmp_path_factory.mktemp(request.param) / "model.gguf", spec)


def tensor_values(path, name: str) -> np.ndarray:
    with read_gguf(path) as model:
        info = model.tensors[name]
        return dequantize(model.tensor_data(name), info.ggml_type, info.shape)


def mtp_block(engine: Engine):
    """The MTP draft's generator: the block's decoder over its own KV cache."""
    return engine.speculator.draft.generator


def test_the_block_computes_llama_cpps_mtp_graph(f32_model):
    theirs, took_state = llama_cpp_mtp_logits(f32_model, TOKENS, np.zeros((len(TOKENS), 64)))
    assert not took_state  # this llama.cpp reads a zero state: the next test covers the state's half
    with Engine.load(f32_model, draft="mtp", **LOAD) as engine:
        ours, _ = mtp_block(engine).forward(TOKENS, np.zeros((len(TOKENS), 64), np.float32))
    assert np.abs(ours - theirs).max() < 1e-3 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_the_hidden_state_enters_the_block_as_the_token_embedding_does(f32_model, tmp_path):
    """With hnorm set to enorm and the hidden state equal to the token's embedding, the block's
    input is the embedding's half of eh_proj plus its hidden half applied to the same row: what
    llama.cpp computes from the embedding alone with those halves added."""
    width = 64

    def same_norms(name: str, values: np.ndarray) -> np.ndarray:
        return norms["enorm"] if name.endswith("nextn.hnorm.weight") else values

    def halves_added(name: str, values: np.ndarray) -> np.ndarray:
        if name.endswith("nextn.eh_proj.weight"):  # [E, 2E]: the embedding's columns, then the state's
            values = values.copy()
            values[:, :width] += values[:, width:]
        return same_norms(name, values)

    norms = {"enorm": tensor_values(f32_model, "blk.4.nextn.enorm.weight")}
    ours_path = write_f32_copy(f32_model, tmp_path / "same_norms.gguf", same_norms)
    theirs_path = write_f32_copy(f32_model, tmp_path / "halves_added.gguf", halves_added)
    theirs, _ = llama_cpp_mtp_logits(theirs_path, TOKENS, np.zeros((len(TOKENS), width)))
    with Engine.load(ours_path, draft="mtp", **LOAD) as engine:
        block = mtp_block(engine)
        embeddings = block.block.embedding_rows(np.array(TOKENS))
        ours, _ = block.forward(TOKENS, embeddings)
    assert np.abs(ours - theirs).max() < 1e-3 * np.abs(theirs).max()


@pytest.mark.slow
def test_greedy_output_with_the_mtp_draft_is_the_targets_own_through_a_chat(f32_model):
    with Engine.load(f32_model, **LOAD) as engine:
        first = engine.generate(PROMPTS[0], max_tokens=16, temperature=0)
        follow_up = PROMPTS[0] + first.text + " " + PROMPTS[1]
        expected = [first.tokens, engine.generate(follow_up, max_tokens=24, temperature=0).tokens]
    with Engine.load(f32_model, draft="mtp", **LOAD) as engine:
        got = [engine.generate(PROMPTS[0], max_tokens=16, temperature=0).tokens,
               engine.generate(follow_up, max_tokens=24, temperature=0)]
        assert got[1].stats.drafted_tokens > 0
    assert [got[0], got[1].tokens] == expected


def test_parallel_sequences_keep_their_own_output_with_one_mtp_draft(f32_model):
    prompts = [PROMPTS[0], PROMPTS[1]]
    with Engine.load(f32_model, **LOAD) as engine:
        expected = [engine.generate(p, max_tokens=20, temperature=0).tokens for p in prompts]
    with Engine.load(f32_model, draft="mtp", parallel=2, **LOAD) as engine:
        got = generate_together(engine, prompts, max_tokens=20, temperature=0)
    assert got == expected


@pytest.fixture(scope="module")
def bigram_model(tmp_path_factory):
    """A target whose layers add nothing (every output projection zero), so that its next token is
    a function of the current one; and an MTP block that computes the same function (eh_proj
    passes the normed embedding, its projections add nothing, its head norm is the output norm).
    Its guesses are the target's tokens, however deep they chain."""
    folder = tmp_path_factory.mktemp("bigram")
    source = write_model(folder / "source.gguf", dataclasses.replace(SPECS["qwen35moe"], **F32))
    output_norm = tensor_values(source, "output_norm.weight")

    def bigram(name: str, values: np.ndarray) -> np.ndarray:
        if name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
                          "ffn_down_shexp.weight")):
            return np.zeros_like(values)
        if name.endswith("nextn.eh_proj.weight"):
            return np.eye(*values.shape, dtype=np.float32)
        if name.endswith(("nextn.enorm.weight", "nextn.hnorm.weight")):
            return np.ones_like(values)
        if name.endswith("nextn.shared_head_norm.weight"):
            return output_norm
        return values

    return write_f32_copy(source, folder / "bigram.gguf", bigram)


def test_a_target_the_block_predicts_accepts_its_chained_guesses(bigram_model):
    with Engine.load(bigram_model, draft="mtp", draft_shape="chain", draft_tokens=8, **LOAD) as engine:
        result = engine.generate(PROMPTS[0], max_tokens=40, temperature=0)
    stats = result.stats
    assert stats.accepted_tokens >= 0.9 * stats.drafted_tokens
    assert stats.decode_steps <= len(result.tokens) // 4


def test_a_file_without_an_mtp_block_is_refused_naming_the_key(tmp_path):
    path = write_model(tmp_path / "model.gguf", dataclasses.replace(SPECS["qwen35"], nextn_layers=0))
    with pytest.raises(InvalidArgumentError, match="no multi-token-prediction block.*nextn_predict_layers"):
        Engine.load(path, draft="mtp", **LOAD)


def test_a_family_without_an_mtp_block_is_refused_naming_it():
    with pytest.raises(InvalidArgumentError, match="no multi-token-prediction block for llama models"):
        Engine.load(bundled_model_path(), draft="mtp", **LOAD)


def test_a_block_the_metadata_claims_but_the_file_lacks_names_the_missing_tensor(tmp_path):
    path = write_model(tmp_path / "model.gguf", dataclasses.replace(SPECS["qwen35"], nextn_layers=0))
    one_more = {"qwen35.block_count": Typed(UINT32, 5), "qwen35.nextn_predict_layers": Typed(UINT32, 1)}
    claimed = rewrite_metadata(path, tmp_path / "claimed.gguf", one_more)
    with Engine.load(claimed, **LOAD) as engine:  # the target alone runs
        assert engine.config.num_layers == 4
    with pytest.raises(ModelFileError, match="missing tensor 'blk.4.attn_norm.weight'"):
        Engine.load(claimed, draft="mtp", **LOAD)


def test_the_draft_is_placed_first_in_cpu_memory(f32_model):
    with open_model_file(f32_model) as model:
        just_the_target = pack_sizes(model).total_bytes + ram_beside_weights(f32_model, 256, "f32")
    Engine.load(f32_model, cpu_memory=just_the_target, **LOAD).close()
    with pytest.raises(BudgetError, match="after the MTP draft, placed first"):
        Engine.load(f32_model, draft="mtp", cpu_memory=just_the_target, **LOAD)
