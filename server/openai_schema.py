"""OpenAI's request and response shapes for the local server: parsing, checking, building.

Requests are parsed strictly (a string where a number belongs is a 400, not a guess). Every field
OpenAI defines is either honoured or, given a value that would change the answer, refused with a
400 naming it (_REFUSED); fields nobody defines (extensions of other servers) are ignored, since
clients send many. Every failure becomes an ApiError that the server renders as OpenAI's
`{"error": {"message", "type", "param", "code"}}` body.
"""

import asyncio
import gc
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, with_config
from typing_extensions import NotRequired, TypedDict

from tierflow.arguments import check_roles
from tierflow.errors import ContextLengthError, InvalidArgumentError, TemplateError, TierflowError
from tierflow.runtime.api.streams import GenerationResult
from tierflow.runtime.sampling.logprobs import TokenLogprob
from tierflow.runtime.sampling.structured import Grammar, grammar_for
from tierflow.runtime.text.tool_calls import ToolCall
from tierflow.runtime.text.tool_prompt import ToolRequest, template_variables


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
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
TEMPLATE_CHARS_PER_MESSAGE = 16  # a chat message's framing in the template (role markers, separators)


class _Strict(BaseModel):
    model_config = STRICT


# Messages and their parts are TypedDicts, not models: a megabyte of them validates several times
# faster. Every list stops at its first bad item: a megabyte of bad items would otherwise build one
# error each.

@with_config(STRICT)
class ContentPart(TypedDict):
    type: str  # only "text" is served; another type is a 400 naming it (template_message)
    text: NotRequired[str]


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
    content: NotRequired[str | Annotated[list[ContentPart], Field(fail_fast=True)] | None]
    tool_calls: NotRequired[Annotated[list[AssistantToolCall], Field(fail_fast=True)] | None]
    tool_call_id: NotRequired[str]  # a "tool" message: the call it answers
    name: NotRequired[str]


def template_message(message: Message) -> dict:
    """The message as the engine takes it: content as one string, and "developer" (OpenAI's new
    name for "system") as "system"; tool calls and the call a tool result answers are kept."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content)
    role = "system" if message["role"] == "developer" else message["role"]
    kept = {key: message[key] for key in ("tool_calls", "tool_call_id", "name") if message.get(key)}
    return {"role": role, "content": content or "", **kept}


def roles_checked(messages: list[dict], param: str = "messages") -> list[dict]:
    """The messages, their roles checked (arguments.check_roles); a bad one is a 400 naming it."""
    try:
        check_roles(messages)
    except InvalidArgumentError as error:
        raise ApiError(400, str(error), param=param) from None
    return messages


def effort_variables(effort: str | None, param: str = "reasoning_effort") -> dict:
    """A reasoning effort as the templates' own switches: gpt-oss's level (low, medium, high) and
    Qwen3's enable_thinking (off for "none" and "minimal")."""
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise ApiError(400, f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                       param=param)
    level = {"none": "low", "minimal": "low"}.get(effort, effort)
    return {"reasoning_effort": level, "enable_thinking": effort not in ("none", "minimal")}


def check_content_parts(messages: list[Message]) -> None:
    """Refuses a content part that is not text (image_url, input_audio, file, ...): this server
    reads text only, and dropping the part would answer a question nobody asked."""
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            where = f"messages.{i}.content.{j}"
            if part["type"] != "text":
                raise ApiError(400, f"{where}: content parts of type {part['type']!r} are not supported "
                               f"(only 'text')", param="messages", code="unsupported_content")
            if "text" not in part:
                raise ApiError(400, f"{where}: a text part needs its 'text'", param="messages")


def _content_chars(message: Message) -> int:
    content = message.get("content") or ""
    chars = len(content) if isinstance(content, str) else sum(len(part.get("text", "")) for part in content)
    calls = message.get("tool_calls") or []
    return chars + sum(len(call["function"]["name"]) + len(call["function"]["arguments"]) for call in calls)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = False  # padding of stream events: not done, so True is refused


# OpenAI's fields this server does not honour, and the values it accepts for them because they ask
# for nothing (their defaults): any other value is a 400 naming the field. Fields honoured, or
# harmless whatever they hold, are not here: `user`, `safety_identifier` (ids for the provider's
# abuse monitoring: there is none), `metadata` (kept only with `store`), `prompt_cache_key` (a hint
# for routing to a cache: this server has one, which reuses every shared prefix by itself).
_REFUSED_IN_BOTH: dict[str, tuple] = {"n": (None, 1), "stream_options.include_obfuscation": (None, False)}
_REFUSED_IN_CHAT: dict[str, tuple] = {
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "verbosity": (None,), "web_search_options": (None,), "store": (None, False),
    "service_tier": (None, "auto", "default"), "moderation": (None,),
    # the one cache keeps prefixes in memory, until another request's prompt replaces them
    "prompt_cache_retention": (None, "in_memory"), "prompt_cache_options": (None,),
    "functions": (None,), "function_call": (None,),  # the deprecated tool API: `tools` replaced it
}
_REFUSED_IN_COMPLETIONS: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None, ""),
    "echo": (None, False),  # the prompt's logprobs would need a prefill keeping every position's logits
}


