"""ollama's native API on the real server, driven by the official `ollama` client: chat and generate
(streamed and whole, against in-process generation), options, structured output, tools, embeddings,
the model listings, and errors in ollama's own shape."""

import json

import httpx
import jsonschema
import numpy as np
import ollama
import pytest

HI = [{"role": "user", "content": "Hi, who are you?"}]
GREEDY = {"temperature": 0, "num_predict": 8}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(url) -> ollama.Client:
    return ollama.Client(host=url)


def test_chat_matches_in_process_chat(client, engine):
    expected = engine.chat(HI, temperature=0, max_tokens=8)
    reply = client.chat(model="smollm2", messages=HI, options=GREEDY)
    assert reply.message.role == "assistant" and reply.message.content == expected.text
    assert reply.done and reply.done_reason == "length" and reply.eval_count == 8
    assert reply.prompt_eval_count == len(engine.tokenize_chat(HI)) and reply.eval_duration > 0


def test_streamed_chat_is_the_same_text_and_ends_with_its_timings(client, engine):
    expected = engine.chat(HI, temperature=0, max_tokens=8)
    chunks = list(client.chat(model="smollm2", messages=HI, options=GREEDY, stream=True))
    assert "".join(chunk.message.content for chunk in chunks) == expected.text
    assert [chunk.done for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].done_reason == "length" and chunks[-1].eval_count == 8


def test_stream_is_newline_delimited_json_by_default(url):
    body = {"model": "m", "messages": HI, "options": GREEDY}
    with httpx.stream("POST", f"{url}/api/chat", json=body) as reply:
        assert reply.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    assert lines[-1]["done"] is True and all("created_at" in line for line in lines)


def test_generate_answers_the_prompt_as_a_user_message_and_raw_as_text(client, engine):
    prompt = "The capital of France is"
    templated = engine.chat([{"role": "user", "content": prompt}], temperature=0, max_tokens=8)
    assert client.generate(model="m", prompt=prompt, options=GREEDY).response == templated.text
    raw = engine.generate(prompt, temperature=0, max_tokens=8)
    assert client.generate(model="m", prompt=prompt, raw=True, options=GREEDY).response == raw.text


def test_options_stop_and_num_predict_reach_the_sampler(client, engine):
    expected = engine.chat(HI, temperature=0, max_tokens=30, stop=["help"])
    options = {"temperature": 0, "num_predict": 30, "stop": ["help"]}
    reply = client.chat(model="m", messages=HI, options=options)
    assert reply.message.content == expected.text and reply.done_reason == "stop"


def test_format_json_schema_gives_an_answer_of_the_schema(client):
    ask = [{"role": "user", "content": "Describe a person."}]
    reply = client.chat(model="m", messages=ask, format=PERSON, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(reply.message.content), PERSON)


@pytest.mark.slow
def test_tool_calls_come_back_with_their_arguments_as_objects(client, engine):
    ask = [{"role": "user", "content": "What will the weather be in Paris?"}]
    expected = engine.chat(ask, tools=[WEATHER], temperature=0, max_tokens=60)
    reply = client.chat(model="m", messages=ask, tools=[WEATHER],
                        options={"temperature": 0, "num_predict": 60})
    calls = reply.message.tool_calls or []
    assert [(call.function.name, call.function.arguments) for call in calls] == [
        (call.name, json.loads(call.arguments)) for call in expected.tool_calls or []]


def test_a_tool_result_in_the_history_is_answered(client):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    reply = client.chat(model="m", messages=history, tools=[WEATHER], options=GREEDY)
    assert reply.done and reply.message.role == "assistant"


def test_embed_matches_in_process_embeddings(client, engine):
    reply = client.embed(model="m", input=["a cat", "a dog"])
    expected = engine.embed(["a cat", "a dog"])
    np.testing.assert_allclose(np.array(reply.embeddings), expected, rtol=1e-5, atol=1e-6)
    old = client.embeddings(model="m", prompt="a cat")
    np.testing.assert_allclose(old.embedding, reply.embeddings[0], rtol=1e-5, atol=1e-6)


def test_tags_show_ps_and_version_describe_the_served_model(client, engine):
    (tag,) = client.list().models
    assert tag.model == engine.path.stem and tag.size == engine.path.stat().st_size
    assert tag.details.family == "llama" and tag.details.quantization_level == "Q4_1"
    shown = client.show(engine.path.stem)
    assert shown.template == engine.tokenizer.chat_template and "completion" in shown.capabilities
    assert shown.details.parameter_size == "135M"
    (running,) = client.ps().models
    assert running.model == engine.path.stem and running.size > 0 and running.size_vram == 0
    assert httpx.get(f"{client._client.base_url}/api/version").json()["version"]


def test_a_load_request_with_nothing_to_answer_says_so(url):
    reply = httpx.post(f"{url}/api/generate", json={"model": "m"}).json()
    assert reply["done"] and reply["done_reason"] == "load"


@pytest.mark.parametrize("body, named", [
    ({"model": "m", "messages": HI, "options": {"mirostat": 2}}, "options.mirostat"),
    ({"model": "m", "messages": HI, "options": {"temperature": "hot"}}, "options.temperature"),
    ({"model": "m", "messages": HI, "keep_alive": "soon"}, "keep_alive"),
    ({"model": "m", "messages": [{"role": "user", "content": "What?", "images": ["aGk="]}]}, "images"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "Hi"}]}, "wizard"),
    ({"messages": HI}, "model"),
])
def test_a_bad_request_is_a_400_in_ollamas_shape_naming_the_field(url, body, named):
    reply = httpx.post(f"{url}/api/chat", json=body)
    assert reply.status_code == 400 and set(reply.json()) == {"error"} and named in reply.json()["error"]


def test_the_client_raises_ollamas_error_with_the_status(client):
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="m", messages=HI, options={"mirostat": 1})
    assert refused.value.status_code == 400 and "mirostat" in refused.value.error


def test_an_unknown_ollama_route_is_a_404_in_ollamas_shape(url):
    reply = httpx.post(f"{url}/api/pull", json={"model": "m"})
    assert reply.status_code == 404 and set(reply.json()) == {"error"}
