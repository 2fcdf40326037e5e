"""The OpenAI-compatible server, started for real on loopback: the official `openai` client for
the happy paths (checked against in-process generation), raw HTTP for every refusal."""

import json
import time

import httpx
import numpy as np
import pytest
from openai import OpenAI
from typer.testing import CliRunner

from tests.support.live_server import (
    LONG_COMPLETION,
    assert_error,
    read_until_text,
    running_server,
    slot_held,
)
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.cli.app import app
from tierflow.errors import InvalidArgumentError
from tierflow.offload.gguf.reader import read_gguf
from tierflow.runtime.sampling.sampler import Sampler

KEY = "test-key"
MAX_TOKENS_LIMIT = LONG_COMPLETION["max_tokens"]
ORIGIN = "http://app.example"
HI = [{"role": "user", "content": "Hi, who are you?"}]
GREEDY = {"temperature": 0, "max_tokens": 6}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def guarded_url(engine):
    """An API key, CORS for one origin, small body, max_tokens and prompt limits, and no queue."""
    with running_server(engine, api_key=KEY, cors_origins=(ORIGIN,), max_body_bytes=2000,
                        max_tokens_limit=MAX_TOKENS_LIMIT, max_queued=0, max_prompt_chars=100) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat_body(**fields) -> dict:
    return {"messages": HI, **GREEDY, **fields}


def sse_events(response: httpx.Response) -> list[str]:
    return [event.removeprefix("data: ") for event in response.text.split("\n\n") if event]


# -- the openai client --------------------------------------------------------------------------

def test_chat_completion_matches_in_process_chat(client, engine):
    expected = engine.chat(HI, **GREEDY)
    reply = client.chat.completions.create(model="any", messages=HI, **GREEDY)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.id.startswith("chatcmpl-") and reply.model == engine.path.stem


def test_chat_completion_reports_usage_and_timings(client, engine):
    reply = client.chat.completions.create(model="any", messages=HI, **GREEDY)
    prompt_tokens = len(engine.tokenize_chat(HI))
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == GREEDY["max_tokens"]
    assert reply.usage.total_tokens == prompt_tokens + GREEDY["max_tokens"]
    assert reply.model_extra["tierflow"]["decode_seconds"] > 0


def test_streamed_chat_completion_matches_in_process_chat(client, engine):
    expected = engine.chat(HI, **GREEDY)
    chunks = list(client.chat.completions.create(model="any", messages=HI, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == expected.text
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.tokens)


def test_completion_matches_in_process_generate(client, engine):
    expected = engine.generate("The capital of France is", **GREEDY)
    reply = client.completions.create(model="any", prompt="The capital of France is", **GREEDY)
    assert reply.choices[0].text == expected.text and reply.id.startswith("cmpl-")
    assert reply.usage.prompt_tokens == expected.stats.prompt_tokens


def test_max_tokens_0_answers_nothing_cut_by_length(client):
    reply = client.completions.create(model="any", prompt="The capital of France is", temperature=0,
                                      max_tokens=0)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == ("", "length")
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model="any", messages=HI, stream=True, temperature=0,
                                                 max_completion_tokens=0))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_lists_the_model_file_stem(client, engine):
    assert [model.id for model in client.models.list()] == [engine.path.stem]


def test_model_card_by_id(client, url, engine):
    assert client.models.retrieve(engine.path.stem).id == engine.path.stem
    assert_error(httpx.get(f"{url}/v1/models/other-model"), 404, "model_not_found")


def test_stop_string_ends_the_answer(client, engine):
    full = engine.chat(HI, **GREEDY).text
    stop = full.split()[2]
    reply = client.chat.completions.create(model="any", messages=HI, stop=stop, **GREEDY)
    assert reply.choices[0].message.content == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_text_parts_read_like_a_string(client, engine):
    parts = [{"role": "user", "content": [{"type": "text", "text": HI[0]["content"]}]}]
    reply = client.chat.completions.create(model="any", messages=parts, **GREEDY)
    assert reply.choices[0].message.content == engine.chat(HI, **GREEDY).text


# -- raw HTTP -----------------------------------------------------------------------------------

def test_unknown_fields_are_ignored(url):
    body = chat_body(frequency_penalty=0, user="me", some_future_field={"x": 1})
    assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200


def test_stream_is_server_sent_events_ending_in_done(url):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", **GREEDY, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events) and events[-1] == "data: [DONE]"


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'["a list"]', None),
    (b'{"max_tokens": 4}', "messages"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "hi"}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', "n"),
])
def test_invalid_request_is_400(url, body, param):
    response = httpx.post(f"{url}/v1/chat/completions", content=body, headers=JSON)
    assert assert_error(response, 400)["param"] == param


def test_a_message_of_an_unknown_role_is_a_400_naming_it(url):
    body = {"messages": [*HI, {"role": "robot", "content": "hi"}], **GREEDY}
    error = assert_error(httpx.post(f"{url}/v1/chat/completions", json=body), 400)
    assert "messages[1] has the role 'robot'" in error["message"] and error["param"] == "messages"


