"""A full context is not the end of a conversation: generation stops at the context's end with
finish_reason "length" on every path, the oldest turns of a conversation that outgrows the context
are dropped by one rule (runtime/generation/context_shift.py), and the KV cache is shifted, not refilled."""

import asyncio
import logging

import httpx
import pytest

from tests.support.live_server import assert_error, running_server
from tierflow import Engine
from tierflow.errors import ContextLengthError
from tierflow.runtime.generation.context_shift import CUT_MARK, answer_room, fit_chat

GREEDY = {"temperature": 0}
COUNTING = "1, 2, 3, 4, 5, 6,"  # greedy continues it past any small context
REPEATING = "red, green, blue, red, green, blue, red, green, blue,"
SMALL_CONTEXT = 64


@pytest.fixture(scope="module")
def small(model_path):
    with Engine.load(model_path, threads=2, context_length=SMALL_CONTEXT) as engine:
        yield engine


def plain(engine: Engine):
    return engine.generate(COUNTING, max_tokens=1000, **GREEDY)


def streamed(engine: Engine):
    stream = engine.stream(COUNTING, max_tokens=1000, **GREEDY)
    assert "".join(stream) == stream.result.text
    return stream.result


def awaited(engine: Engine):
    return asyncio.run(engine.agenerate(COUNTING, max_tokens=1000, **GREEDY))


@pytest.mark.parametrize("run", [plain, streamed, awaited])
def test_generation_that_reaches_the_context_end_finishes_with_length(small, run):
    result = run(small)
    assert result.finish_reason == "length"
    assert result.stats.prompt_tokens + len(result.tokens) == SMALL_CONTEXT


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculative_generation_that_reaches_the_context_end_finishes_with_length(model_path, draft):
    # a repeating list that the prompt's own n-grams predict, or the target as its own draft: guesses
    # are accepted, so passes of many tokens reach the end (counting defeats n-gram lookup)
    with Engine.load(model_path, threads=2, context_length=SMALL_CONTEXT,
                     draft=model_path if draft == "model" else draft) as engine:
        result = engine.generate(REPEATING, max_tokens=1000, **GREEDY)
    assert result.finish_reason == "length" and result.stats.accepted_tokens > 0
    assert result.stats.prompt_tokens + len(result.tokens) == SMALL_CONTEXT


# -- the rule: which messages are kept ---------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a terse assistant who answers in one sentence."}


def turn(number: int) -> list[dict]:
    return [{"role": "assistant", "content": f"Answer {number}: the castle's {number} towers stand on a "
                                             f"hill above the river, built of grey stone."},
            {"role": "user", "content": f"Question {number + 1}: tell me about tower {number + 1}."}]


def conversation(num_turns: int) -> list[dict]:
    first = {"role": "user", "content": "Question 1: tell me about the castle."}
    return [SYSTEM, first] + [message for n in range(1, num_turns + 1) for message in turn(n)]


def test_a_conversation_that_fits_is_sent_whole(engine):
    messages = conversation(3)
    fitted = fit_chat(messages, engine.tokenize_chat, 1024, max_tokens=100)
    assert fitted.messages == messages and not fitted.shifted
    assert fitted.prompt_ids == engine.tokenize_chat(messages)


def test_the_fewest_oldest_turns_are_dropped_keeping_the_system_prompt_and_first_message(engine):
    messages = conversation(8)
    context = len(engine.tokenize_chat(messages)) // 2 + 50
    fitted = fit_chat(messages, engine.tokenize_chat, context, max_tokens=50)
    dropped = len(fitted.dropped) // 2  # turns: an answer and the question after it
    assert fitted.dropped == range(2, 2 + 2 * dropped) and dropped > 0
    assert fitted.messages == messages[:2] + messages[2 + 2 * dropped:]
    assert len(fitted.prompt_ids) + 50 <= context
    one_fewer = messages[:2] + messages[2 * dropped:]
    assert len(engine.tokenize_chat(one_fewer)) + 50 > context


def test_what_is_kept_still_alternates_user_and_assistant(engine):
    messages = conversation(8)
    fitted = fit_chat(messages, engine.tokenize_chat, 250, max_tokens=50)
    roles = [message["role"] for message in fitted.messages[1:]]
    assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]


def test_a_tool_call_is_dropped_with_its_results(engine):
    call = [{"role": "assistant", "content": "Looking it up."},
            {"role": "tool", "content": "The castle has " + "many towers, " * 20}]
    messages = conversation(1)[:2] + call + conversation(4)[2:]
    fitted = fit_chat(messages, engine.tokenize_chat, len(engine.tokenize_chat(messages)) - 10, max_tokens=8)
    assert fitted.dropped == range(2, 6)  # the call, its result, the answer from it, the next question


def test_the_answer_gets_max_tokens_or_a_quarter_of_the_context():
    assert answer_room(256, 1000) == 64
    assert answer_room(256, 10) == 10
    assert answer_room(256) == 64


