"""A thinking model's reasoning split from its answer (runtime/text/reasoning.py), piece by piece
as the server streams it."""

import pytest

from tests.support.real_models import chat_templates
from tierflow.runtime.text.chat_template import render_chat_template
from tierflow.runtime.text.reasoning import (
    HarmonyStream,
    ReasoningStream,
    opened_in_prompt,
    reasoning_stream,
    split_whole,
    thinks,
)
from tierflow.runtime.text.tool_calls import ToolFormat, parse_tool_calls


def streamed(pieces: list[str], inside: bool = False, stream=None) -> tuple[str, str, list[tuple[str, str]]]:
    stream, sent = stream or ReasoningStream(inside), []
    for piece in pieces:
        split = stream.push(piece)
        sent.append((split.reasoning, split.content))
    tail = stream.finish()
    sent.append((tail.reasoning, tail.content))
    return stream.reasoning, stream.content, sent


def test_a_leading_think_block_is_the_reasoning_and_the_rest_the_answer():
    split = split_whole(ReasoningStream(), "<think>\nWeigh it.\n</think>\n\nYes.")
    assert (split.reasoning, split.content) == ("Weigh it.\n", "Yes.")


def test_tags_cut_across_pieces_are_held_until_known():
    reasoning, content, sent = streamed(["<th", "ink>ab", "c</th", "ink>", "\n\nYes", "."])
    assert (reasoning, content) == ("abc", "Yes.")
    assert not any("<" in part for pair in sent for part in pair)


def test_an_answer_without_a_block_is_all_content_and_sent_at_once():
    reasoning, content, sent = streamed(["Hello", " <think> is a tag"])
    assert (reasoning, content) == ("", "Hello <think> is a tag") and sent[0] == ("", "Hello")


def test_a_block_the_template_opened_makes_the_answer_start_inside_it():
    assert streamed(["plan", "</think>answer"], inside=True)[:2] == ("plan", "answer")
    assert opened_in_prompt("<|Assistant|><think>\n") and not opened_in_prompt("<|Assistant|>")


def test_an_unclosed_block_is_all_reasoning():
    assert streamed(["<think>still thinking"], inside=False)[:2] == ("still thinking", "")


@pytest.mark.parametrize("template, expected", [("{{ '<think>' }}...{{ '</think>' }}", True),
                                                ("{{ messages }}", False), (None, False)])
def test_a_template_thinks_when_it_closes_reasoning_blocks(template, expected):
    assert thinks(template) is expected


def test_the_published_thinking_templates_are_told_from_the_others():
    templates = chat_templates()
    assert all(thinks(templates[name]) for name in ("Qwen-Qwen3-0.6B", "Qwen-QwQ-32B",
                                                     "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"))
    assert not any(thinks(templates[name]) for name in ("meta-llama-Llama-3.1-8B-Instruct",
                                                        "Qwen-Qwen2.5-7B-Instruct", "google-gemma-2-2b-it"))


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwq_opens_the_reasoning_in_the_prompt_only_when_thinking(enable_thinking):
    prompt = render_chat_template(chat_templates()["Qwen-QwQ-32B"], [{"role": "user", "content": "Hi"}],
                                  enable_thinking=enable_thinking)
    assert opened_in_prompt(prompt) is enable_thinking


ANALYSIS = "<|channel|>analysis<|message|>The user greets; greet back.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>')


def test_gpt_oss_analysis_channel_is_the_reasoning_and_the_final_channel_the_answer():
    text = ANALYSIS + FINAL
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    reasoning, content, sent = streamed(pieces, stream=HarmonyStream())
    assert (reasoning, content) == ("The user greets; greet back.", "Hello there!")
    assert not any("<|" in part for pair in sent for part in pair)


def test_a_gpt_oss_tool_call_stays_in_the_content_for_the_call_parser():
    split = split_whole(HarmonyStream(), ANALYSIS + CALL)
    parsed = parse_tool_calls(split.content, ToolFormat.HARMONY, frozenset({"get_weather"}))
    assert split.reasoning == "The user greets; greet back."
    calls = [(call.name, call.arguments) for call in parsed.tool_calls]
    assert calls == [("get_weather", '{"city": "Paris"}')]


def test_text_that_is_not_harmony_is_all_content():
    assert split_whole(HarmonyStream(), "Just an answer.").content == "Just an answer."


def test_the_gpt_oss_template_gets_the_harmony_split():
    template = chat_templates()["openai-gpt-oss-120b"]
    assert thinks(template) and isinstance(reasoning_stream(template), HarmonyStream)
