"""Chat templates of real files: the prompt ids tierflow renders are llama.cpp's, with and without
tools, a system message, a tool call and its result in the history; a file without a template says
so; --chat-template takes a Jinja file or one of llama.cpp's built-in names, and a bad one is named."""

import json

import llama_cpp
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from tests.support.cli import run_tierflow
from tierflow import Engine, InvalidArgumentError, TemplateError
from tierflow.runtime.text.template_choice import NO_TEMPLATE_NOTICE
from tierflow.runtime.text.tool_prompt import ToolRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
# The call and its result as OpenAI's clients send them (arguments as JSON text, no content) ...
ARGUMENTS = '{"city": "Paris"}'
CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 18}'}
# ... and as Hugging Face's templates expect them (arguments as an object), which llama.cpp is given.
NATIVE_CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}

CONVERSATIONS = {  # name: (tierflow's messages, llama.cpp's messages, tools)
    "one user message": ([QUESTION], [QUESTION], None),
    "a system message": ([SYSTEM, QUESTION], [SYSTEM, QUESTION], None),
    "tools": ([QUESTION], [QUESTION], [WEATHER]),
    "tools and a system message": ([SYSTEM, QUESTION], [SYSTEM, QUESTION], [WEATHER]),
    "a tool call and its result": ([SYSTEM, QUESTION, CALL, RESULT], [SYSTEM, QUESTION, NATIVE_CALL, RESULT],
                                   [WEATHER]),
}


@pytest.fixture(scope="module", params=["qwen_05b_path", "qwen_15b_path"])
def qwen(request):
    """A real Qwen2.5-Coder file's engine, and llama.cpp's vocabulary of the same file."""
    path = request.getfixturevalue(request.param)
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    with Engine.load(path, threads=2, context_length=1024) as engine:
        yield engine, llama
    llama.close()


def llama_cpp_chat_ids(llama, template: str, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt llama-cpp-python's chat completion evaluates: the template through its Jinja2
    formatter, tokenized with special tokens parsed and no BOS added by hand."""
    bos, eos = (llama._model.token_get_text(token) for token in (llama.token_bos(), llama.token_eos()))
    formatter = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)
    prompt = formatter(messages=messages, tools=tools).prompt
    return llama.tokenize(prompt.encode(), add_bos=False, special=True)


@pytest.mark.slow
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_prompt_ids_are_llama_cpps_render_of_the_files_template(qwen, conversation):
    engine, llama = qwen
    ours, theirs, tools = CONVERSATIONS[conversation]
    ids = engine.tokenize_chat(ours, tools=ToolRequest.from_openai(tools))
    assert ids == llama_cpp_chat_ids(llama, engine.tokenizer.chat_template, theirs, tools)


# -- a file without a template, and templates the user gives ------------------------------------


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_270m_path):
    from tierflow.runtime.text.tokenizer import Tokenizer

    with Tokenizer.from_gguf(gemma_270m_path) as tokenizer:
        yield tokenizer


def test_a_file_without_a_template_says_so_once_and_chats_in_chatml(gemma_270m_path):
    with Engine.load(gemma_270m_path, threads=2, context_length=512) as engine:
        assert engine.notices.count(NO_TEMPLATE_NOTICE) == 1
        assert engine.tokenizer.apply_chat_template([QUESTION]).startswith("<|im_start|>user\n")


def test_a_builtin_name_renders_llama_cpps_format(gemma_tokenizer):
    gemma_tokenizer.use_template("gemma")
    assert gemma_tokenizer.template.notice is None
    assert gemma_tokenizer.apply_chat_template([QUESTION]) == (
        "<start_of_turn>user\nWhat is the weather in Paris?<end_of_turn>\n<start_of_turn>model\n")


def test_a_builtin_templates_markup_becomes_special_tokens(gemma_tokenizer):
    gemma_tokenizer.use_template("gemma")
    ids = gemma_tokenizer.encode_chat([QUESTION])
    start_of_turn = gemma_tokenizer.encode("<start_of_turn>", special=True, add_bos=False)
    assert len(start_of_turn) == 1 and ids[0] == gemma_tokenizer.bos_id
    assert ids.count(start_of_turn[0]) == 2


def test_a_jinja_file_replaces_the_files_template(gemma_tokenizer, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    gemma_tokenizer.use_template(template)
    assert gemma_tokenizer.apply_chat_template([QUESTION]) == "user: What is the weather in Paris?\n"


def test_an_unknown_template_name_lists_the_known_ones(gemma_tokenizer):
    with pytest.raises(InvalidArgumentError, match="unknown chat template 'no-such-format'.*chatml.*llama3"):
        gemma_tokenizer.use_template("no-such-format")


def test_a_template_file_that_is_not_jinja_names_the_file_and_line(gemma_tokenizer, tmp_path):
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(TemplateError, match=f"{template}: chat template syntax error on line 2"):
        gemma_tokenizer.use_template(template)


@pytest.mark.slow
def test_the_cli_takes_a_builtin_template(gemma_270m_path):
    done = run_tierflow("run", "--chat", "-m", str(gemma_270m_path), "--chat-template", "gemma",
                        "--temperature", "0", "-n", "4", "--json", "Say hello.")
    assert done.returncode == 0, done.stderr
    assert "no chat template" not in done.stderr
    assert len(json.loads(done.stdout)["tokens"]) >= 1


def test_the_cli_refuses_an_unknown_template_in_one_line(gemma_270m_path):
    done = run_tierflow("run", "--chat", "-m", str(gemma_270m_path), "--chat-template", "nonsense", "hi")
    assert done.returncode == 2
    assert "unknown chat template 'nonsense'" in done.stderr and "Traceback" not in done.stderr


def test_a_template_that_raises_is_an_error_naming_the_template_and_the_line(gemma_tokenizer, tmp_path):
    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}\n{% if m.role == 'user' %}\n"
                        "{{ raise_exception('only system messages here') }}\n{% endif %}{% endfor %}")
    gemma_tokenizer.use_template(template)
    with pytest.raises(TemplateError, match=f"^{template}: .*only system messages here \\(line 3\\)"):
        gemma_tokenizer.apply_chat_template([QUESTION])
