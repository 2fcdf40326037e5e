"""OpenAI's Responses API shapes (`/v1/responses`): the input items as the chat template's messages,
the output items (reasoning, message, function calls) as the API and its clients read them.

`previous_response_id` continues a conversation this server answered: the responses are kept in
memory for the server's life (the last MAX_KEPT_RESPONSES), so a client sends only the new turn.
"""

import json
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.api.streams import GenerationResult
from tierflow.runtime.text.tool_calls import ToolCall
from tierflow.runtime.text.tool_prompt import ToolRequest
from tierflow.server.openai_schema import STRICT, ApiError, effort_variables, roles_checked

MAX_KEPT_RESPONSES = 1000
_REFUSED = {"background": (None, False), "conversation": (None,), "prompt": (None,),
            "max_tool_calls": (None,), "service_tier": (None, "auto", "default")}


class ReasoningConfig(BaseModel):
    model_config = STRICT
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: dict | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    input: str | Annotated[list[dict], Field(fail_fast=True)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    # refused unless they ask for nothing (_REFUSED)
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    service_tier: Any = None

    def refuse_unhonoured(self) -> None:
        for name, accepted in _REFUSED.items():
            if getattr(self, name) not in accepted:
                raise ApiError(400, f"{name} is not supported by this server", param=name,
                               code="unsupported_parameter")

    def generation_kwargs(self, max_tokens_limit: int | None) -> dict:
        max_tokens = self.max_output_tokens
        if max_tokens is not None and max_tokens_limit is not None and max_tokens > max_tokens_limit:
            raise ApiError(400, f"max_output_tokens is {max_tokens}; this server allows at most "
                           f"{max_tokens_limit}", param="max_output_tokens")
        kwargs: dict[str, Any] = {"max_tokens": max_tokens if max_tokens is not None else max_tokens_limit}
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        fmt = self.text.format if self.text else None
        if fmt and fmt.get("type") != "text":
            kwargs["response_format"] = _response_format(fmt)
        return kwargs

    def input_items(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def tool_request(self) -> ToolRequest | None:
        tools = [_chat_tool(index, tool) for index, tool in enumerate(self.tools or [])]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        try:
            return ToolRequest.from_openai(tools or None, choice, self.parallel_tool_calls)
        except InvalidArgumentError as error:
            raise ApiError(400, str(error), param="tools") from None

    def template_variables(self) -> dict:
        return effort_variables(self.reasoning.effort if self.reasoning else None, "reasoning.effort")

    def prompt_chars(self, items: list[dict]) -> int:
        return len(json.dumps(items)) + len(self.instructions or "") + len(json.dumps(self.tools or []))


def template_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """The conversation's items as chat messages: a function call joins the assistant message
    before it, its output is a tool message; reasoning items are dropped."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{index}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer, got "
                               f"{role!r}",
                               param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output if isinstance(output, str) else _content_text(output, where)})
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(400, f"{where}: items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output, reasoning)", param="input")
    return roles_checked(messages, "input")


def _content_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: a string or a list of content parts", param="input")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.{index}: content parts of type {kind!r} are not supported "
                           "(only text)",
                           param="input", code="unsupported_content")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{name}: a string is required", param="input")
    return value


def _chat_tool(index: int, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise ApiError(400, f"tools.{index}: only function tools are supported, got {tool.get('type')!r}",
                       param="tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _response_format(fmt: dict) -> dict:
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {key: fmt[key] for key in ("name", "schema", "strict")
                                                       if key in fmt}}
    raise ApiError(400, f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}",
                   param="text.format")


# -- answers ----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def output_items(result: GenerationResult, reasoning: str) -> list[dict]:
    items = [reasoning_item(new_id("rs"), reasoning)] if reasoning else []
    if result.text or not result.tool_calls:
        items.append(message_item(new_id("msg"), result.text))
    items += [call_item(new_id("fc"), call) for call in result.tool_calls or []]
    return items


class ResponseShell:
    """One response's fixed fields, shared by its events and its final body."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.id, self.created_at, self.model, self.request = new_id("resp"), int(time.time()), model, request

    def body(self, status: str, output: list[dict], result: GenerationResult | None = None) -> dict:
        request = self.request
        usage = None
        if result is not None:
            prompt, completion = result.stats.prompt_tokens, len(result.tokens)
            usage = {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                     "input_tokens_details": {"cached_tokens": result.stats.cached_prompt_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": incomplete, "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens, "temperature": request.temperature,
                "top_p": request.top_p, "tools": request.tools or [],
                "tool_choice": request.tool_choice or "auto",
                "parallel_tool_calls": request.parallel_tool_calls is not False,
                "previous_response_id": request.previous_response_id,
                "text": {"format": (request.text.format if request.text and request.text.format else
                                    {"type": "text"})},
                "reasoning": {"effort": request.reasoning.effort if request.reasoning else None,
                              "summary": None},
                "metadata": request.metadata or {}, "store": request.store is not False,
                "truncation": request.truncation or "disabled"}


def final_status(result: GenerationResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


class ResponseStore:
    """The conversations of the responses kept: each id's input items and output items, in order."""

    def __init__(self, capacity: int = MAX_KEPT_RESPONSES):
        self.capacity, self._items = capacity, OrderedDict()

    def history(self, response_id: str | None) -> list[dict]:
        if response_id is None:
            return []
        if response_id not in self._items:
            raise ApiError(400, f"previous_response_id: no response {response_id!r} is kept by this server "
                           f"(it keeps the last {self.capacity} for its life, and only those with store)",
                           param="previous_response_id", code="previous_response_not_found")
        self._items.move_to_end(response_id)
        return list(self._items[response_id])

    def keep(self, response_id: str, conversation: list[dict]) -> None:
        self._items[response_id] = conversation
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
