"""Anthropic's Messages API shapes (`/v1/messages`): requests parsed into what the engine takes,
answers built as Anthropic's clients read them, errors in its `{"type": "error", "error": {...}}`.

Content blocks map onto the chat template's messages: text joined, `tool_use` blocks as the
assistant's tool calls, `tool_result` blocks as tool messages before the user's text; `thinking`
blocks of earlier answers are dropped (the templates drop past reasoning too). Images and documents
are refused by name: this server reads text.
"""

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.api.streams import GenerationResult
from tierflow.runtime.text.tool_calls import ToolCall
from tierflow.runtime.text.tool_prompt import ToolRequest
from tierflow.server.openai_schema import STRICT, ApiError, roles_checked

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error(error: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"),
                                       "message": error.message}}


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicMessage(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ThinkingConfig(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputConfig(BaseModel):
    model_config = STRICT
    format: dict | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class _Conversation(BaseModel):
    model_config = STRICT
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: ThinkingConfig | None = None

    def template_messages(self) -> list[dict]:
        messages = [{"role": "system", "content": _text_of(self.system, "system")}] if self.system else []
        for index, message in enumerate(self.messages):
            messages.extend(_template_messages(index, message))
        return roles_checked(messages)

    def tool_request(self) -> ToolRequest | None:
        tools = [_openai_tool(index, tool) for index, tool in enumerate(self.tools or [])]
        choice, parallel = _tool_choice(self.tool_choice)
        try:
            return ToolRequest.from_openai(tools or None, choice, parallel)
        except InvalidArgumentError as error:
            raise ApiError(400, str(error), param="tools") from None

    def template_variables(self) -> dict:
        if self.thinking is None:
            return {}
        return {"enable_thinking": self.thinking.type != "disabled"}

    def prompt_chars(self) -> int:
        return len(json.dumps([message.model_dump() for message in self.messages])) + len(
            json.dumps(self.tools or [])) + len(json.dumps(self.system or ""))


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict | None = None
    service_tier: str | None = None
    output_config: OutputConfig | None = None

    def generation_kwargs(self, max_tokens_limit: int | None) -> dict:
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise ApiError(400, f"max_tokens: {self.max_tokens} is more than this server allows "
                           f"({max_tokens_limit})", param="max_tokens")
        kwargs: dict[str, Any] = {"max_tokens": self.max_tokens, "stop": self.stop_sequences}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        output_format = self.output_config and self.output_config.format
        if output_format:  # structured output: the answer is JSON of the schema
            schema = output_format.get("schema")
            if output_format.get("type") != "json_schema" or not isinstance(schema, dict):
                raise ApiError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": "
                               "{...}}", param="output_config")
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": schema, "strict": True}}
        return kwargs

    def template_variables(self) -> dict:
        variables = super().template_variables()
        effort = self.output_config and self.output_config.effort
        if effort is None:
            return variables
        level = {"xhigh": "high", "max": "high"}.get(effort, effort)  # gpt-oss's levels stop at high
        return {"reasoning_effort": level, "enable_thinking": True} | variables


class CountTokensRequest(_Conversation):
    pass


def _template_messages(index: int, message: AnthropicMessage) -> list[dict]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    for position, block in enumerate(message.content):
        where = f"messages.{index}.content.{position}"
        fields = block.model_extra or {}
        if block.type == "text":
            texts.append(_field(fields, "text", str, where))
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append({"id": _field(fields, "id", str, where), "type": "function",
                          "function": {"name": _field(fields, "name", str, where),
                                       "arguments": _field(fields, "input", dict, where)}})
        elif block.type == "tool_result" and message.role == "user":
            results.append({"role": "tool", "tool_call_id": _field(fields, "tool_use_id", str, where),
                            "content": _text_of(fields.get("content") or "", f"{where}.content")})
        elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue
        else:
            raise ApiError(400, f"{where}: content blocks of type {block.type!r} are not supported in a "
                           f"{message.role} message (this server reads text, tool_use and tool_result)",
                           param="messages")
    rendered = [*results]
    if texts or calls or not results:
        called = {"tool_calls": calls} if calls else {}
        rendered.append({"role": message.role, "content": "".join(texts), **called})
    return rendered


def _text_of(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for position, block in enumerate(content):
            fields = block.model_dump() if isinstance(block, BaseModel) else block
            if not isinstance(fields, dict) or fields.get("type") != "text":
                kind = fields.get("type") if isinstance(fields, dict) else type(fields).__name__
                raise ApiError(400, f"{where}.{position}: only text blocks are supported here, got {kind!r}",
                               param=where.split(".")[0])
            parts.append(_field(fields, "text", str, f"{where}.{position}"))
        return "".join(parts)
    raise ApiError(400, f"{where}: a string or a list of text blocks", param=where.split(".")[0])


def _field(fields: dict, name: str, kind: type, where: str) -> Any:
    value = fields.get(name)
    if not isinstance(value, kind):
        raise ApiError(400, f"{where}.{name}: a {kind.__name__} is required", param=where.split(".")[0])
    return value


def _openai_tool(index: int, tool: dict) -> dict:
    if tool.get("type") not in (None, "custom"):
        raise ApiError(400, f"tools.{index}: server tools ({tool.get('type')!r}) are not supported; give "
                       "client tools with a name and an input_schema", param="tools")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict | None) -> tuple[str | dict | None, bool | None]:
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise ApiError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                   param="tool_choice")


# -- answers ----------------------------------------------------------------------------------

def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(result: GenerationResult) -> str:
    if result.tool_calls:
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_string is not None else "end_turn"


def tool_use_block(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def message_body(message_id: str, model: str, result: GenerationResult, thinking: str) -> dict:
    content = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
    if result.text:
        content.append({"type": "text", "text": result.text})
    content += [tool_use_block(call) for call in result.tool_calls or []]
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(result), "stop_sequence": result.stop_string,
            "usage": {"input_tokens": result.stats.prompt_tokens, "output_tokens": len(result.tokens)}}


def message_start(message_id: str, model: str, input_tokens: int) -> dict:
    return {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0}}}
