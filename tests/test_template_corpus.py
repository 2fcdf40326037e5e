"""Every chat template people ship renders in tierflow's sandbox exactly as Hugging Face's Jinja
setup renders it (llama-cpp-python's Jinja2ChatFormatter, which follows transformers): 786 published
templates (tests/support/real_models.py `chat_templates`), over conversations with a system message,
tools, a tool call and its result, documents, and Qwen3's enable_thinking. Where the reference
refuses a conversation (raise_exception: "System role not supported", say), tierflow's render is a
TemplateError, never another exception."""

import json

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from tests.support.real_models import chat_templates
from tierflow import TemplateError
from tierflow.runtime.text.chat_template import render_chat_template, start_render_workers

pytestmark = pytest.mark.slow  # every published template rendered by two engines

BOS, EOS = "<|bos|>", "<|eos|>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"celsius": 18}'}
ANSWER = {"role": "assistant", "content": "It is 18 degrees and clear."}
DOCUMENT = {"title": "Weather report", "text": "Paris: 18 degrees, clear skies."}

CONVERSATIONS = {  # name: (messages, extra template variables)
    "one user message": ([QUESTION], {}),
    "a system message and an answer": ([SYSTEM, QUESTION, ANSWER, QUESTION], {}),
    "tools": ([SYSTEM, QUESTION], {"tools": [WEATHER]}),
    "a tool call and its result": ([SYSTEM, QUESTION, CALL, RESULT], {"tools": [WEATHER]}),
    "documents": ([QUESTION], {"documents": [DOCUMENT]}),
    "thinking off": ([QUESTION], {"enable_thinking": False}),
}
TEMPLATES = chat_templates()


@pytest.fixture(scope="module", autouse=True)
def workers():
    start_render_workers()


def reference(formatter: Jinja2ChatFormatter | None, messages: list[dict], extra: dict) -> str | None:
    """Hugging Face's render, or None where the template refuses the conversation or fails."""
    try:
        return formatter(messages=messages, **extra).prompt
    except Exception:  # noqa: BLE001 - any failure of the template is its refusal
        return None


def ours(template: str, messages: list[dict], extra: dict) -> str | TemplateError:
    try:
        return render_chat_template(template, messages, bos_token=BOS, eos_token=EOS, time_limit_s=5.0,
                                    **extra)
    except TemplateError as error:
        return error


@pytest.fixture(scope="module")
def renders() -> dict[str, list[tuple[str, str | None, str | TemplateError]]]:
    """For each conversation: (template, the reference's render, tierflow's), a template at a time
    (each is compiled once on either side)."""
    found = {conversation: [] for conversation in CONVERSATIONS}
    for name, template in TEMPLATES.items():
        try:
            formatter = Jinja2ChatFormatter(template, eos_token=EOS, bos_token=BOS)
        except Exception:  # noqa: BLE001 - a template Hugging Face cannot compile renders nothing
            formatter = None
        for conversation, (messages, extra) in CONVERSATIONS.items():
            expected = reference(formatter, messages, extra) if formatter is not None else None
            found[conversation].append((name, expected, ours(template, messages, extra)))
    return found


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_every_published_template_renders_as_hugging_face_renders_it(renders, conversation):
    differ, refused = [], []
    for name, expected, rendered in renders[conversation]:
        if expected is None:
            assert isinstance(rendered, (str, TemplateError))  # its refusal is ours to make, or not
        elif isinstance(rendered, TemplateError):
            refused.append(f"{name}: {rendered}")
        elif rendered != expected:
            differ.append(name)
    assert not refused, f"{len(refused)} templates refused what Hugging Face renders: {refused[:5]}"
    assert not differ, f"{len(differ)} templates render differently: {differ[:10]}"


def test_the_corpus_holds_the_families_people_run():
    families = ("Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "meta-llama-Llama-3.1-8B-Instruct",
                "meta-llama-Llama-3.2-3B-Instruct", "google-gemma-2-2b-it", "unsloth-gemma-3-270m-it",
                "openai-gpt-oss-120b", "zai-org-GLM-4.5-Air", "deepseek-ai-DeepSeek-V3.1",
                "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    assert set(families) <= set(TEMPLATES)


def test_qwen3_without_thinking_opens_its_answer_with_an_empty_think_block():
    text = ours(TEMPLATES["Qwen-Qwen3-0.6B"], [QUESTION], {"enable_thinking": False})
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_llama_31_dates_its_system_prompt_and_lists_the_tools():
    text = ours(TEMPLATES["meta-llama-Llama-3.1-8B-Instruct"], [QUESTION], {"tools": [WEATHER]})
    assert "Today Date: " in text and json.dumps(WEATHER, indent=4) in text


def test_gpt_oss_writes_the_harmony_channels_of_a_tool_call():
    text = ours(TEMPLATES["openai-gpt-oss-120b"], [QUESTION, CALL, RESULT], {"tools": [WEATHER]})
    assert "to=functions.get_weather" in text and "<|channel|>commentary" in text
