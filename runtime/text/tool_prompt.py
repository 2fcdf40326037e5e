"""Tools into the prompt: OpenAI's `tools`, `tool_choice` and tool history, for the chat template.

A template that takes tools (runtime/text/tool_calls.py `tool_format` says which do) gets them as the
`tools` variable, assistant `tool_calls` with their arguments parsed to objects (templates print
them with `tojson`) and `tool` messages as they are. A template that knows no tools gets what
llama.cpp's generic fallback gives it: the tools described in the system prompt with the JSON
answer that calls them, calls in the history written as that JSON, and tool results as user
messages.

A constrained choice (`required`, or a named function) also gets a grammar (tool_call_grammar, a
Lark grammar for llguidance with the tools' parameter schemas embedded as `%json`), so the answer
is a well-formed call whatever the model.
"""

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.sampling.structured import JSON_OPTIONS
from tierflow.runtime.text.tool_calls import ToolFormat

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat offers and how the model may use them, validated."""

    tools: tuple[dict, ...]  # OpenAI's {"type": "function", "function": {...}}, parameters filled in
    choice: str = "auto"  # "auto", "none", "required", or "function": call `function`
    function: str | None = None
    parallel: bool = True  # several calls in one answer (by default, but for a named function)

    @classmethod
    def from_openai(cls, tools: Sequence[dict] | None, tool_choice: str | dict | None = None,
                    parallel_tool_calls: bool | None = None) -> "ToolRequest | None":
        """The request of OpenAI's fields; None without tools. A bad field is an
        InvalidArgumentError naming it (and the tool)."""
        if tools is None or (isinstance(tools, (list, tuple)) and not tools):
            if tool_choice not in (None, "auto", "none"):
                raise InvalidArgumentError(f"tool_choice is {_short(tool_choice)}, but no tools are given")
            return None
        if not isinstance(tools, (list, tuple)):
            raise InvalidArgumentError("tools must be a list of {'type': 'function', 'function': {...}}")
        checked = tuple(_checked_tool(i, tool) for i, tool in enumerate(tools))
        names = [tool["function"]["name"] for tool in checked]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"tools: two tools have the same name ({_duplicate(names)!r})")
        choice, function = _choice(tool_choice, names)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise InvalidArgumentError(f"parallel_tool_calls must be true or false, "
                                       f"got {parallel_tool_calls!r}")
        # A named function is called once (as OpenAI's forced function is) unless parallel calls are asked
        # for: a small model otherwise repeats the call until max_tokens.
        parallel = parallel_tool_calls if parallel_tool_calls is not None else choice != "function"
        return cls(checked, choice, function, parallel)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool["function"]["name"] for tool in self.tools)

    @property
    def offered(self) -> bool:
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def callable_tools(self) -> tuple[dict, ...]:
        """The tools the answer may call: the named one, or all of them."""
        return tuple(t for t in self.tools if self.function in (None, t["function"]["name"]))


def _checked_tool(index: int, tool: object) -> dict:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type") != "function":
        raise InvalidArgumentError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(f"{where}: the function's name must be 1-64 letters, digits, '_', '.' "
                                   f"or '-', got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidArgumentError(f"{where} ({name!r}): description must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not _is_object_schema(parameters):
        raise InvalidArgumentError(f"{where} ({name!r}): parameters must be a JSON schema of an object "
                                   f"(type 'object', properties an object), got {_short(parameters)}")
    return {"type": "function", "function": {**function, "parameters": parameters}}


def _is_object_schema(schema: object) -> bool:
    return (isinstance(schema, dict) and schema.get("type", "object") == "object"
            and isinstance(schema.get("properties", {}), dict)
            and isinstance(schema.get("required", []), list))


def _short(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def _duplicate(names: list[str]) -> str:
    return next(name for i, name in enumerate(names) if name in names[:i])


def _choice(tool_choice: str | dict | None, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None or tool_choice in _CHOICES:
        return tool_choice or "auto", None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (isinstance(function, dict) and tool_choice.get("type") == "function"):
        raise InvalidArgumentError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': "
                                   f"'function', 'function': {{'name': ...}}}}, got {_short(tool_choice)}")
    if function.get("name") not in names:
        raise InvalidArgumentError(f"tool_choice names the function {function.get('name')!r}, which is not "
                                   f"in tools ({', '.join(names)})")
    return "function", function["name"]


# -- the template's inputs -------------------------------------------------------------------------

# What the chat's own inputs set: a template variable of these names is refused.
_RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def template_variables(chat_template_kwargs: object) -> dict:
    """Extra variables for the chat template (`enable_thinking` for Qwen3, `documents`,
    `reasoning_effort` for gpt-oss, ...), as llama-server's and vLLM's chat_template_kwargs: an
    object of JSON values whose names are not the chat's own inputs."""
    if chat_template_kwargs is None:
        return {}
    names = chat_template_kwargs.keys() if isinstance(chat_template_kwargs, dict) else [None]
    if not all(isinstance(name, str) for name in names):
        raise InvalidArgumentError("chat_template_kwargs must be an object of template variables by name")
    reserved = sorted(_RESERVED_VARIABLES & names)
    if reserved:
        raise InvalidArgumentError(f"chat_template_kwargs cannot set {', '.join(reserved)}: the chat's own "
                                   f"inputs set them")
    try:
        return json.loads(json.dumps(chat_template_kwargs))
    except (TypeError, ValueError, RecursionError):
        raise InvalidArgumentError("chat_template_kwargs must hold JSON values only") from None


