"""Chat on real files whose templates take tools (Qwen2.5-Coder 0.5B and 1.5B): through the Python
API, the CLI and the server with the official openai client, tool calls included, as a user would."""

import json

import openai
import pytest

from tests.support.cli import run_tierflow
from tests.support.live_server import running_server
from tierflow import Engine

GREEDY = {"temperature": 0, "max_tokens": 48}  # room for a call: 20-30 tokens
ANSWER = {"temperature": 0, "max_tokens": 32}  # enough for the code answer to reach its "def "
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CODE = [{"role": "system", "content": "You are a helpful coding assistant."},
        {"role": "user", "content": "Write a Python function that returns the square of a number."}]


@pytest.fixture(scope="module", params=["qwen_05b_path", "qwen_15b_path"])
def real_path(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def qwen(real_path):
    with Engine.load(real_path, threads=2, context_length=2048) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(qwen):
    with running_server(qwen) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_answers_through_the_api(qwen):
    result = qwen.chat(CODE, **ANSWER)
    assert result.finish_reason in ("stop", "length")
    assert "def " in result.text


def test_chat_streams_the_same_answer_as_it_returns(qwen):
    stream = qwen.chat_stream(CODE, **ANSWER)
    assert "".join(stream) == qwen.chat(CODE, **ANSWER).text


def test_chat_answers_through_the_server(client):
    reply = client.chat.completions.create(model="any", messages=CODE, **ANSWER)
    assert "def " in reply.choices[0].message.content


def test_chat_answers_through_the_cli(qwen_05b_path):
    done = run_tierflow("run", "--chat", "-m", str(qwen_05b_path), "--threads", "2", "--temperature", "0",
                        "-n", "24", "--json", CODE[1]["content"])
    assert done.returncode == 0, done.stderr
    assert "def " in json.loads(done.stdout)["text"]


def test_the_interactive_chat_answers_each_line(qwen_05b_path):
    done = run_tierflow("chat", "-m", str(qwen_05b_path), "--threads", "2", "--temperature", "0", "-n", "16",
                        input="Say hello.\nNow say goodbye.\n")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and done.stdout.strip()


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED])
def test_the_server_returns_the_models_tool_call(client, tool_choice):
    reply = client.chat.completions.create(model="any", messages=QUESTION, tools=[WEATHER],
                                           tool_choice=tool_choice, **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_tool_call_arrives_as_a_call(client):
    chunks = list(client.chat.completions.create(model="any", messages=QUESTION, tools=[WEATHER],
                                                 tool_choice="required", stream=True, **GREEDY))
    calls = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_history_with_a_tool_call_and_its_result_is_answered(client):
    """(What the answer says is the model's: the 1.5B file calls the tool again, as llama.cpp's greedy
    answer on the same prompt does.)"""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 18, "sky": "clear"}'}]
    reply = client.chat.completions.create(model="any", messages=history, tools=[WEATHER], **GREEDY)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason in ("stop", "tool_calls")
    assert message.content or message.tool_calls


def test_chat_template_kwargs_reach_the_template(qwen):
    marked = qwen.tokenize_chat(QUESTION, chat_template_kwargs={"add_vision_id": True, "documents": []})
    assert marked == qwen.tokenize_chat(QUESTION)  # variables the template does not read change nothing
    custom = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with Engine.load(qwen.path, threads=2, context_length=256, chat_template=custom) as engine:
        ids = engine.tokenize_chat(QUESTION, chat_template_kwargs={"greeting": "Bonjour. "})
        assert engine.tokenizer.decode(ids) == "Bonjour. " + QUESTION[0]["content"]


@pytest.mark.parametrize("kwargs, message", [({"messages": []}, "cannot set messages"),
                                             ([1, 2], "valid dictionary")])
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(client, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message) as raised:
        client.chat.completions.create(model="any", messages=QUESTION,
                                       extra_body={"chat_template_kwargs": kwargs})
    assert raised.value.body["param"] == "chat_template_kwargs"
