"""OpenAI's request and response shapes for the local server: parsing, checking, building.

Requests are parsed strictly (a string where a number belongs is a 400, not a guess) but fields
this server does not know are ignored, since clients send many. Every failure becomes an ApiError
that the server renders as OpenAI's `{"error": {"message", "type", "param", "code"}}` body.
"""

import asyncio
import gc
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, with_config
from typing_extensions import NotRequired, TypedDict

from tierflow.errors import ContextLengthError, InvalidArgumentError, TemplateError, TierflowError
from tierflow.runtime.streams import GenerationResult
from tierflow.runtime.tool_calls import ToolCall
from tierflow.runtime.tool_prompt import ToolRequest


class ApiError(Exception):
    """An error answered with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def engine_error(error: TierflowError, prompt_param: str) -> ApiError:
    """The API error for an engine error raised while starting a generation."""
    if isinstance(error, ContextLengthError):
        return ApiError(400, str(error), param=prompt_param, code="context_length_exceeded")
    if isinstance(error, (InvalidArgumentError, TemplateError)):  # the request's fault
        return ApiError(400, str(error))
    return ApiError(500, str(error), type="server_error")  # the model's or the machine's


# -- requests ---------------------------------------------------------------------------------

STRICT = ConfigDict(extra="ignore", strict=True)
TEMPLATE_CHARS_PER_MESSAGE = 16  # a chat message's framing in the template (role markers, separators)


class _Strict(BaseModel):
    model_config = STRICT


# Messages and their parts are TypedDicts, not models: a megabyte of them validates several times
# faster. Every list stops at its first bad item: a megabyte of bad items would otherwise build one
# error each.

@with_config(STRICT)
class TextPart(TypedDict):
    type: Literal["text"]
    text: str


@with_config(STRICT)
class CalledFunction(TypedDict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@with_config(STRICT)
class AssistantToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: CalledFunction


@with_config(STRICT)
class Message(TypedDict):
    role: str
    content: NotRequired[str | Annotated[list[TextPart], Field(fail_fast=True)] | None]
    tool_calls: NotRequired[Annotated[list[AssistantToolCall], Field(fail_fast=True)] | None]
    tool_call_id: NotRequired[str]  # a "tool" message: the call it answers
    name: NotRequired[str]


def template_message(message: Message) -> dict:
    """The message as the engine takes it: content as one string, and "developer" (OpenAI's new
    name for "system") as "system"; tool calls and the call a tool result answers are kept."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    role = "system" if message["role"] == "developer" else message["role"]
    kept = {key: message[key] for key in ("tool_calls", "tool_call_id", "name") if message.get(key)}
    return {"role": role, "content": content or "", **kept}


