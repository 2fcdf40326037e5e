"""The Python API on the bundled SmolLM2-135M-Instruct model."""

import gc
import os
import signal
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

from tests.support.budgets import ram_beside_weights
from tests.support.damage import copy_patched
from tests.support.gguf_bytes import FLOAT32, INT32, Typed
from tests.support.gguf_writing import encoded_kvs, rewrite_metadata
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.errors import (
    BudgetError,
    ContextLengthError,
    InvalidArgumentError,
    ModelFileError,
    TierflowError,
)
from tierflow.offload.gguf.reader import read_gguf
from tierflow.runtime.generation.token_loop import PREFILL_CHUNK

GREEDY = dict(temperature=0)
IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def test_generate_returns_text_tokens_and_stats(engine):
    result = engine.generate("The capital of France is", max_tokens=8, **GREEDY)
    assert result.text == engine.detokenize(result.tokens)
    assert 0 < len(result.tokens) <= 8
    stats = result.stats
    assert stats.prompt_tokens == len(engine.tokenize("The capital of France is"))
    assert stats.generated_tokens == len(result.tokens)
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    assert stats.peak_weight_bytes["cpu"] > 0


def test_max_tokens_ends_generation_with_reason_length(engine):
    result = engine.generate("Count: one, two, three,", max_tokens=5, **GREEDY)
    assert len(result.tokens) == 5 and result.finish_reason == "length"


def test_max_tokens_0_reads_the_prompt_and_generates_nothing(engine):
    """llama.cpp's n_predict 0: the prompt is evaluated (into the cache), no token is generated."""
    result = engine.generate("Count: one, two, three,", max_tokens=0, **GREEDY)
    assert (result.text, result.tokens, result.finish_reason) == ("", [], "length")
    assert result.stats.generated_tokens == 0 and result.stats.prompt_tokens > 0
    stream = engine.chat_stream([{"role": "user", "content": "Hi"}], max_tokens=0, **GREEDY)
    assert list(stream) == [] and stream.result.tokens == []


def test_same_seed_gives_the_same_sampled_output(engine):
    first = engine.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=42)
    second = engine.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=42)
    assert first.tokens == second.tokens


def test_stream_pieces_join_to_the_generated_text(engine):
    pieces = list(engine.stream("Write a haiku about snow.", max_tokens=24, **GREEDY))
    assert "".join(pieces) == engine.generate("Write a haiku about snow.", max_tokens=24, **GREEDY).text


@pytest.mark.slow
def test_a_stream_reports_its_prefill_progress_chunk_by_chunk_before_its_first_piece(engine):
    engine.generate(".", max_tokens=1)  # nothing of the prompt below is cached
    stream = engine.stream("word " * 600, max_tokens=1, **GREEDY)
    total, reported = len(stream.prompt_ids), []
    stream.on_prefill = lambda done, of: reported.append((done, of))
    next(stream)
    assert reported == [(0, total), (PREFILL_CHUNK, total), (total, total)]


def test_stop_string_ends_the_text_before_it(engine):
    full = engine.generate("Count: one, two, three,", max_tokens=16, **GREEDY).text
    stop = full.strip().split()[1]
    result = engine.generate("Count: one, two, three,", max_tokens=16, stop=[stop], **GREEDY)
    assert stop not in result.text and result.finish_reason == "stop"
    assert full.startswith(result.text)


def test_chat_applies_the_template_and_answers(engine):
    result = engine.chat([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=32, **GREEDY)
    assert "4" in result.text
    assert result.finish_reason == "stop"  # ended by <|im_end|>, not by the token limit


def test_chat_stream_matches_chat(engine):
    messages = [{"role": "user", "content": "Name a color."}]
    streamed = "".join(engine.chat_stream(messages, max_tokens=16, **GREEDY))
    assert streamed == engine.chat(messages, max_tokens=16, **GREEDY).text


def test_next_chat_turn_reuses_the_cached_prefix_and_answers_the_same(engine):
    messages = [{"role": "user", "content": "Say hello."}]
    first = engine.chat(messages, max_tokens=12, **GREEDY)
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "Now say goodbye."}]
    warm = engine.chat(messages, max_tokens=12, **GREEDY)
    engine.logits([50, 60])  # replaces the cache with tokens no chat prompt starts with
    cold = engine.chat(messages, max_tokens=12, **GREEDY)
    assert warm.stats.cached_prompt_tokens > 0 and cold.stats.cached_prompt_tokens == 0
    assert warm.tokens == cold.tokens


