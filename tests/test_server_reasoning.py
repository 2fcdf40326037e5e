"""A thinking model's reasoning, split from its answer in every API: OpenAI chat's
reasoning_content, ollama's thinking, Anthropic's thinking block, a Responses reasoning item. The
bundled model answers under a template that opens a `<think>` block for it, as DeepSeek R1's does,
so its whole answer is reasoning; reasoning_effort reaches the template as gpt-oss's level."""

import anthropic
import ollama
import pytest
from openai import OpenAI

from tests.support.live_server import running_server
from tierflow import Engine

HI = [{"role": "user", "content": "Hi, who are you?"}]
# ChatML whose generation prompt opens the reasoning; past answers lose theirs, as R1's template does.
OPENS_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
    "{% endfor %}{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "<|im_end|>\n{% endif %}<|im_start|>assistant\n<think>\n")


@pytest.fixture(scope="module")
def thinking(model_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "opens_thinking.jinja"
    template.write_text(OPENS_THINKING)
    with Engine.load(model_path, chat_template=template, context_length=512, threads=1) as engine:
        with running_server(engine) as base:
            yield engine, base


@pytest.fixture(scope="module")
def reasoning(thinking) -> str:
    engine, _ = thinking
    return engine.chat(HI, temperature=0, max_tokens=8).text.lstrip()


def test_openai_chat_gives_reasoning_content_apart_from_the_content(thinking, reasoning):
    client = OpenAI(base_url=f"{thinking[1]}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="m", messages=HI, temperature=0, max_tokens=8)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning and message.content == ""
    chunks = client.chat.completions.create(model="m", messages=HI, temperature=0, max_tokens=8, stream=True)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == reasoning
    assert not "".join(d.content or "" for d in deltas)


def test_ollama_gives_the_reasoning_as_thinking(thinking, reasoning):
    client = ollama.Client(host=thinking[1])
    reply = client.chat(model="m", messages=HI, options={"temperature": 0, "num_predict": 8})
    assert reply.message.thinking == reasoning and reply.message.content == ""
    options = {"temperature": 0, "num_predict": 8}
    streamed = list(client.chat(model="m", messages=HI, options=options, stream=True))
    assert "".join(chunk.message.thinking or "" for chunk in streamed) == reasoning


def test_anthropic_gives_a_thinking_block(thinking, reasoning):
    client = anthropic.Anthropic(base_url=thinking[1], api_key="x", max_retries=0)
    message = client.messages.create(model="m", max_tokens=8, messages=HI, extra_body={"temperature": 0})
    assert [block.type for block in message.content] == ["thinking"]
    assert message.content[0].thinking == reasoning
    greedy = {"extra_body": {"temperature": 0}}
    with client.messages.stream(model="m", max_tokens=8, messages=HI, **greedy) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == reasoning


def test_responses_give_a_reasoning_item(thinking, reasoning):
    client = OpenAI(base_url=f"{thinking[1]}/v1", api_key="x", max_retries=0)
    response = client.responses.create(model="m", input=HI, max_output_tokens=8, temperature=0)
    assert response.output[0].type == "reasoning" and response.output[0].content[0].text == reasoning


def test_reasoning_effort_reaches_the_template_instead_of_a_400(thinking):
    client = OpenAI(base_url=f"{thinking[1]}/v1", api_key="x", max_retries=0)
    plain = client.chat.completions.create(model="m", messages=HI, max_tokens=1)
    effort = client.chat.completions.create(model="m", messages=HI, max_tokens=1, reasoning_effort="low")
    assert effort.usage.prompt_tokens > plain.usage.prompt_tokens