def _content_chars(message: Message) -> int:
    content = message.get("content") or ""
    chars = len(content) if isinstance(content, str) else sum(len(part["text"]) for part in content)
    calls = message.get("tool_calls") or []
    return chars + sum(len(call["function"]["name"]) + len(call["function"]["arguments"]) for call in calls)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # llama-server's extensions, same meaning as the engine's
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = Field(None, ge=-1)  # -1: random, as in llama.cpp
    stop: str | Annotated[list[str], Field(fail_fast=True)] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    def generation_kwargs(self, max_tokens_limit: int) -> dict:
        """Keyword arguments for Engine.astream; unset sampling fields keep the engine's defaults."""
        if self.n not in (None, 1):
            raise ApiError(400, "only n=1 is supported", param="n")
        max_tokens = self._max_tokens()
        if max_tokens is not None and max_tokens > max_tokens_limit:
            raise ApiError(400, f"max_tokens is {max_tokens}; this server allows at most "
                           f"{max_tokens_limit}", param="max_tokens")
        kwargs = {"max_tokens": max_tokens_limit if max_tokens is None else max_tokens,
                  "stop": self.stop}
        for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.seed is not None and self.seed >= 0:
            kwargs["seed"] = self.seed
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class ChatRequest(_GenerationRequest):
    messages: Annotated[list[Message], Field(fail_fast=True)] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)  # the newer name for max_tokens
    logprobs: bool | None = None
    # Checked by ToolRequest (runtime/tool_prompt.py), whose errors name the tool.
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def tool_request(self) -> ToolRequest | None:
        try:
            return ToolRequest.from_openai(self.tools, self.tool_choice, self.parallel_tool_calls)
        except InvalidArgumentError as error:
            names = ("tools", "tool_choice", "parallel_tool_calls")
            param = next((name for name in names if str(error).startswith(name)), "tools")
            raise ApiError(400, str(error), param=param) from None

    def template_messages(self) -> list[dict]:
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        return [template_message(message) for message in self.messages]

    def prompt_chars(self) -> int:
        """The characters the messages put into the prompt, each message's framing counted too."""
        tools = len(json.dumps(self.tools)) if self.tools else 0
        return tools + sum(len(message["role"]) + _content_chars(message) + TEMPLATE_CHARS_PER_MESSAGE
                           for message in self.messages)

    def _max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class CompletionRequest(_GenerationRequest):
    prompt: str | Annotated[list[int], Field(fail_fast=True)] | Annotated[list[str], Field(fail_fast=True)]
    echo: bool | None = False
    logprobs: int | None = None

    def engine_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; an empty one, or a batch of several, is refused."""
        if self.echo or self.logprobs is not None:
            raise ApiError(400, "echo and logprobs are not supported",
                           param="echo" if self.echo else "logprobs")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return prompt


async def parse_request(model: type[_Strict], body: bytes) -> _Strict:
    """The request parsed from a JSON body; bad JSON or a bad field is a 400 naming the field.

    This runs on the event loop (a worker thread would hold the same interpreter lock through
    each C call here), so its cost is bounded per byte, and split in two pauses of the loop: the
    JSON becomes Python objects, the loop answers what waits, then the objects are validated
    (about 7 ms each for a megabyte of small objects). Validating the JSON directly costs more on
    bad input, since each error copies its input out of the JSON: a field holding a megabyte of
    small lists took 100+ ms.
    """
    with _collector_paused():
        try:
            data = pydantic_core.from_json(body, allow_inf_nan=False)
        except ValueError as error:
            raise ApiError(400, f"the body is not valid JSON: {error}") from None
    await asyncio.sleep(0)
    with _collector_paused():
        try:
            return model.model_validate(data)
        except ValidationError as error:
            first = error.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    param = str(first["loc"][0]) if first["loc"] else None
    raise ApiError(400, f"{where}: {first['msg']}", param=param)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector: a megabyte of JSON can be a few hundred thousand small
    lists, which would set off several of its passes, costing ten times the parse. What the parse
    builds and drops is freed by reference counting all the same."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# -- responses --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    """One answer's id, time and model, shared by its streamed chunks or its one body."""

    chat: bool  # chat.completion, else text_completion
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> "Reply":
        return cls(chat, model, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()))

    def response(self, result: GenerationResult) -> dict:
        """The whole answer of a non-streaming request."""
        choice = {"index": 0, "logprobs": None, "finish_reason": result.finish_reason}
        if self.chat and result.tool_calls:
            choice["message"] = {"role": "assistant", "content": result.text or None,
                                 "tool_calls": [call.as_openai() for call in result.tool_calls]}
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return self._envelope("", [choice], usage=usage(result), tierflow=result.stats.as_dict())

    def role_chunk(self) -> dict:
        return self._chunk({"delta": {"role": "assistant", "content": ""}})

    def text_chunk(self, text: str) -> dict:
        return self._chunk({"delta": {"content": text}} if self.chat else {"text": text})

    def tool_call_chunks(self, calls: list[ToolCall]) -> list[dict]:
        """The chunks that stream `calls` as OpenAI's do: each call's id, type and name, then its
        arguments (a client joins the pieces of one index)."""
        chunks = []
        for index, call in enumerate(calls):
            start = {"index": index, "id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": ""}}
            chunks.append(self._chunk({"delta": {"tool_calls": [start]}}))
            arguments = {"index": index, "function": {"arguments": call.arguments}}
            chunks.append(self._chunk({"delta": {"tool_calls": [arguments]}}))
        return chunks

    def final_chunk(self, result: GenerationResult) -> dict:
        """The chunk that carries the finish reason, and tierflow's timings."""
        fields = {"delta": {}} if self.chat else {"text": ""}
        return self._chunk(fields, result.finish_reason, tierflow=result.stats.as_dict())

    def usage_chunk(self, result: GenerationResult) -> dict:
        return self._envelope(".chunk", [], usage=usage(result))

    def _chunk(self, fields: dict, finish_reason: str | None = None, **extra) -> dict:
        choice = {"index": 0, **fields, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope(".chunk", [choice], **extra)

    def _envelope(self, suffix: str, choices: list, **extra) -> dict:
        # OpenAI names the streamed objects chat.completion.chunk but text_completion for both.
        kind = "chat.completion" + suffix if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def usage(result: GenerationResult) -> dict:
    prompt, completion = result.stats.prompt_tokens, len(result.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "tierflow"}