def test_an_answer_too_long_for_the_next_turn_loses_its_start(engine):
    story = " ".join(f"Day {n}: the knights rode on." for n in range(60))
    messages = [SYSTEM, {"role": "user", "content": "Tell a story."},
                {"role": "assistant", "content": story}, {"role": "user", "content": "Go on."}]
    fitted = fit_chat(messages, engine.tokenize_chat, 300, max_tokens=50)
    answer = fitted.messages[2]["content"]
    assert fitted.cut_chars > 0 and answer == CUT_MARK + story[fitted.cut_chars:]
    assert len(fitted.prompt_ids) + 50 <= 300
    assert fitted.messages[:2] == messages[:2] and fitted.messages[3] == messages[3]


def test_kept_messages_that_leave_no_room_are_a_context_length_error(engine):
    long_first = [SYSTEM, {"role": "user", "content": "hello " * 400}]
    with pytest.raises(ContextLengthError, match="the first user message and the last turn are kept"):
        fit_chat(long_first, engine.tokenize_chat, 256)


# -- the KV cache: shifted, not refilled -------------------------------------------------------


def chat_turns(engine: Engine, questions: list[str], context_shift: bool) -> list:
    """A conversation fitted turn by turn as `tierflow chat` fits it; each turn's stats."""
    messages, stats = [SYSTEM], []
    for question in questions:
        fitted = fit_chat(messages + [{"role": "user", "content": question}], engine.tokenize_chat,
                          engine.context_length, max_tokens=40)
        result = engine.generate(fitted.prompt_ids, max_tokens=40, context_shift=context_shift, **GREEDY)
        messages = fitted.messages + [{"role": "assistant", "content": result.text}]
        stats.append((fitted, result.stats))
    return stats


QUESTIONS = ["Name a colour.", "Name a fruit.", "Name a tree.", "Name a bird.", "Name a fish.",
             "Name a city.", "Name a river.", "Name a planet.", "Name a flower.", "Name a mountain."]


@pytest.mark.slow
def test_a_turn_that_drops_the_oldest_turns_prefills_only_what_is_new(model_path):
    # the answers' lengths, which decide when the context fills, are those of an f32 cache
    with Engine.load(model_path, threads=2, context_length=256, kv_cache_type="f32") as engine:
        turns = chat_turns(engine, QUESTIONS, context_shift=True)
        question = len(engine.tokenize_chat([SYSTEM, {"role": "user", "content": QUESTIONS[-1]}]))
    shifted = [(fitted, stats) for fitted, stats in turns if fitted.dropped]
    assert shifted, "the conversation never outgrew the context"
    for fitted, stats in shifted:
        # what is computed: the new question and its framing (the system prompt is not)
        assert stats.prompt_tokens - stats.cached_prompt_tokens < question


# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_url(model_path):
    with Engine.load(model_path, threads=2, context_length=256) as engine:
        with running_server(engine) as base:
            yield base, engine


def long_chat(**fields) -> dict:
    return {"messages": conversation(12), "max_tokens": 8, **GREEDY, **fields}


def test_the_chat_route_drops_the_oldest_turns_of_a_long_conversation_and_says_so(small_url, caplog):
    url, engine = small_url
    expected = fit_chat(conversation(12), engine.tokenize_chat, 256, max_tokens=8)
    with caplog.at_level(logging.WARNING, logger="tierflow.server.routes"):
        response = httpx.post(f"{url}/v1/chat/completions", json=long_chat(), timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["X-Context-Shift"] == f"dropped {len(expected.dropped)} messages"
    assert response.json()["usage"]["prompt_tokens"] == len(expected.prompt_ids)
    assert f"context shift: dropped {len(expected.dropped)} messages of a conversation of 26" in caplog.text


def test_a_streamed_answer_says_so_too(small_url):
    url, _ = small_url
    response = httpx.post(f"{url}/v1/chat/completions", json=long_chat(stream=True), timeout=60)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert response.headers["X-Context-Shift"].startswith("dropped ")


def test_a_conversation_that_fits_gets_no_context_shift_header(small_url):
    url, _ = small_url
    response = httpx.post(f"{url}/v1/chat/completions", json={**long_chat(), "messages": conversation(1)},
                          timeout=60)
    assert response.status_code == 200 and "X-Context-Shift" not in response.headers


def test_a_conversation_whose_kept_messages_do_not_fit_is_still_400(small_url):
    url, _ = small_url
    messages = [SYSTEM, {"role": "user", "content": "hello " * 400}] + conversation(2)[2:]
    response = httpx.post(f"{url}/v1/chat/completions", json={**long_chat(), "messages": messages},
                          timeout=60)
    assert_error(response, 400, "context_length_exceeded")


def test_a_server_without_context_shift_refuses_a_long_conversation_as_openai_does(small_url):
    _, engine = small_url
    with running_server(engine, context_shift=False) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=long_chat(), timeout=60)
    assert_error(response, 400, "context_length_exceeded")