def template_inputs(messages: list[dict], request: ToolRequest | None,
                    fmt: ToolFormat) -> tuple[list[dict], dict]:
    """The messages and the extra variables (`tools`) to render the chat template with."""
    if not isinstance(messages, list):
        return messages, {}  # the renderer refuses them, saying why
    if fmt is not ToolFormat.GENERIC:
        tools = list(request.tools) if request is not None and request.offered else None
        return [_native_message(message) for message in messages], {"tools": tools}
    rendered = _generic_history(messages)
    if request is not None and request.offered:
        rendered = _with_system_text(rendered, generic_instructions(request))
    return rendered, {}


def _content(message: dict) -> str:
    # OpenAI's content is null in an assistant message that only calls tools.
    content = message.get("content")
    return "" if content is None else content


def _native_message(message: dict) -> dict:
    if not isinstance(message, dict):
        return message  # the renderer refuses it, naming the message
    rendered = {**message, "content": _content(message)}
    if isinstance(message.get("tool_calls"), list):
        rendered["tool_calls"] = [_native_call(call) for call in message["tool_calls"]]
    return rendered


def _native_call(call: object) -> object:
    """An assistant's call as templates print it: OpenAI's shape, arguments as an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    return {**call, "type": "function", "function": {**function, "arguments": _arguments(function)}}


def _arguments(function: dict) -> object:
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments  # not JSON: the template prints what the client sent
    return arguments


def _generic_history(messages: list[dict]) -> list[dict]:
    """The history for a template that knows no tools: calls as the answer's JSON, tool results as
    user messages naming their tool."""
    names = {}  # call id -> the tool's name, for the results that answer them
    rendered = []
    for message in messages:
        if not isinstance(message, dict):
            rendered.append(message)
        elif isinstance(message.get("tool_calls"), list) and message["tool_calls"]:
            calls = [_native_call(call) for call in message["tool_calls"]]
            names.update({call.get("id"): call["function"].get("name")
                          for call in calls if isinstance(call, dict)})
            rendered.append({"role": message.get("role"), "content": _generic_calls_text(message, calls)})
        elif message.get("role") == "tool":
            result = {"name": names.get(message.get("tool_call_id"), message.get("name")),
                      "content": _content(message)}
            text = json.dumps({"tool_result": result}, ensure_ascii=False)
            rendered.append({"role": "user", "content": text})
        else:
            rendered.append({**message, "content": _content(message)})
    return rendered


def _generic_calls_text(message: dict, calls: list) -> str:
    answer = {"tool_calls": [{"name": call["function"].get("name"),
                              "arguments": call["function"]["arguments"]}
                             for call in calls if isinstance(call, dict) and "function" in call]}
    text = json.dumps(answer, ensure_ascii=False)
    return f"{_content(message)}\n{text}" if _content(message) else text


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") == "system" and isinstance(first.get("content"), str):
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def generic_instructions(request: ToolRequest) -> str:
    """The system prompt's part that describes the tools and how to call them."""
    keys = ("name", "description", "parameters")
    described = "\n".join(json.dumps({key: tool["function"][key] for key in keys if key in tool["function"]},
                                     ensure_ascii=False) for tool in request.tools)
    shape = '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}'
    if request.function is not None:
        when = f"You must call the tool {request.function!r}: answer with only this JSON"
    elif request.choice == "required":
        when = "You must call one of them: answer with only this JSON"
    else:
        when = "Otherwise answer as usual; to call tools, answer with only this JSON"
    how_many = "" if request.parallel else " (one call at most)"
    return (f"You can call these tools (each with a JSON schema of its arguments):\n{described}\n\n"
            f"{when}{how_many}:\n{shape}\n"
            f"Each tool's result comes back in a message of its own.")