class _GenerationRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # llama-server's extensions, same meaning as the engine's
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = Field(None, ge=-1)  # -1: random, as in llama.cpp
    stop: str | Annotated[list[str], Field(fail_fast=True)] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # JSON's keys are strings: token ids in decimal
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None  # checked by runtime/sampling/structured.py: OpenAI's shapes
    user: str | None = None
    # What only _REFUSED checks: any JSON is parsed here, so that the 400 names the field.
    best_of: Any = None
    suffix: Any = None
    echo: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None

    refused: ClassVar[dict[str, tuple]] = _REFUSED_IN_BOTH

    def generation_kwargs(self, max_tokens_limit: int | None) -> dict:
        """Keyword arguments for Engine.astream; unset sampling fields keep the engine's defaults.
        max_tokens past the context is not refused: the answer ends at the context's end, with
        "length" (as llama-server's); only past a limit the server was given is it a 400."""
        self._refuse_unhonoured()
        max_tokens = self._max_tokens()
        if max_tokens is not None and max_tokens_limit is not None and max_tokens > max_tokens_limit:
            raise ApiError(400, f"max_tokens is {max_tokens}; this server allows at most "
                           f"{max_tokens_limit} (--max-tokens-limit)", param="max_tokens")
        kwargs = {"max_tokens": max_tokens_limit if max_tokens is None else max_tokens,
                  "stop": self.stop}
        for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "frequency_penalty",
                     "presence_penalty"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.seed is not None and self.seed >= 0:
            kwargs["seed"] = self.seed
        if self.response_format is not None:  # compiled by response_grammar, off the event loop
            kwargs["response_format"] = self.response_format
        if self.logit_bias:
            kwargs["logit_bias"] = _token_biases(self.logit_bias)
        return kwargs | self._logprobs_kwargs()

    def _refuse_unhonoured(self) -> None:
        for name, accepted in self.refused.items():
            owner, _, field = name.rpartition(".")
            value = getattr(getattr(self, owner) if owner else self, field, None)
            if value not in accepted:
                allowed = " or ".join(json.dumps(a) for a in accepted if a is not None)
                raise ApiError(400, f"{name} is not supported by this server" +
                               (f" (only {allowed})" if allowed else ""), param=name,
                               code="unsupported_parameter")

    def _logprobs_kwargs(self) -> dict:
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class ChatRequest(_GenerationRequest):
    messages: Annotated[list[Message], Field(fail_fast=True)] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)  # the newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Checked by ToolRequest (runtime/text/tool_prompt.py), whose errors name the tool.
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # llama-server's and vLLM's extension: more variables for the chat template (enable_thinking, ...)
    chat_template_kwargs: dict | None = None

    refused: ClassVar[dict[str, tuple]] = _REFUSED_IN_BOTH | _REFUSED_IN_CHAT

    def tool_request(self) -> ToolRequest | None:
        try:
            return ToolRequest.from_openai(self.tools, self.tool_choice, self.parallel_tool_calls)
        except InvalidArgumentError as error:
            names = ("tools", "tool_choice", "parallel_tool_calls")
            param = next((name for name in names if str(error).startswith(name)), "tools")
            raise ApiError(400, str(error), param=param) from None

    def template_variables(self) -> dict:
        """chat_template_kwargs, and reasoning_effort as the templates' switches (effort_variables)."""
        try:
            variables = template_variables(self.chat_template_kwargs)
        except InvalidArgumentError as error:
            raise ApiError(400, str(error), param="chat_template_kwargs") from None
        return effort_variables(self.reasoning_effort) | variables

    def template_messages(self) -> list[dict]:
        roles_checked(self.messages)
        check_content_parts(self.messages)
        return [template_message(message) for message in self.messages]

    def _logprobs_kwargs(self) -> dict:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return {"logprobs": True, "top_logprobs": self.top_logprobs or 0} if self.logprobs else {}

    def prompt_chars(self) -> int:
        """The characters the messages put into the prompt, each message's framing counted too."""
        tools = len(json.dumps(self.tools)) if self.tools else 0
        return tools + sum(len(message["role"]) + _content_chars(message) + TEMPLATE_CHARS_PER_MESSAGE
                           for message in self.messages)

    def _max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class CompletionRequest(_GenerationRequest):
    prompt: str | Annotated[list[int], Field(fail_fast=True)] | Annotated[list[str], Field(fail_fast=True)]
    logprobs: int | None = Field(None, ge=0, le=20)  # the top alternatives per token (OpenAI allows 5)

    refused: ClassVar[dict[str, tuple]] = _REFUSED_IN_BOTH | _REFUSED_IN_COMPLETIONS

    def engine_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; an empty one, or a batch of several, is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return prompt

    def _logprobs_kwargs(self) -> dict:
        return {} if self.logprobs is None else {"logprobs": True, "top_logprobs": self.logprobs}