def test_a_developer_message_is_a_system_message(client, engine):
    developer = [{"role": "developer", "content": "Answer in French."}, *HI]
    reply = client.chat.completions.create(model="any", messages=developer, **GREEDY)
    system = [{"role": "system", "content": "Answer in French."}, *HI]
    assert reply.choices[0].message.content == engine.chat(system, **GREEDY).text


@pytest.mark.parametrize("setting", [{"top_p": 2}, {"temperature": -1}, {"seed": -5}])
def test_out_of_range_sampling_is_400(url, setting):
    assert_error(httpx.post(f"{url}/v1/chat/completions", json=chat_body(**setting)), 400)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_the_context_is_400(url, stream):
    messages = [{"role": "user", "content": "hello " * 1500}]
    response = httpx.post(f"{url}/v1/chat/completions", json=chat_body(messages=messages, stream=stream))
    assert_error(response, 400, "context_length_exceeded")


def test_completion_prompt_over_the_context_is_400(url):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hello " * 1500, **GREEDY})
    assert_error(response, 400, "context_length_exceeded")


def test_unknown_route_is_404(url):
    assert_error(httpx.get(f"{url}/v1/nothing"), 404)


def test_wrong_method_is_405(url):
    assert_error(httpx.get(f"{url}/v1/chat/completions"), 405)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1:1", "localhost"])
def test_foreign_host_header_is_refused(url, host):
    port = url.rsplit(":", 1)[1]
    response = httpx.get(f"{url}/health", headers={"Host": host.format(port=port)})
    assert_error(response, 403, "host_not_allowed")


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost", "[::1]"])
def test_loopback_host_names_are_accepted(url, name):
    port = url.rsplit(":", 1)[1]
    assert httpx.get(f"{url}/v1/models", headers={"Host": f"{name}:{port}"}).status_code == 200


@pytest.mark.parametrize("auth", [None, "Bearer wrong", KEY, f"Bearer {KEY.upper()}", f"Basic {KEY}"])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                          ("POST", "/v1/completions"), ("GET", "/v1/nothing")])
def test_missing_or_wrong_api_key_is_401(guarded_url, auth, method, path):
    headers = {"Authorization": auth} if auth else {}
    response = httpx.request(method, f"{guarded_url}{path}", headers=headers, json=chat_body())
    assert_error(response, 401, "invalid_api_key")


def test_right_api_key_is_accepted(guarded_url):
    response = httpx.get(f"{guarded_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr"])
def test_bearer_scheme_is_case_insensitive(guarded_url, scheme):
    response = httpx.get(f"{guarded_url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert response.status_code == 200


def test_health_needs_no_api_key(guarded_url):
    assert httpx.get(f"{guarded_url}/health").json() == {"status": "ok"}


def test_max_tokens_past_the_context_ends_the_answer_at_its_end(model_path):
    with Engine.load(model_path, context_length=64, threads=1) as short, running_server(short) as base:
        no_end = {str(token): -100 for token in short.tokenizer.eog_ids}
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": "1, 2, 3, 4,", "temperature": 0,
                                                           "max_tokens": 5000, "logit_bias": no_end})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"
    assert reply.json()["usage"]["total_tokens"] == 64


