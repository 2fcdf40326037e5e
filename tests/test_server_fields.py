"""The server's sampling fields against a real server: logprobs (chat and legacy completions,
whole and streamed), logit_bias and the penalties, with the official `openai` client; and every
OpenAI field the server does not honour is a 400 naming it."""

import httpx
import numpy as np
import pytest
from openai import OpenAI

from tests.support.live_server import assert_error

HI = [{"role": "user", "content": "Hi, who are you?"}]
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def client(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_chat_logprobs_match_the_engines(client, engine):
    expected = engine.chat(HI, **GREEDY, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(model="any", messages=HI, logprobs=True, top_logprobs=3, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert [item.logprob for item in content] == pytest.approx([e.logprob for e in expected.logprobs])
    assert [item.bytes for item in content] == [list(e.bytes) for e in expected.logprobs]
    assert "".join(item.token for item in content) == reply.choices[0].message.content


def test_chat_top_logprobs_are_sorted_and_sum_to_at_most_one(client):
    reply = client.chat.completions.create(model="any", messages=HI, logprobs=True, top_logprobs=5, **GREEDY)
    for item in reply.choices[0].logprobs.content:
        top = [alternative.logprob for alternative in item.top_logprobs]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert np.exp(top).sum() <= 1 + 1e-9
        assert item.token == item.top_logprobs[0].token  # greedy


def test_streamed_chat_chunks_carry_their_tokens_logprobs(client):
    whole = client.chat.completions.create(model="any", messages=HI, logprobs=True, top_logprobs=2, **GREEDY)
    chunks = list(client.chat.completions.create(model="any", messages=HI, logprobs=True, top_logprobs=2,
                                                 stream=True, **GREEDY))
    streamed = [item for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == \
        [(i.token, i.logprob) for i in whole.choices[0].logprobs.content]
    for chunk in chunks:
        choice = chunk.choices[0] if chunk.choices else None
        if choice and choice.delta.content:
            assert "".join(item.token for item in choice.logprobs.content) == choice.delta.content


def test_chat_without_logprobs_has_none(client):
    assert client.chat.completions.create(model="any", messages=HI, **GREEDY).choices[0].logprobs is None


def test_completion_logprobs_have_the_legacy_shape(client, engine):
    expected = engine.generate("The capital of France is", **GREEDY, logprobs=True, top_logprobs=2)
    reply = client.completions.create(model="any", prompt="The capital of France is", logprobs=2, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [e.text for e in expected.logprobs]
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs])
    assert [len(top) for top in logprobs.top_logprobs] == [2] * len(expected.logprobs)
    text, starts = reply.choices[0].text, zip(logprobs.text_offset, logprobs.tokens)
    assert all(text[offset:].startswith(token) for offset, token in starts)


def test_streamed_completion_offsets_count_from_the_start(client):
    chunks = list(client.completions.create(model="any", prompt="The capital of France is", logprobs=0,
                                            stream=True, **GREEDY))
    logprobs = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices[0].logprobs]
    offsets = [offset for item in logprobs for offset in item.text_offset]
    tokens = [token for item in logprobs for token in item.tokens]
    text = "".join(chunk.choices[0].text for chunk in chunks)
    assert len(tokens) == GREEDY["max_tokens"]
    assert offsets == sorted(offsets) and all(text[o:].startswith(t) for o, t in zip(offsets, tokens))


def test_logit_bias_forces_a_token(client, engine):
    forced = engine.tokenize(" Rome", add_bos=False)[0]
    reply = client.completions.create(model="any", prompt="The capital of France is", temperature=0,
                                      max_tokens=3, logit_bias={str(forced): 100})
    assert reply.choices[0].text == " Rome" * 3


@pytest.mark.slow
def test_penalties_reach_the_engine(client, engine):
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "max_tokens": 48}
    expected = engine.chat(HI, **GREEDY | penalties)
    assert expected.text != engine.chat(HI, **GREEDY | {"max_tokens": 48}).text  # they change the answer
    reply = client.chat.completions.create(model="any", messages=HI, **GREEDY | penalties)
    assert reply.choices[0].message.content == expected.text


@pytest.mark.parametrize("setting, param", [
    ({"frequency_penalty": 3}, None),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, None),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_sampling_field_is_400_naming_it(url, setting, param):
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": HI, **GREEDY, **setting})
    error = assert_error(response, 400)
    assert error["param"] == param and next(iter(setting)) in error["message"]


CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"], "n": 2,
    "prediction": {"type": "content", "content": "x"}, "verbosity": "low",
    "web_search_options": {}, "store": True, "service_tier": "flex",
    "functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
    "stream_options": {"include_obfuscation": True}, "moderation": {"policy": {"input": {"mode": "block"}}},
    "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "1h"},
}
COMPLETIONS_REFUSED = {"best_of": 2, "suffix": "end", "echo": True, "n": 3}


def test_an_unknown_reasoning_effort_is_a_400_naming_the_levels(url):
    body = {"messages": HI, **GREEDY, "reasoning_effort": "extreme"}
    error = assert_error(httpx.post(f"{url}/v1/chat/completions", json=body), 400)
    assert error["param"] == "reasoning_effort" and "minimal, low, medium, high" in error["message"]


@pytest.mark.parametrize("field", CHAT_REFUSED)
def test_unhonoured_chat_field_is_400_naming_it(url, field):
    body = {"messages": HI, **GREEDY, field: CHAT_REFUSED[field]}
    if field == "stream_options":
        body["stream"] = True
    error = assert_error(httpx.post(f"{url}/v1/chat/completions", json=body), 400, "unsupported_parameter")
    assert error["param"].split(".")[0] == field and field in error["message"]


@pytest.mark.parametrize("field", COMPLETIONS_REFUSED)
def test_unhonoured_completions_field_is_400_naming_it(url, field):
    body = {"prompt": "Hello", **GREEDY, field: COMPLETIONS_REFUSED[field]}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "unsupported_parameter")
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("field, value", [
    ("n", 1), ("store", False), ("modalities", ["text"]), ("service_tier", "auto"), ("user", "u-1"),
    ("metadata", {"k": "v"}), ("safety_identifier", "s-1"), ("prompt_cache_key", "chat-7"),
    ("prompt_cache_retention", "in_memory"),
])
def test_field_asking_for_nothing_is_accepted(client, field, value):
    reply = client.chat.completions.create(model="any", messages=HI, **GREEDY, extra_body={field: value})
    assert reply.choices[0].message.content


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f-1"}},
])
def test_content_part_that_is_not_text_is_400_naming_its_type(url, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, **GREEDY})
    error = assert_error(response, 400, "unsupported_content")
    assert part["type"] in error["message"] and error["param"] == "messages"


def test_text_content_parts_are_served(client, engine):
    parts = [{"type": "text", "text": "Hi, who "}, {"type": "text", "text": "are you?"}]
    messages = [{"role": "user", "content": parts}]
    reply = client.chat.completions.create(model="any", messages=messages, **GREEDY)
    assert reply.choices[0].message.content == engine.chat(HI, **GREEDY).text
