"""Tool calls through the real server, driven by the official `openai` client: constrained calls
whose arguments validate against their tool's schema, streamed call deltas, tool history, and the
refusals. The bundled SmolLM2's template takes no tools, so its prompt is the generic fallback."""

import json

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.support.live_server import assert_error
from tierflow.runtime.text.tool_prompt import ToolRequest

FORECAST = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                            "parameters": FORECAST}}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
GREEDY = {"temperature": 0, "max_tokens": 60}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def client(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def only_call(reply):
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    return call


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_constrained_tool_choice_gives_a_call_whose_arguments_validate(client, tool_choice):
    reply = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                           parallel_tool_calls=False, **GREEDY)
    call = only_call(reply)
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"


def test_server_call_matches_the_python_api(client, engine):
    options = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, **GREEDY}
    expected = engine.chat(ASK, **options)
    call = only_call(client.chat.completions.create(model="any", messages=ASK, **options))
    assert [(c.name, c.arguments) for c in expected.tool_calls] == [(call.function.name,
                                                                     call.function.arguments)]


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client):
    request = {"model": "any", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
               "parallel_tool_calls": False, **GREEDY}
    whole = only_call(client.chat.completions.create(**request))
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls.values()) == [{"id": calls[0]["id"], "name": whole.function.name,
                                     "arguments": whole.function.arguments}]


def test_tool_result_in_the_history_is_rendered_into_the_prompt(client, engine):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "Sunny, 21 C, all three days"}]
    reply = client.chat.completions.create(model="any", messages=history, tools=TOOLS, **GREEDY)
    prompt = engine.tokenize_chat(history, tools=ToolRequest.from_openai(TOOLS))
    assert reply.usage.prompt_tokens == len(prompt)
    assert "Sunny, 21 C, all three days" in engine.detokenize(prompt)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_tool_choice_none_answers_in_prose_without_the_tools(client, engine):
    reply = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice="none",
                                           **GREEDY)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == engine.chat(ASK, **GREEDY).text


def test_a_call_cut_off_by_max_tokens_is_returned_as_content(client):
    reply = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=6)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content.startswith('{"tool_calls"')


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls_cut_by_max_tokens_give_the_whole_ones_with_finish_length(client, engine, stream):
    """The bundled model repeats its calls here until max_tokens: the whole ones are the answer."""
    ask = [{"role": "user", "content": "What will the weather be in Oslo and in Paris for the next 3 days?"}]
    options = {"tools": [WEATHER], "tool_choice": "required", "temperature": 0}
    tokens = engine.chat(ask, **options, max_tokens=2 * GREEDY["max_tokens"]).tokens
    # cut where the second call has begun: its name's key written, its arguments not
    cut = next(n for n in range(len(tokens)) if engine.detokenize(tokens[:n]).count('"name"') == 2)
    text = engine.detokenize(tokens)
    first, _ = json.JSONDecoder().raw_decode(text, text.index("[") + 1)
    request = {"model": "any", "messages": ask, **options, "max_tokens": cut}
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
        assert {delta.index for delta in deltas} == {0}
        calls = [("".join(delta.function.name or "" for delta in deltas),
                  "".join(delta.function.arguments or "" for delta in deltas))]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**request).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
    assert finish == "length" and not content
    assert calls == [(first["name"], json.dumps(first["arguments"], ensure_ascii=False))]


@pytest.mark.parametrize("parameters", ["city: str", {"type": "array"}])
def test_a_tool_whose_parameters_are_not_an_object_schema_is_a_400_naming_it(url, parameters):
    bad = {"type": "function", "function": {"name": "broken_tool", "parameters": parameters}}
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER, bad]})
    error = assert_error(response, 400)
    assert error["param"] == "tools" and "broken_tool" in error["message"]


def test_a_tool_choice_naming_no_offered_tool_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="any", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "launch"}})
