"""Anthropic's Messages API on the real server, driven by the official `anthropic` client: whole and
streamed answers against in-process generation, the documented event sequence, tools and tool
results, structured output, token counting, and errors in Anthropic's shape."""

import json

import anthropic
import httpx
import jsonschema
import pytest

HI = [{"role": "user", "content": "Hi, who are you?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # this client version sends no temperature of its own
WEATHER = {"name": "get_weather", "description": "The forecast for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What will the weather be in Paris?"}]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def test_message_matches_in_process_chat(client, engine):
    expected = engine.chat(HI, temperature=0, max_tokens=8)
    message = client.messages.create(model="m", max_tokens=8, messages=HI, **GREEDY)
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == expected.text
    assert message.stop_reason == "max_tokens" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.usage.input_tokens == len(engine.tokenize_chat(HI)) and message.usage.output_tokens == 8


def test_system_prompt_is_the_templates_system_message(client, engine):
    system = "You answer in French."
    expected = engine.chat([{"role": "system", "content": system}, *HI], temperature=0, max_tokens=8)
    message = client.messages.create(model="m", max_tokens=8, system=system, messages=HI, **GREEDY)
    assert message.content[0].text == expected.text


def test_stream_follows_the_documented_event_sequence(url, engine):
    expected = engine.chat(HI, temperature=0, max_tokens=8)
    body = {"model": "m", "max_tokens": 8, "messages": HI, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=body) as reply:
        events = [(event.split("\n")[0].removeprefix("event: "), json.loads(event.split("\n")[1][6:]))
                  for event in reply.read().decode().split("\n\n") if event]
    kinds = [kind for kind, _ in events]
    assert all(kind == data["type"] for kind, data in events)
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    deltas = [data["delta"]["text"] for kind, data in events if kind == "content_block_delta"]
    assert "".join(deltas) == expected.text
    finish = events[-2][1]
    assert finish["delta"]["stop_reason"] == "max_tokens" and finish["usage"]["output_tokens"] == 8


def test_the_clients_stream_helper_gives_the_whole_message(client, engine):
    expected = engine.chat(HI, temperature=0, max_tokens=8)
    with client.messages.stream(model="m", max_tokens=8, messages=HI, **GREEDY) as stream:
        assert "".join(stream.text_stream) == expected.text
        assert stream.get_final_message().stop_reason == "max_tokens"


def test_a_stop_sequence_is_named_as_the_reason(client, engine):
    expected = engine.chat(HI, temperature=0, max_tokens=30, stop=["help"])
    message = client.messages.create(model="m", max_tokens=30, messages=HI, stop_sequences=["help"], **GREEDY)
    assert message.content[0].text == expected.text
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "help")


def test_a_required_tool_is_a_tool_use_block_whose_input_validates(client):
    message = client.messages.create(model="m", max_tokens=60, messages=ASK, tools=[WEATHER],
                                     tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_a_streamed_tool_use_reassembles_to_the_whole_answers(client):
    options = {"model": "m", "max_tokens": 60, "messages": ASK, "tools": [WEATHER],
               "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, **GREEDY}
    whole = client.messages.create(**options)
    with client.messages.stream(**options) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in whole.content if b.type == "tool_use"]


def test_a_tool_result_continues_the_conversation(client, engine):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}
    messages = [*ASK, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
    called = {"id": "toolu_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    expected = engine.chat([*ASK, {"role": "assistant", "content": "", "tool_calls": [called]},
                            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}],
                           tools=[_openai(WEATHER)], temperature=0, max_tokens=8)
    message = client.messages.create(model="m", max_tokens=8, messages=messages, tools=[WEATHER], **GREEDY)
    assert "".join(b.text for b in message.content if b.type == "text") == expected.text


def test_output_config_format_gives_json_of_the_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    output_config = {"format": {"type": "json_schema", "schema": schema}}
    ask = [{"role": "user", "content": "A name?"}]
    message = client.messages.create(model="m", max_tokens=40, messages=ask, output_config=output_config,
                                     **GREEDY)
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_count_tokens_is_the_prompts_length(client, engine):
    counted = client.messages.count_tokens(model="m", messages=HI)
    assert counted.input_tokens == len(engine.tokenize_chat(HI))


@pytest.mark.parametrize("body, named", [
    ({"model": "m", "messages": HI}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [IMAGE]}]}, "image"),
    ({"model": "m", "max_tokens": 5, "messages": HI, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"model": "m", "max_tokens": 5, "messages": HI, "temperature": 3}, "temperature"),
])
def test_a_bad_request_is_a_400_in_anthropics_shape_naming_the_field(url, body, named):
    reply = httpx.post(f"{url}/v1/messages", json=body)
    assert reply.status_code == 400
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


def test_the_client_raises_anthropics_error_type(client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "assistant", "content": "Hi"}] * 0)
    assert refused.value.body["error"]["type"] == "invalid_request_error"


def _openai(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                             "parameters": tool["input_schema"]}}