def test_max_tokens_above_the_server_limit_is_400(guarded_url):
    body = chat_body(max_tokens=MAX_TOKENS_LIMIT + 1)
    response = httpx.post(f"{guarded_url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert assert_error(response, 400)["param"] == "max_tokens"


def test_body_over_the_limit_is_413(guarded_url):
    body = chat_body(messages=[{"role": "user", "content": "x" * 3000}])
    response = httpx.post(f"{guarded_url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert_error(response, 413)


def test_chunked_body_over_the_limit_is_413(guarded_url):
    chunks = (b" " * 500 for _ in range(6))  # no Content-Length: the bytes read are counted
    response = httpx.post(f"{guarded_url}/v1/chat/completions", content=chunks,
                          headers={"Authorization": f"Bearer {KEY}", **JSON})
    assert_error(response, 413)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonl"])
def test_body_that_is_not_json_is_415(url, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(chat_body()), headers=headers)
    assert_error(response, 415, "unsupported_media_type")


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_content_type_parameters_and_case_are_accepted(url, content_type):
    response = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(chat_body()),
                          headers={"Content-Type": content_type})
    assert response.status_code == 200


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1"])
def test_foreign_origin_is_403(url, origin):
    # A web page's form-like POST: a CORS "simple request", sent without a preflight.
    response = httpx.post(f"{url}/v1/completions", content=json.dumps({"prompt": "Hi", "max_tokens": 1}),
                          headers={"Origin": origin, "Content-Type": "text/plain"})
    assert_error(response, 403, "origin_not_allowed")


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost"])
def test_own_origin_is_allowed(url, name):
    own = url.replace("127.0.0.1", name)
    response = httpx.post(f"{own}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                          headers={"Origin": own})
    assert response.status_code == 200


def test_listed_origin_is_allowed(guarded_url):
    response = httpx.post(f"{guarded_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                          headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.parametrize("prompt", ["", [""], []])
def test_empty_prompt_is_400(url, prompt):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert assert_error(response, 400)["param"] == "prompt"


def test_token_id_prompt_over_the_context_is_400(url, engine):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * (engine.context_length + 1)})
    assert assert_error(response, 400, "context_length_exceeded")["param"] == "prompt"


def test_prompt_character_limit_is_a_setting(guarded_url):
    response = httpx.post(f"{guarded_url}/v1/completions", json={"prompt": "a" * 101, "max_tokens": 1},
                          headers={"Authorization": f"Bearer {KEY}"})
    assert "100" in assert_error(response, 400, "prompt_too_long")["message"]


@pytest.fixture(scope="module")
def damaged_url(tmp_path_factory):
    """A server over a model whose output norm is NaN, let past the load's check of the weights (as a
    value that overflows in a pass would come): every logit is NaN, and sampling refuses them."""
    from tierflow.offload.pack.layout import TensorDecoder

    path = write_model(tmp_path_factory.mktemp("damaged") / "nan.gguf",
                       ModelSpec(weight_type="F32", embedding_type="F32"))
    with read_gguf(path) as model:
        at = model.tensors["output_norm.weight"].offset
    with open(path, "r+b") as file:
        file.seek(at)
        file.write(np.full(8, np.nan, np.float32).tobytes())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TensorDecoder, "_finite", lambda self, tensor, values, first=0: values)
        damaged = Engine.load(path, threads=1, context_length=128)
    with damaged, running_server(damaged) as base:
        yield base


def test_error_mid_stream_ends_it_with_an_error_event(damaged_url):
    response = httpx.post(f"{damaged_url}/v1/chat/completions", json=chat_body(stream=True))
    events = sse_events(response)
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    error = json.loads(events[-1])["error"]
    assert error["type"] == "server_error" and "non-finite logits" in error["message"]


def test_a_damaged_model_in_a_whole_answer_is_an_openai_500(damaged_url):
    response = httpx.post(f"{damaged_url}/v1/chat/completions", json=chat_body())
    error = assert_error(response, 500)
    assert error["type"] == "server_error" and "non-finite logits" in error["message"]


def test_an_internal_error_is_an_openai_500_without_its_details(url, monkeypatch):
    def broken(self, logits, history=()):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(Sampler, "sample", broken)
    error = assert_error(httpx.post(f"{url}/v1/chat/completions", json=chat_body()), 500)
    assert error["type"] == "server_error" and "secret" not in error["message"]


def test_cors_headers_only_for_listed_origins(url, guarded_url):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(f"{guarded_url}/v1/chat/completions", headers=preflight)
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{guarded_url}/v1/chat/completions", headers={**preflight, "Origin": "http://x.example"})
    assert "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in httpx.get(f"{url}/health", headers={"Origin": ORIGIN}).headers


def test_request_beyond_the_queue_is_503(guarded_url):
    headers = {"Authorization": f"Bearer {KEY}"}
    with slot_held(guarded_url, headers):
        busy = httpx.post(f"{guarded_url}/v1/chat/completions", json=chat_body(), headers=headers)
    assert_error(busy, 503, "server_busy")


def test_health_answers_during_a_generation(url):
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG_COMPLETION) as running:
        lines = running.iter_lines()
        read_until_text(lines)
        assert httpx.get(f"{url}/health", timeout=2).status_code == 200
        read_until_text(lines)  # still generating


def test_disconnect_mid_stream_cancels_the_generation(url):
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG_COMPLETION) as abandoned:
        read_until_text(abandoned.iter_lines())
    start = time.perf_counter()  # 500 tokens take tens of seconds; a cancelled run frees the engine
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
    assert response.status_code == 200 and time.perf_counter() - start < 5


def test_disconnect_while_waiting_for_a_whole_answer_cancels_it(url):
    body = {**LONG_COMPLETION, "stream": False}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{url}/v1/completions", json=body, timeout=1)
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
    assert response.status_code == 200 and time.perf_counter() - start < 5


def test_disconnect_while_waiting_for_a_whole_answer_logs_no_error(url, server_errors):
    body = {**LONG_COMPLETION, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=1)
    # Answered once the abandoned generation has let go of the engine, so after its handler ended.
    httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
    assert [record.getMessage() for record in server_errors] == []


def test_root_serves_the_chat_page(url):
    response = httpx.get(f"{url}/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")


@pytest.mark.parametrize("option", [["--port", "70000"], ["--max-prompt-chars", "0"]])
def test_serve_command_checks_settings_before_loading(option):
    result = CliRunner().invoke(app, ["serve", *option])
    assert isinstance(result.exception, InvalidArgumentError)
