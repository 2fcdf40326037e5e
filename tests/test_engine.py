"""The Python API on the bundled SmolLM2-135M-Instruct model."""

import os
import signal
import threading
import time

import pytest

from tierflow import Engine
from tierflow.errors import (
    BudgetError,
    ContextLengthError,
    InvalidArgumentError,
    ModelFileError,
    TierflowError,
)

GREEDY = dict(temperature=0)


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


def test_same_seed_gives_the_same_sampled_output(engine):
    first = engine.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=42)
    second = engine.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=42)
    assert first.tokens == second.tokens


def test_stream_pieces_join_to_the_generated_text(engine):
    pieces = list(engine.stream("Write a haiku about snow.", max_tokens=24, **GREEDY))
    assert "".join(pieces) == engine.generate("Write a haiku about snow.", max_tokens=24, **GREEDY).text


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


def test_ctrl_c_interrupts_and_leaves_the_engine_usable(engine):
    short = engine.tokenize("List the numbers from one to ten:")
    before = engine.generate(short, max_tokens=10, **GREEDY).tokens
    long_prompt = (engine.tokenize("word " * 2000) * 2)[: engine.context_length - 1]
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        engine.generate(long_prompt, max_tokens=1)  # a prefill of seconds: the signal lands in it
        time.sleep(10)
    timer.join()
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


def test_generation_stops_at_the_end_of_the_context(engine):
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


def test_every_error_is_a_tierflow_error():
    for error in (BudgetError, ContextLengthError, InvalidArgumentError, ModelFileError):
        assert issubclass(error, TierflowError)


def test_load_reports_progress_up_to_the_total(model_path):
    calls = []
    with Engine.load(model_path, progress=lambda *call: calls.append(call)):
        pass
    for phase in {phase for phase, _, _ in calls}:  # packing (on a first load), loading
        done = [d for p, d, _ in calls if p == phase]
        assert done == sorted(done)
    assert calls[-1][0] == "load" and calls[-1][1] == calls[-1][2] > 0


def test_resident_weights_stay_within_the_cpu_budget(model_path):
    with Engine.load(model_path, cpu_memory="600MB") as engine:
        stats = engine.generate("Hi", max_tokens=2).stats
    assert 0 < stats.peak_weight_bytes["cpu"] <= 600_000_000


def test_a_closed_engine_raises_a_clear_error(model_path):
    engine = Engine.load(model_path)
    engine.close()
    with pytest.raises(TierflowError, match="closed"):
        engine.generate("Hi", max_tokens=1)
    with pytest.raises(TierflowError, match="closed"):
        engine.logits([1])
