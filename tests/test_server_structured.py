"""Structured output through the server: response_format on /v1/chat/completions and
/v1/completions, driven by the official `openai` client; bad constraints are 400s naming them."""

import json

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from tests.support.live_server import assert_error
from tests.support.schemas import SCHEMAS, messages, response_format

GREEDY = {"temperature": 0, "max_tokens": 200}


@pytest.fixture(scope="module")
def client(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def validated(text: str, schema: dict) -> dict:
    document = json.loads(text)
    jsonschema.validate(document, schema)
    return document


@pytest.mark.slow
@pytest.mark.parametrize("name", SCHEMAS)
def test_chat_json_schema_answer_parses_and_validates(client, name):
    reply = client.chat.completions.create(model="any", messages=messages(name),
                                           response_format=response_format(name), **GREEDY)
    validated(reply.choices[0].message.content, SCHEMAS[name][0])
    assert reply.choices[0].finish_reason == "stop"


def test_sampled_chat_json_schema_answer_validates(client):
    reply = client.chat.completions.create(model="any", messages=messages("nested"), temperature=0.8, seed=7,
                                           response_format=response_format("nested"), max_tokens=200)
    validated(reply.choices[0].message.content, SCHEMAS["nested"][0])


@pytest.mark.slow
def test_the_constrained_answer_is_the_in_process_one(client, engine):
    expected = engine.chat(messages("refs"), response_format=response_format("refs"), **GREEDY)
    reply = client.chat.completions.create(model="any", messages=messages("refs"),
                                           response_format=response_format("refs"), **GREEDY)
    assert reply.choices[0].message.content == expected.text


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    age: int
    home: Address  # the client's strict schema puts it in $defs, behind a $ref


def test_the_clients_parse_fills_a_pydantic_model(client):
    ask = [{"role": "user", "content": "Describe a person and their home as JSON."}]
    reply = client.chat.completions.parse(model="any", messages=ask, response_format=Person, temperature=0.8,
                                          seed=3, max_tokens=200)
    assert isinstance(reply.choices[0].message.parsed, Person)


def test_streamed_json_schema_chunks_join_to_a_valid_answer(client):
    chunks = client.chat.completions.create(model="any", messages=messages("flat"), stream=True,
                                            response_format=response_format("flat"), **GREEDY)
    validated("".join(chunk.choices[0].delta.content or "" for chunk in chunks), SCHEMAS["flat"][0])


def test_completions_json_object_answer_is_a_json_object(client):
    reply = client.completions.create(model="any", prompt="A JSON object describing a cat:",
                                      extra_body={"response_format": {"type": "json_object"}},
                                      temperature=0.8, seed=5, max_tokens=200)
    assert isinstance(json.loads(reply.choices[0].text), dict) and reply.choices[0].finish_reason == "stop"


def test_max_tokens_cutting_the_json_off_finishes_with_length(client):
    reply = client.chat.completions.create(model="any", messages=messages("nested"), temperature=0,
                                           max_tokens=6, response_format=response_format("nested"))
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6


def test_an_unsupported_schema_keyword_is_a_400_naming_it(client):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="any", messages=messages("flat"),
                                       response_format=response_format(schema), **GREEDY)
    assert "'uniqueItems'" in refused.value.message and refused.value.param == "response_format"


def test_an_unsatisfiable_schema_is_a_400_saying_why(client):
    schema = {"type": "integer", "minimum": 5, "maximum": 2}
    with pytest.raises(openai.BadRequestError, match="minimum \\(5\\) is greater than maximum \\(2\\)"):
        client.completions.create(model="any", prompt="x",
                                  extra_body={"response_format": response_format(schema)})


@pytest.mark.parametrize(("shape", "problem"), [
    ("json", "response_format: Input should be a valid dictionary"),
    ({"type": "xml"}, "response_format.type must be"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema is missing"),
    (response_format({"type": "strin"}), "Invalid type: strin"),
])
def test_a_bad_response_format_is_a_400_naming_it(url, shape, problem):
    body = {"messages": messages("flat"), "max_tokens": 4, "response_format": shape}
    error = assert_error(httpx.post(f"{url}/v1/chat/completions", json=body), 400)
    assert problem in error["message"] and error["param"] == "response_format"


def test_a_response_format_with_a_required_tool_call_is_a_400(url):
    tool = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = {"messages": messages("flat"), "max_tokens": 4, "tools": [tool], "tool_choice": "required",
            "response_format": {"type": "json_object"}}
    error = assert_error(httpx.post(f"{url}/v1/chat/completions", json=body), 400)
    assert "tool_choice" in error["message"] and error["param"] == "response_format"