def test_tokenize_detokenize_round_trip(engine):
    text = "Grüße, 世界! 🚀"
    assert engine.detokenize(engine.tokenize(text, add_bos=False)) == text


def test_logits_has_a_row_per_token(engine):
    ids = engine.tokenize("Hello there")
    assert engine.logits(ids).shape == (len(ids), engine.config.vocab_size)


def test_cancel_from_another_thread_returns_partial_result(engine):
    stream = engine.stream("Tell me a very long story.", max_tokens=2000, temperature=1.0, seed=1, stop=None)
    for i, _ in enumerate(stream):
        if i == 2:  # the generation waits at its third piece while another thread cancels it
            canceller = threading.Thread(target=engine.cancel)
            canceller.start()
            canceller.join()
    result = stream.result
    assert result.finish_reason == "cancelled"
    assert 0 < len(result.tokens) < 2000
    assert engine.generate("Hi", max_tokens=3, **GREEDY).tokens  # still usable


def test_ctrl_c_interrupts_and_leaves_the_engine_usable(engine, monkeypatch):
    short = engine.tokenize("List the numbers from one to ten:")
    before = engine.generate(short, max_tokens=10, **GREEDY).tokens
    long_prompt = (engine.tokenize("word " * 2000) * 2)[: engine.context_length - 1]
    decoder, layers_run = engine._generator.decoder, []
    block = decoder.block

    def interrupted_midway(x, w, p):  # Ctrl-C lands while the prefill's first pass is half done
        layers_run.append(p.layer_idx)
        if len(layers_run) == engine.config.num_layers // 2:
            os.kill(os.getpid(), signal.SIGINT)
        return block(x, w, p)

    monkeypatch.setattr(decoder, "block", interrupted_midway)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(long_prompt, max_tokens=1)
    assert len(layers_run) == engine.config.num_layers // 2  # the pass stopped where the signal came
    monkeypatch.undo()
    assert engine.generate(short, max_tokens=10, **GREEDY).tokens == before


def test_threads_calling_one_engine_queue_and_get_correct_results(engine):
    prompts = ["One", "Two", "Three"]
    expected = {p: engine.generate(p, max_tokens=8, **GREEDY).tokens for p in prompts}
    results = {}

    def worker(p):
        results[p] = engine.generate(p, max_tokens=8, **GREEDY).tokens

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


def test_prompt_longer_than_the_context_is_rejected(engine):
    with pytest.raises(ContextLengthError, match="context"):
        engine.generate([1] * (engine.context_length + 1), max_tokens=1)


def test_generation_stops_at_the_end_of_the_context(model_path):
    # a short context: filling the shared engine's 1024 positions would cost a long prefill
    with Engine.load(model_path, threads=2, context_length=64) as engine:
        prompt = [1] * (engine.context_length - 3)
        result = engine.generate(prompt, max_tokens=50, **GREEDY)
    assert len(result.tokens) <= 3


@pytest.mark.parametrize("bad", [[-1], [10**9]])
def test_token_ids_outside_the_vocabulary_are_rejected(engine, bad):
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        engine.generate(bad, max_tokens=1)


def test_negative_max_tokens_is_rejected(engine):
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        engine.generate("Hi", max_tokens=-1)


