"""engine.embed: llama.cpp's embeddings (llama-cpp-python with embedding=True is the oracle),
batched, deterministic, normalised, and the errors of bad inputs."""

import asyncio

import numpy as np
import pytest
import torch

from tests.support.make_model import ModelSpec, write_model
from tests.support.oracle import LONG_TEXT, PROMPTS
from tierflow import (
    BudgetError,
    ContextLengthError,
    Engine,
    InvalidArgumentError,
    ModelFileError,
    UnsupportedModelError,
)
from tierflow.kv_types import MAX_PASS_TOKENS
from tierflow.runtime.api.embeddings import model_pooling, pass_batches

TEXTS = [*PROMPTS, "Hello", LONG_TEXT]
F32 = dict(weight_type="F32", embedding_type="F32")
POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}  # llama.cpp's enum


def llama_cpp_embeddings(path, texts: list[str], pooling_type: int | None = None) -> np.ndarray:
    """llama.cpp's normalised embeddings of texts, with an F32 KV cache; pooling_type None: the
    file's own. Its micro-batch holds the whole context: llama.cpp pools a sequence split across
    micro-batches over the last one's tokens only."""
    from llama_cpp import GGML_TYPE_F32, LLAMA_POOLING_TYPE_UNSPECIFIED, Llama

    llama = Llama(str(path), embedding=True, n_ctx=2048, n_batch=2048, n_ubatch=2048, n_threads=1,
                  verbose=False,
                  pooling_type=LLAMA_POOLING_TYPE_UNSPECIFIED if pooling_type is None else pooling_type,
                  type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    try:
        return np.array(llama.embed(texts, normalize=True), np.float32)
    finally:
        llama.close()


@pytest.fixture(scope="module")
def f32_engine(f32_model_path):
    with Engine.load(f32_model_path, threads=2, context_length=2048, kv_cache_type="f32") as engine:
        yield engine


def pooling_model(tmp_path, pooling_type: int):
    return write_model(tmp_path / f"pooling{pooling_type}.gguf",
                       ModelSpec(num_layers=2, hidden_size=64, pooling_type=pooling_type, **F32))


# -- agreement with llama.cpp ---------------------------------------------------------------------

@pytest.mark.slow
def test_embeddings_match_llama_cpp_on_an_f32_copy(f32_engine, f32_model_path):
    expected = llama_cpp_embeddings(f32_model_path, TEXTS, POOLING_TYPES["mean"])
    np.testing.assert_allclose(f32_engine.embed(TEXTS), expected, atol=1e-5)


@pytest.mark.slow
def test_input_longer_than_a_pass_matches_llama_cpp(f32_engine, f32_model_path):
    text = " ".join([LONG_TEXT] * 12)
    assert len(f32_engine.embedding_tokens(text)[0]) > MAX_PASS_TOKENS
    expected = llama_cpp_embeddings(f32_model_path, [text], POOLING_TYPES["mean"])
    np.testing.assert_allclose(f32_engine.embed(text), expected, atol=1e-5)


def test_q4_1_embeddings_agree_with_llama_cpp_within_its_activation_noise(engine, model_path):
    # llama.cpp rounds activations to 8 bits to meet Q4_1 weights: the vectors differ by ~1e-2
    # in places, yet point the same way.
    expected = llama_cpp_embeddings(model_path, TEXTS, POOLING_TYPES["mean"])
    cosines = np.sum(engine.embed(TEXTS) * expected, axis=1)
    assert cosines.min() > 0.998


@pytest.mark.parametrize("pooling", POOLING_TYPES)
def test_the_pooling_the_file_declares_matches_llama_cpp(tmp_path, pooling):
    path = pooling_model(tmp_path, POOLING_TYPES[pooling])
    with Engine.load(path, threads=2, context_length=256, kv_cache_type="f32") as engine:
        assert engine.pooling == pooling
        ours = engine.embed(TEXTS[:4])
    np.testing.assert_allclose(ours, llama_cpp_embeddings(path, TEXTS[:4]), atol=1e-5)


@pytest.mark.slow
def test_a_sliding_window_model_matches_llama_cpp(tmp_path):
    # windows seen by depth in a tree, and a ring, for an input longer than a pass
    spec = ModelSpec(arch="gemma3", num_layers=6, hidden_size=256, num_heads=4, num_kv_heads=2, head_size=64,
                     ffn_size=512, context_length=1024, sliding_window=32, **F32)
    path, texts = write_model(tmp_path / "gemma3.gguf", spec), [*TEXTS, LONG_TEXT * 8]
    with Engine.load(path, threads=2, context_length=1024, kv_cache_type="f32") as engine:
        ours = engine.embed(texts)
    np.testing.assert_allclose(ours, llama_cpp_embeddings(path, texts, POOLING_TYPES["mean"]), atol=5e-5)


def test_a_file_without_pooling_type_pools_the_mean(engine):
    assert engine.pooling == "mean"


@pytest.mark.parametrize("pooling_type", [0, 4], ids=["none", "rank"])
def test_pooling_without_one_vector_per_input_is_refused(tmp_path, pooling_type):
    with Engine.load(pooling_model(tmp_path, pooling_type), threads=2, context_length=256) as engine:
        with pytest.raises(UnsupportedModelError, match="pooling_type"):
            engine.embed("Hello")


def test_a_pooling_type_outside_llama_cpps_enum_is_a_model_file_error():
    with pytest.raises(ModelFileError, match="llama.pooling_type"):
        model_pooling({"llama.pooling_type": 9}, "llama")


# -- batching, determinism, normalisation -----------------------------------------------------------

def test_batched_embeddings_equal_one_by_one(engine):
    together = engine.embed(TEXTS)
    alone = np.concatenate([engine.embed(text) for text in TEXTS])
    np.testing.assert_array_equal(together, alone)


def test_layers_on_the_gpu_tier_give_the_same_embeddings(engine, model_path):
    # torch's CPU device stands in for the GPU: its layers and their KV cache live on that tier
    stand_in = dict(threads=2, context_length=1024, gpu_memory="60MiB", gpu_device="cpu")
    with Engine.load(model_path, **stand_in) as tiered:
        np.testing.assert_array_equal(tiered.embed(TEXTS), engine.embed(TEXTS))


@pytest.mark.slow
def test_inputs_batched_past_a_short_context_equal_one_by_one(model_path):
    texts = ["word " * 180, "other " * 180]  # each fits in the context, both together do not
    with Engine.load(model_path, threads=2, context_length=256) as short:
        together = short.embed(texts)
        np.testing.assert_array_equal(together, np.concatenate([short.embed(text) for text in texts]))


def test_inputs_are_grouped_into_passes_in_order():
    assert pass_batches([3, 4, 2, 600, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]


def test_embeddings_are_deterministic(engine):
    np.testing.assert_array_equal(engine.embed(TEXTS), engine.embed(TEXTS))


def test_embeddings_have_unit_length(engine):
    np.testing.assert_allclose(np.linalg.norm(engine.embed(TEXTS), axis=1), 1.0, atol=1e-6)


def test_unnormalised_embeddings_are_the_pooled_states_the_normalised_ones_scale(engine):
    raw = engine.embed(TEXTS, normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), engine.embed(TEXTS),
                               atol=1e-6)


def test_one_text_gives_one_row_of_the_hidden_size(engine):
    assert engine.embed("Hello").shape == (1, engine.config.hidden_size)


def test_token_ids_are_embedded_as_given(engine):
    ids = engine.embedding_tokens(TEXTS[:2])
    np.testing.assert_array_equal(engine.embed(ids), engine.embed(TEXTS[:2]))


def test_embedding_between_generations_leaves_them_unchanged(engine):
    first = engine.generate(PROMPTS[0], max_tokens=8, temperature=0)
    engine.embed(TEXTS)
    again = engine.generate(PROMPTS[0], max_tokens=8, temperature=0)
    assert again.tokens == first.tokens


def test_aembed_equals_embed(engine):
    np.testing.assert_array_equal(asyncio.run(engine.aembed(TEXTS)), engine.embed(TEXTS))


# -- bad input ---------------------------------------------------------------------------------

def test_an_empty_list_is_refused(engine):
    with pytest.raises(InvalidArgumentError, match="no input"):
        engine.embed([])


@pytest.mark.parametrize("empty", ["", []], ids=["text", "ids"])
def test_an_empty_input_is_refused_by_its_index(engine, empty):
    with pytest.raises(InvalidArgumentError, match="input 1 is empty"):
        engine.embed(["Hello", empty])


def test_an_input_longer_than_the_context_is_refused_with_its_index_and_length(engine):
    ids = [42] * (engine.context_length + 1)
    with pytest.raises(ContextLengthError, match=f"input 1 has {len(ids)} tokens but the context holds "
                                                 f"{engine.context_length}"):
        engine.embed(["Hello", ids])


@pytest.mark.parametrize("inputs, message", [
    ([["a"]], r"input 0 must be a str or token ids"),
    ([[10**9]], "outside the vocabulary"),
    ([7], "input 0 must be a str or token ids"),
    (b"bytes", "must be a str or a sequence"),
    (None, "must be a str or a sequence"),
])
def test_a_malformed_input_is_an_invalid_argument(engine, inputs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        engine.embed(inputs)


def test_normalize_must_be_a_bool(engine):
    with pytest.raises(InvalidArgumentError, match="normalize"):
        engine.embed("Hello", normalize="yes")


def test_a_gpu_out_of_memory_while_embedding_is_a_budget_error_and_the_engine_goes_on(engine,
                                                                                      monkeypatch):
    expected = engine.embed("hello")

    def out_of_memory(item):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with monkeypatch.context() as patched:
        patched.setattr(engine._generator, "run_pass", out_of_memory)
        with pytest.raises(BudgetError, match="ran out of memory in an embedding pass"):
            engine.embed("hello")
    np.testing.assert_array_equal(engine.embed("hello"), expected)
