"""The server never blocks its event loop on request work: a prompt is rendered and tokenized on a
worker thread, and only once the character limit and the queue have admitted it; under a flood of
hostile and normal requests, /health keeps answering within 100 ms."""

import asyncio
import json

import httpx
import pytest

from tests.support.live_server import assert_error, running_server, serve_command, slot_held
from tests.support.load_clients import Body, HealthPoller, send_at_once
from tierflow.server.generations import CHARS_PER_POSITION

HEALTH_BOUND_S = 0.1  # the task's bound on a health check's latency, send to answer
POLL_EVERY_S = 0.03
# llama.cpp splits special tokens in quadratic time: tokenizing this took 15 s.
QUADRATIC_PROMPT = "<|im_end|>a" * 50_000
ONE_CHAR_MESSAGES = [{"role": "user", "content": "a"}] * 25_000
NORMAL_CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0,
               "max_tokens": 16}


@pytest.fixture(scope="module")
def no_queue_url(engine):
    with running_server(engine, max_queued=0) as base:
        yield base


def on_event_loop() -> bool:
    """Whether the calling thread is running an asyncio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def tokenizer_calls(engine, monkeypatch) -> list[bool]:
    """One entry per chat-template render or tokenize the engine does: whether it ran on the event
    loop's thread."""
    calls = []
    for name in ("apply_chat_template", "encode"):
        real = getattr(engine.tokenizer, name)

        def spy(*args, real=real, **kwargs):
            calls.append(on_event_loop())
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.tokenizer, name, spy)
    return calls


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
])
def test_prompts_are_tokenized_off_the_event_loop(url, tokenizer_calls, path, body):
    assert httpx.post(f"{url}{path}", json=body).status_code == 200
    assert tokenizer_calls and not any(tokenizer_calls)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": QUADRATIC_PROMPT}),
    ("/v1/chat/completions", {"messages": ONE_CHAR_MESSAGES}),  # each message counts its template's text
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 9000}] * 2}),
])
def test_prompt_over_the_character_limit_is_refused_before_tokenizing(url, engine, tokenizer_calls, path,
                                                                       body):
    error = assert_error(httpx.post(f"{url}{path}", json=body), 400, "prompt_too_long")
    assert str(CHARS_PER_POSITION * engine.context_length) in error["message"] and tokenizer_calls == []


def test_full_queue_refuses_before_tokenizing(no_queue_url, tokenizer_calls):
    with slot_held(no_queue_url):
        tokenizer_calls.clear()
        busy = httpx.post(f"{no_queue_url}/v1/chat/completions", json={"messages": ONE_CHAR_MESSAGES[:50]})
    assert_error(busy, 503, "server_busy")
    assert tokenizer_calls == []


def chunks_past_one_megabyte() -> list[bytes]:
    """A chunked body (no Content-Length) of 1.2 MB: only the bytes read reveal its size."""
    return [b" " * 100_000] * 12


def flood_requests() -> list[tuple[str, Body, int]]:
    """(path, body, expected status): the attacks, with the normal requests they must not starve."""
    def body(fields: dict) -> bytes:  # encoded before the flood: the client's work is not the server's
        return json.dumps(fields).encode()

    return [
        ("/v1/completions", body({"prompt": QUADRATIC_PROMPT}), 400),
        ("/v1/chat/completions", body({"messages": ONE_CHAR_MESSAGES}), 400),
        # Under the character limit: tokenized (quadratically, on a worker thread), then too long.
        ("/v1/completions", body({"prompt": "<|im_end|>a" * 1400}), 400),
        # A megabyte of items that are all invalid: refused at the first, not one error per item.
        ("/v1/chat/completions", body({"messages": [{"role": "user", "content": [[]] * 240_000}]}), 400),
        ("/v1/chat/completions", b" " * 1_000_001, 413),
        ("/v1/chat/completions", chunks_past_one_megabyte(), 413),
        *[("/v1/chat/completions", body(NORMAL_CHAT), 200)] * 4,
    ]


def health_latencies_under_a_flood() -> list[float]:
    """Floods `tierflow serve` while a client polls /health; each poll's latency, send to answer.
    The server runs as users run it, in its own process, and so do the clients: the test process's
    threads and garbage collections do not compete with the server for the CPU."""
    requests = flood_requests()
    with serve_command("--ctx", "1024", "--threads", "2") as url, HealthPoller(url, POLL_EVERY_S) as poller:
        statuses = send_at_once(url, [(path, body) for path, body, _ in requests])
    assert statuses == [expected for _, _, expected in requests]
    assert set(poller.statuses) == {200} and len(poller.latencies) >= 5
    return poller.latencies


@pytest.mark.slow
def test_health_answers_within_100_ms_under_a_flood():
    # On this 2-core machine the slowest poll takes 20-45 ms; a machine shared with other jobs
    # once stalled one past 100 ms. A server that blocks its loop is slow in both floods, a stall
    # of the machine in one: the second flood tells them apart.
    latencies = health_latencies_under_a_flood()
    if max(latencies) >= HEALTH_BOUND_S:
        latencies = health_latencies_under_a_flood()
    assert max(latencies) < HEALTH_BOUND_S, sorted(latencies)[-5:]