def test_missing_model_file_is_a_model_file_error(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        Engine.load(tmp_path / "nope.gguf")


def test_directory_is_a_model_file_error(tmp_path):
    with pytest.raises(ModelFileError, match="directory"):
        Engine.load(tmp_path)


def test_non_gguf_file_is_a_model_file_error(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("just some text, long enough to hold a header " * 4)
    with pytest.raises(ModelFileError):
        Engine.load(path)


def test_unreadable_memory_size_is_a_budget_error(model_path):
    with pytest.raises(BudgetError, match="lots"):
        Engine.load(model_path, cpu_memory="lots")


def test_cpu_budget_smaller_than_the_weights_is_refused(model_path):
    with pytest.raises(BudgetError, match="cpu_memory"):
        Engine.load(model_path, cpu_memory="10MB")


def test_gpu_budget_without_a_gpu_is_refused(model_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(BudgetError, match="GPU"):
        Engine.load(model_path, gpu_memory="1GiB")


@pytest.mark.parametrize("threads", [0, -2, "two"])
def test_bad_thread_count_is_rejected(model_path, threads):
    with pytest.raises(InvalidArgumentError, match="threads"):
        Engine.load(model_path, threads=threads)


def test_every_error_the_readme_names_is_importable_from_tierflow():
    import tierflow

    for name in ("TierflowError", "ModelFileError", "UnsupportedModelError", "BudgetError",
                 "ContextLengthError", "TemplateError", "InvalidArgumentError"):
        assert issubclass(getattr(tierflow, name), tierflow.TierflowError) and name in tierflow.__all__


def test_every_error_is_a_tierflow_error():
    for error in (BudgetError, ContextLengthError, InvalidArgumentError, ModelFileError):
        assert issubclass(error, TierflowError)


def test_weights_stay_within_a_cpu_budget_that_binds(model_path):
    with Engine.load(model_path, threads=2, context_length=128) as engine:
        everything = engine.weights.bytes_by_tier()["cpu"]
    budget = everything * 3 // 4  # a quarter of the layers' bytes must stream
    cpu_memory = budget + ram_beside_weights(model_path, 128)
    with Engine.load(model_path, threads=2, context_length=128, cpu_memory=cpu_memory) as engine:
        stats = engine.generate("Hi", max_tokens=2).stats
        assert engine.plan.streamed_layers and engine.weights.bytes_by_tier()["disk"] > 0
    assert 0 < stats.peak_weight_bytes["cpu"] <= budget


def test_a_closed_engine_raises_a_clear_error(model_path):
    engine = Engine.load(model_path)
    engine.close()
    with pytest.raises(TierflowError, match="closed"):
        engine.generate("Hi", max_tokens=1)
    with pytest.raises(TierflowError, match="closed"):
        engine.logits([1])


def test_closing_an_engine_twice_is_harmless(model_path):
    engine = Engine.load(model_path)
    engine.close()
    engine.close()
    with pytest.raises(TierflowError, match="closed"):
        engine.tokenize("Hi")


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_closed_engine_frees_its_weights_while_the_object_lives_on(model_path, parallel):
    engine = Engine.load(model_path, parallel=parallel)
    engine.generate("Hi", max_tokens=2)
    weights = weakref.ref(engine.weights)
    engine.close()
    gc.collect()
    assert weights() is None


# -- bad arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", [], np.array([], np.int64)])
def test_an_empty_prompt_is_refused_when_the_model_adds_no_bos(engine, prompt):
    with pytest.raises(InvalidArgumentError, match="the prompt is empty"):
        engine.generate(prompt, max_tokens=1)


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory) -> Path:
    """A tiny random model whose weights are all F32 (with quantized weights the CPU kernels round
    activations to 8 bits, which a NaN does not survive)."""
    return write_model(tmp_path_factory.mktemp("f32") / "tiny.gguf",
                       ModelSpec(tied_embeddings=False, embedding_type="F32", weight_type="F32"))


def test_an_empty_text_prompt_is_just_bos_when_the_model_adds_one(f32_model, tmp_path):
    entry = encoded_kvs(f32_model)["tokenizer.ggml.add_bos_token"]  # ends with its bool's byte
    at = f32_model.read_bytes().index(entry) + len(entry) - 1
    with Engine.load(copy_patched(f32_model, tmp_path / "bos.gguf", at, b"\x01"), threads=2) as engine:
        result = engine.generate("", max_tokens=3, **GREEDY)
        assert result.stats.prompt_tokens == 1
        assert result.tokens == engine.generate([engine.tokenizer.bos_id], max_tokens=3, **GREEDY).tokens


@pytest.fixture(scope="module")
def damaged_model(f32_model, tmp_path_factory) -> tuple[Path, int]:
    """A copy of f32_model whose embedding row of one token, the second that IDS generates, is
    NaN, and that token: greedy generation from IDS meets it in its second decode step."""
    with Engine.load(f32_model, threads=2) as engine:
        bad = engine.generate(IDS, max_tokens=2, **GREEDY).tokens[1]
    with read_gguf(f32_model) as gguf:
        embedding = gguf.tensors["token_embd.weight"]
    hidden_size = embedding.shape[0]
    nan_row = np.full(hidden_size, np.nan, np.float32).tobytes()
    dest = tmp_path_factory.mktemp("damaged") / "damaged.gguf"
    return copy_patched(f32_model, dest, embedding.offset + bad * hidden_size * 4, nan_row), bad


def test_a_file_with_a_nan_weight_is_refused_at_load_naming_the_tensor(damaged_model):
    with pytest.raises(ModelFileError, match="tensor 'token_embd.weight' holds a value that is not a finite"):
        Engine.load(damaged_model[0], threads=2)


@pytest.fixture
def unchecked(monkeypatch):
    """Lets non-finite weights past the load's check, as a value that overflows in a pass would come:
    what the sampler's own check must catch."""
    from tierflow.offload.pack.layout import TensorDecoder

    monkeypatch.setattr(TensorDecoder, "_finite", lambda self, tensor, values, first=0: values)


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_non_finite_logits_are_a_model_file_error(damaged_model, unchecked, temperature):
    path, bad = damaged_model
    with Engine.load(path, threads=2) as engine:
        with pytest.raises(ModelFileError, match="non-finite logits.*damaged"):
            engine.generate([*IDS, bad], max_tokens=2, temperature=temperature, seed=0)


def test_the_engine_generates_as_before_after_non_finite_logits(f32_model, damaged_model, unchecked):
    def first_tokens(engine: Engine) -> tuple[list[int], list[int]]:
        return (engine.generate(IDS, max_tokens=1, **GREEDY).tokens,
                engine.generate([700, 800, 900], max_tokens=8, **GREEDY).tokens)

    with Engine.load(f32_model, threads=2) as engine:
        expected = first_tokens(engine)
    with Engine.load(damaged_model[0], threads=2) as engine:
        with pytest.raises(ModelFileError):
            engine.generate(IDS, max_tokens=4, **GREEDY)  # fails in a decode step, the cache holding IDS
        assert first_tokens(engine) == expected


def test_a_tiny_temperature_generates_the_greedy_tokens(engine):
    greedy = engine.generate(IDS, max_tokens=8, **GREEDY).tokens
    # greedy has no repetition penalty by default; sampling does: the tiny temperature is all that differs
    assert engine.generate(IDS, max_tokens=8, temperature=1e-320, repeat_penalty=1.0, seed=0).tokens == greedy


@pytest.mark.parametrize(
    "prompt",
    [pytest.param(np.array([1.0, 2.0]), id="float-array"), pytest.param(np.array([[1, 2]]), id="2-D-array"),
     pytest.param(np.array([True]), id="bool-array"), pytest.param(b"hello", id="bytes"),
     pytest.param(bytearray(b"hi"), id="bytearray"), pytest.param(["1"], id="str-ids"),
     pytest.param([True, 2], id="bool-id"), pytest.param([1.0], id="float-id"),
     pytest.param({1, 2}, id="set"), pytest.param(None, id="None"), pytest.param(7, id="int")],
)
def test_a_prompt_that_is_neither_text_nor_token_ids_is_refused(engine, prompt):
    with pytest.raises(InvalidArgumentError, match="^prompt must be text .* or token ids"):
        engine.generate(prompt, max_tokens=1)


@pytest.mark.parametrize("prompt", ["\ud800", "ok \udcff"])
def test_text_that_cannot_be_encoded_as_utf8_is_refused(engine, prompt):
    with pytest.raises(InvalidArgumentError, match="prompt cannot be encoded as UTF-8"):
        engine.generate(prompt, max_tokens=1)


@pytest.mark.parametrize(
    "ids",
    [pytest.param(np.array(IDS), id="int64-array"), pytest.param(np.array(IDS, np.uint16), id="uint16-array"),
     pytest.param([np.int32(i) for i in IDS], id="numpy-ints"), pytest.param(tuple(IDS), id="tuple")],
)
def test_integer_arrays_and_numpy_integers_are_token_ids(engine, ids):
    expected = engine.generate(IDS, max_tokens=4, **GREEDY).tokens
    assert engine.generate(ids, max_tokens=4, **GREEDY).tokens == expected


@pytest.mark.parametrize(
    "keywords, name",
    [(dict(temperature="0.5"), "temperature"), (dict(temperature=float("nan")), "temperature"),
     (dict(top_p=float("inf")), "top_p"), (dict(top_k=1.5), "top_k"), (dict(seed="abc"), "seed"),
     (dict(stop=5), "stop"), (dict(stop=[b"x"]), "stop"), (dict(stop=["x", None]), "stop"),
     (dict(max_tokens=None), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"),
     (dict(max_tokens=True), "max_tokens"), (dict(temprature=1), "'temprature'")],
)
def test_a_bad_generation_keyword_is_an_invalid_argument_error_naming_it(engine, keywords, name):
    with pytest.raises(InvalidArgumentError, match=name):
        engine.generate("Hi", **{"max_tokens": 1, **keywords})


@pytest.mark.parametrize("method", ["logits", "detokenize"])
@pytest.mark.parametrize("ids", ["hello", b"hi", [1.5], [True], ["1"], None, np.array([1.5])])
def test_ids_that_are_not_token_ids_are_refused(engine, method, ids):
    with pytest.raises(InvalidArgumentError, match="^ids must be token ids"):
        getattr(engine, method)(ids)


@pytest.mark.parametrize("text", [5, b"hello", None, ["hello"]])
def test_tokenize_refuses_what_is_not_text(engine, text):
    with pytest.raises(InvalidArgumentError, match="^text must be a str"):
        engine.tokenize(text)


def test_tokenize_refuses_an_add_bos_that_is_not_a_bool(engine):
    with pytest.raises(InvalidArgumentError, match="add_bos"):
        engine.tokenize("Hi", add_bos="yes")


def test_a_chat_message_that_cannot_be_encoded_as_utf8_is_refused(engine):
    with pytest.raises(InvalidArgumentError, match="cannot be encoded as UTF-8"):
        engine.chat([{"role": "user", "content": "\ud800"}], max_tokens=1)


@pytest.mark.parametrize("messages, refused", [
    ([{"role": "robot", "content": "hi"}], r"messages\[0\] has the role 'robot'"),
    ([{"role": "user", "content": "hi"}, {"role": "User", "content": "hi"}],
     r"messages\[1\] has the role 'User'"),
    ([{"role": "function", "content": "{}"}], r"messages\[0\] has the role 'function'"),
])
def test_a_chat_message_of_an_unknown_role_is_refused_naming_it(engine, messages, refused):
    with pytest.raises(InvalidArgumentError, match=refused + ".*system, user, assistant, tool, developer"):
        engine.tokenize_chat(messages)
    with pytest.raises(InvalidArgumentError, match=refused):
        engine.chat(messages, max_tokens=1)


def test_every_role_of_openais_messages_is_taken(engine):
    roles = ["system", "developer", "user", "assistant", "tool", "user"]
    assert engine.tokenize_chat([{"role": role, "content": "hi"} for role in roles])


def test_the_model_files_recommended_sampling_is_what_a_generation_defaults_to(model_path, tmp_path):
    recommended = {"general.sampling.temp": Typed(FLOAT32, 0.0), "general.sampling.top_k": Typed(INT32, 5)}
    path = rewrite_metadata(model_path, tmp_path / "greedy.gguf", recommended)
    with Engine.load(path, threads=2, context_length=128) as engine:
        assert engine.sampling_defaults == {"temperature": 0.0, "top_k": 5}
        greedy = engine.generate("Once upon a time", max_tokens=12, temperature=0, seed=1).tokens
        assert engine.generate("Once upon a time", max_tokens=12, seed=2).tokens == greedy
        assert engine.generate("Once upon a time", max_tokens=12, seed=2, temperature=2.0).tokens != greedy
