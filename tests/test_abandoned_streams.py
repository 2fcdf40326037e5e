"""A stream its consumer leaves never holds the engine for good (the attack: leaving a stream early
deadlocked the engine, and cancel, gc, close and `with` exit hung too).

Each scenario runs on a thread with a deadline, so a regression fails instead of hanging the run.
"""

import gc
import threading

import pytest

from tierflow import Engine

DEADLINE_S = 60
CHAT = [{"role": "user", "content": "Tell me a long story about a dragon."}]
STORY = dict(max_tokens=64, temperature=0.8, seed=1)


def within_deadline(scenario) -> object:
    """scenario()'s result, or a failure if it has not returned within DEADLINE_S."""
    outcome = {}

    def run() -> None:
        try:
            outcome["value"] = scenario()
        except BaseException as error:  # handed to the test below
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"{scenario.__name__} hung: the engine is held for good"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@pytest.fixture
def fresh(model_path):
    with Engine.load(model_path, threads=2, context_length=256) as engine:
        yield engine


def test_breaking_out_of_a_chat_stream_leaves_the_engine_usable(fresh):
    def scenario():
        for _ in fresh.chat_stream(CHAT, **STORY):
            break
        return fresh.generate("Hi", max_tokens=2, temperature=0)

    assert within_deadline(scenario).finish_reason in ("length", "stop")


def test_returning_from_inside_a_stream_loop_leaves_the_engine_usable(fresh):
    def first_piece():
        for piece in fresh.stream("Once upon a time", **STORY):
            return piece

    def scenario():
        first_piece()
        return fresh.generate("Hi", max_tokens=2, temperature=0)

    assert within_deadline(scenario).tokens


def test_a_stream_kept_suspended_in_this_thread_is_ended_by_the_next_generation(fresh):
    def scenario():
        kept = fresh.stream("Once upon a time", **STORY)
        next(kept)
        result = fresh.generate("Hi", max_tokens=2, temperature=0)
        with pytest.raises(StopIteration):
            next(kept)
        return kept.result, result

    kept, result = within_deadline(scenario)
    assert kept.finish_reason == "cancelled" and kept.tokens and result.tokens


def test_logits_after_a_suspended_stream_in_this_thread_does_not_wait_for_it(fresh):
    def scenario():
        kept = fresh.stream("Once upon a time", **STORY)
        next(kept)
        return fresh.logits(fresh.tokenize("Hello world"))

    assert within_deadline(scenario).shape[0] == len(fresh.tokenize("Hello world"))


def test_cancel_ends_a_suspended_stream_and_frees_the_engine_for_other_threads(fresh):
    kept = fresh.stream("Once upon a time", **STORY)
    next(kept)
    fresh.cancel()
    assert within_deadline(lambda: fresh.generate("Hi", max_tokens=2, temperature=0)).tokens
    assert kept.result.finish_reason == "cancelled" and list(kept) == []


def test_gc_collect_after_dropping_a_suspended_stream_frees_the_engine(fresh):
    def scenario():
        kept = fresh.stream("Once upon a time", **STORY)
        next(kept)
        del kept
        gc.collect()
        return fresh.generate("Hi", max_tokens=2, temperature=0)

    assert within_deadline(scenario).tokens


@pytest.mark.parametrize("how", ["close", "with"])
def test_closing_the_engine_with_a_suspended_stream_returns(model_path, how):
    def scenario():
        if how == "with":
            with Engine.load(model_path, threads=2, context_length=256) as engine:
                kept = engine.stream("Once upon a time", **STORY)
                next(kept)
        else:
            engine = Engine.load(model_path, threads=2, context_length=256)
            kept = engine.stream("Once upon a time", **STORY)
            next(kept)
            engine.close()
        return kept.result

    assert within_deadline(scenario).finish_reason == "cancelled"


def test_a_stream_suspended_in_another_thread_is_waited_for_not_ended(fresh):
    """Only the thread a stream waits for cannot resume it: another thread's generation queues."""
    kept = fresh.stream("Once upon a time", max_tokens=8, temperature=0)
    first = next(kept)
    waiting = threading.Thread(target=lambda: fresh.generate("Hi", max_tokens=2, temperature=0))
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive()  # queued behind the suspended stream
    rest = "".join(kept)
    waiting.join(DEADLINE_S)
    assert not waiting.is_alive() and kept.result.finish_reason == "length"
    assert first + rest == kept.result.text
