"""OpenAI's Responses API on the real server, driven by the official `openai` client: answers against
in-process generation, the documented event sequence, previous_response_id, function calls and
their outputs, structured output, and the refusals."""

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

HI = [{"role": "user", "content": "Hi, who are you?"}]
WEATHER = {"type": "function", "name": "get_weather", "description": "The forecast for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_response_matches_in_process_chat(client, engine):
    expected = engine.chat([{"role": "system", "content": "Be brief."}, *HI], temperature=0, max_tokens=8)
    response = client.responses.create(model="m", input="Hi, who are you?", instructions="Be brief.",
                                       max_output_tokens=8, temperature=0)
    assert response.output_text == expected.text and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8 and response.usage.input_tokens == expected.stats.prompt_tokens


def test_stream_follows_the_documented_event_sequence(client, engine):
    expected = engine.chat(HI, temperature=0, max_tokens=8)
    events = list(client.responses.create(model="m", input=HI, max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == expected.text


def test_previous_response_id_continues_the_conversation(client, engine):
    first = client.responses.create(model="m", input=HI, max_output_tokens=8, temperature=0)
    follow = [{"role": "user", "content": "And what can you do?"}]
    expected = engine.chat([*HI, {"role": "assistant", "content": first.output_text}, *follow], temperature=0,
                           max_tokens=8)
    second = client.responses.create(model="m", input=follow, previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.output_text == expected.text and second.previous_response_id == first.id


def test_an_unknown_previous_response_is_a_clear_400(client):
    with pytest.raises(BadRequestError) as refused:
        client.responses.create(model="m", input="Hi", previous_response_id="resp_unknown")
    assert "previous_response_id" in str(refused.value)


def test_a_required_function_is_a_call_item_and_its_output_is_answered(client):
    ask = "What will the weather be in Paris?"
    response = client.responses.create(model="m", input=ask, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    (call,) = [item for item in response.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = client.responses.create(model="m", input=[output], previous_response_id=response.id,
                                     tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert answer.output[0].type == "message" and answer.usage.input_tokens > response.usage.input_tokens


def test_streamed_function_call_arguments_match_the_done_event(client):
    events = list(client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=60, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments and events[-1].type == "response.completed"


def test_text_format_json_schema_gives_json_of_the_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "n", "schema": schema}}
    response = client.responses.create(model="m", input="A name?", max_output_tokens=40, temperature=0,
                                       text=text)
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("body, named", [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input_image"),
    ({"model": "m", "input": "Hi", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"model": "m", "input": "Hi", "background": True}, "background"),
])
def test_a_bad_request_is_a_400_naming_the_field(url, body, named):
    reply = httpx.post(f"{url}/v1/responses", json=body)
    assert reply.status_code == 400 and named in reply.json()["error"]["message"]