# -- the constrained answer --------------------------------------------------------------------------

def tool_call_grammar(request: ToolRequest, fmt: ToolFormat,
                      is_token: Callable[[str], bool] = lambda text: False) -> str:
    """The Lark grammar (llguidance's dialect) of an answer that is only calls of the callable
    tools, in the model's format: each call's arguments match its tool's parameters schema.
    is_token(text) says whether the vocabulary has `text` as one special token (Qwen's
    `<tool_call>`): the grammar then asks for that token, which is what the model writes, since
    a tokenizer never spells a special token out in characters."""
    if fmt is ToolFormat.GENERIC:
        call = _calls_schema(request, "arguments")
        calls = {"type": "array", "items": {k: v for k, v in call.items() if k != "$defs"}, "minItems": 1}
        if not request.parallel:
            calls["maxItems"] = 1
        answer = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                  "additionalProperties": False, "$defs": call["$defs"]}
        return f"start: %json {_json(answer)}\n"
    if fmt is ToolFormat.LLAMA3:
        return f"start: %json {_json(_calls_schema(request, 'parameters'))}\n"
    if fmt is ToolFormat.HERMES:
        schema = _json(_calls_schema(request, "arguments"))
        opening, closing = (_marker(text, is_token) for text in ("<tool_call>", "</tool_call>"))
        call = f'call: {opening} "\\n" %json {schema} "\\n" {closing}\n'
        # a new line may end the answer: models trained on the format write one before their turn's end
        return ('start: call ("\\n" call)* "\\n"?\n' if request.parallel else 'start: call "\\n"?\n') + call
    return _harmony_grammar(request)


def _marker(text: str, is_token: Callable[[str], bool]) -> str:
    """A format's marker in the grammar: the special token itself (llguidance's `<...>` syntax), or
    its characters where the vocabulary has no such token."""
    return text if is_token(text) else json.dumps(text)


def _json(schema: dict) -> str:
    """A schema for `%json`, with structured output's JSON layout (no free whitespace, in which a
    small model can loop)."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _calls_schema(request: ToolRequest, arguments_key: str) -> dict:
    """The JSON schema of one call: any callable tool's name with its own arguments. Each tool's
    parameters schema sits in the root's $defs (as tool_I, its own $defs beside it), so that the
    pointers it holds (pydantic's "#/$defs/Model", a recursive "#") still resolve once embedded."""
    defs, schemas = {}, []
    for i, tool in enumerate(request.callable_tools):
        defs.update(_hoisted(tool["function"]["parameters"], f"tool_{i}"))
        schemas.append({"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                         arguments_key: {"$ref": f"#/$defs/tool_{i}"}},
                        "required": ["name", arguments_key], "additionalProperties": False})
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {**call, "$defs": defs}


def _hoisted(schema: dict, name: str) -> dict:
    """The $defs entries that hold `schema` as `name` and its own definitions ($defs and the older
    definitions) as `name`__KEY, every pointer in them rewritten to where its target now is."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    body = {key: value for key, value in schema.items() if key not in ("$defs", "definitions")}

    def moved(pointer: str) -> str:
        for folder in ("#/$defs/", "#/definitions/"):
            if pointer.startswith(folder):
                key, _, rest = pointer[len(folder):].partition("/")
                return f"#/$defs/{name}__{key}" + (f"/{rest}" if rest else "")
        return f"#/$defs/{name}{pointer[1:]}" if pointer.startswith("#") else pointer

    def rewritten(value: object) -> object:
        if isinstance(value, dict):
            return {key: moved(item) if key == "$ref" and isinstance(item, str) else rewritten(item)
                    for key, item in value.items()}
        if isinstance(value, list):
            return [rewritten(item) for item in value]
        return value

    return {name: rewritten(body), **{f"{name}__{key}": rewritten(value) for key, value in own.items()}}


def _harmony_grammar(request: ToolRequest) -> str:
    # gpt-oss's control tokens are written bare: llguidance matches them as the special tokens.
    rules = []
    for i, tool in enumerate(request.callable_tools):
        recipient = json.dumps(f"commentary to=functions.{tool['function']['name']} ")
        arguments = _json(tool["function"]["parameters"])
        rules.append(f'call_{i}: <|channel|> {recipient} <|constrain|> "json" <|message|> %json {arguments}')
    calls = " | ".join(f"call_{i}" for i in range(len(rules)))
    return f"start: {calls}\n" + "\n".join(rules) + "\n"