def _token_biases(bias: dict[str, float]) -> dict[int, float]:
    """logit_bias's keys as token ids (the engine checks them against the vocabulary)."""
    ids = {}
    for key, value in bias.items():
        if not key.isdecimal():
            raise ApiError(400, f"logit_bias: {key!r} is not a token id", param="logit_bias")
        ids[int(key)] = value
    return ids


def response_grammar(response_format: dict | None) -> Grammar | None:
    """The grammar of a request's response_format; a bad shape, an unsupported schema keyword or a
    malformed schema is a 400 naming it. A large schema takes tens of ms: call it off the loop."""
    try:
        return grammar_for(response_format)
    except InvalidArgumentError as error:
        raise ApiError(400, str(error), param="response_format") from None


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

    def response(self, result: GenerationResult, reasoning: str = "") -> dict:
        """The whole answer of a non-streaming request; a thinking model's reasoning is the
        message's reasoning_content, as llama-server and DeepSeek's API give it."""
        choice = {"index": 0, "logprobs": self.logprobs(result.logprobs),
                  "finish_reason": result.finish_reason}
        if self.chat and result.tool_calls:
            choice["message"] = {"role": "assistant", "content": result.text or None,
                                 "tool_calls": [call.as_openai() for call in result.tool_calls]}
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        if reasoning and self.chat:
            choice["message"]["reasoning_content"] = reasoning
        return self._envelope("", [choice], usage=usage(result), tierflow=result.stats.as_dict())

    def role_chunk(self) -> dict:
        return self._chunk({"delta": {"role": "assistant", "content": ""}})

    def reasoning_chunk(self, text: str) -> dict:
        return self._chunk({"delta": {"reasoning_content": text}})

    def text_chunk(self, text: str, logprobs: list[TokenLogprob] | None = None, text_offset: int = 0) -> dict:
        """A piece of text, with the logprobs of the tokens it completes (text_offset: the
        characters streamed before it)."""
        fields = {"delta": {"content": text}} if self.chat else {"text": text}
        return self._chunk(fields, logprobs=self.logprobs(logprobs, text_offset))

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

    def final_chunk(self, result: GenerationResult, logprobs: list[TokenLogprob] | None = None,
                    text_offset: int = 0) -> dict:
        """The chunk that carries the finish reason and tierflow's timings, and the logprobs of
        tokens no text chunk carried (a stop string's)."""
        fields = {"delta": {}} if self.chat else {"text": ""}
        return self._chunk(fields, result.finish_reason, logprobs=self.logprobs(logprobs, text_offset),
                           tierflow=result.stats.as_dict())

    def logprobs(self, entries: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
        """OpenAI's logprobs of a choice: chat's `content` list, or the legacy completions shape
        (text_offset: where the first token's text starts in the whole text)."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [_chat_logprob(e) | {"top_logprobs": [_chat_logprob(t) for t in e.top]}
                                for e in entries], "refusal": None}
        offsets = _text_offsets(entries, text_offset)
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.text: t.logprob for t in e.top} for e in entries], "text_offset": offsets}

    def usage_chunk(self, result: GenerationResult) -> dict:
        return self._envelope(".chunk", [], usage=usage(result))

    def _chunk(self, fields: dict, finish_reason: str | None = None, logprobs: dict | None = None,
               **extra) -> dict:
        choice = {"index": 0, **fields, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope(".chunk", [choice], **extra)

    def _envelope(self, suffix: str, choices: list, **extra) -> dict:
        # OpenAI names the streamed objects chat.completion.chunk but text_completion for both.
        kind = "chat.completion" + suffix if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def _chat_logprob(entry: TokenLogprob) -> dict:
    return {"token": entry.text, "logprob": entry.logprob, "bytes": list(entry.bytes)}


def _text_offsets(entries: list[TokenLogprob], start: int) -> list[int]:
    """Where each token's text starts, in characters (a token that ends inside a character
    starts where that character does)."""
    offsets, joined = [], b""
    for entry in entries:
        offsets.append(start + len(joined.decode("utf-8", errors="ignore")))
        joined += entry.bytes
    return offsets


def usage(result: GenerationResult) -> dict:
    prompt, completion = result.stats.prompt_tokens, len(result.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "tierflow"}
