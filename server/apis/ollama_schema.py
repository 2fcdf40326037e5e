"""ollama's native API shapes (`/api/chat`, `/api/generate`, `/api/embed`, ...): requests parsed into
what the engine takes, answers built as ollama's clients read them.

ollama streams by default, one JSON object per line (NDJSON), and times everything in nanoseconds.
Its `options` carry the sampling; options ollama has that change nothing here (threads, GPU
layers, mmap) are accepted and ignored as ollama ignores the ones its runner lacks, and options
that would change the answer in a way tierflow does not compute (mirostat, typical_p, tfs_z) are
refused by name. Errors are ollama's `{"error": "..."}` (server/routes.py renders every ApiError so
on /api/ paths).
"""

import json
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.api.model_info import ModelCard
from tierflow.runtime.api.streams import GenerationResult
from tierflow.runtime.text.tool_calls import ToolCall
from tierflow.runtime.text.tool_prompt import ToolRequest
from tierflow.server.openai_embeddings import checked_inputs
from tierflow.server.openai_schema import ApiError, roles_checked

OLLAMA_VERSION = "0.12.0"  # the ollama API this server follows, as /api/version reports it
_LENIENT = ConfigDict(extra="ignore")
# options that change the answer in ways tierflow does not compute, and the values that ask nothing
_REFUSED_OPTIONS = {"mirostat": (0,), "typical_p": (1.0,), "tfs_z": (1.0,)}
_SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty")


class _Request(BaseModel):
    model_config = _LENIENT
    model: str = Field(min_length=1)
    keep_alive: float | str | None = None


class _GenerationRequest(_Request):
    stream: bool = True
    options: dict[str, Any] | None = None
    format: Literal["", "json"] | dict | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    images: list | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def generation_kwargs(self, max_tokens_limit: int | None) -> dict:
        """Engine.astream's keywords from options, format and logprobs."""
        if self.images:
            raise ApiError(400, "images: this server reads text only (no vision model is supported yet)",
                           param="images")
        options = dict(self.options or {})
        for name, accepted in _REFUSED_OPTIONS.items():
            if options.get(name) not in (None, *accepted):
                raise ApiError(400, f"options.{name} is not supported by this server",
                               param=f"options.{name}")
        kwargs: dict = {"max_tokens": _num_predict(options.get("num_predict"), max_tokens_limit)}
        for name in _SAMPLING_OPTIONS:
            if options.get(name) is not None:
                kwargs[name] = _number(options, name)
        if options.get("seed") is not None and _number(options, "seed") >= 0:
            kwargs["seed"] = int(options["seed"])
        stop = options.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise ApiError(400, "options.stop must be a list of strings", param="options.stop")
            kwargs["stop"] = stop
        if self.format:
            kwargs["response_format"] = _response_format(self.format)
        if self.logprobs:
            kwargs |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        return kwargs

    def template_variables(self) -> dict:
        """`think` as the template's switch: Qwen3's enable_thinking, gpt-oss's reasoning level."""
        if self.think is None:
            return {}
        if isinstance(self.think, str):
            return {"reasoning_effort": self.think, "enable_thinking": True}
        return {"enable_thinking": self.think}


class OllamaToolCall(BaseModel):
    model_config = _LENIENT
    function: dict


class OllamaMessage(BaseModel):
    model_config = _LENIENT
    role: str
    content: str | None = ""
    thinking: str | None = None
    images: list | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class ChatRequest(_GenerationRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict] | None = None

    def template_messages(self) -> list[dict]:
        messages = [_template_message(i, message) for i, message in enumerate(self.messages)]
        return roles_checked(messages)

    def tool_request(self) -> ToolRequest | None:
        tools = [{"type": "function", **tool} if "type" not in tool else tool for tool in self.tools or []]
        try:
            return ToolRequest.from_openai(tools or None)
        except InvalidArgumentError as error:
            raise ApiError(400, str(error), param="tools") from None

    def prompt_chars(self) -> int:
        tools = len(json.dumps(self.tools)) if self.tools else 0
        return tools + sum(len(m.role) + len(m.content or "") + 16 for m in self.messages)


class GenerateRequest(_GenerationRequest):
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False

    def refuse_unhonoured(self) -> None:
        if self.suffix:
            raise ApiError(400, "suffix (fill-in-the-middle) is not supported by this server", param="suffix")
        if self.template:
            raise ApiError(400, "template: a per-request template is not supported; serve the model with "
                           "--chat-template", param="template")
        if self.context:
            raise ApiError(400, "context (the deprecated token context) is not supported; send the "
                           "conversation to /api/chat", param="context")


class EmbedRequest(_Request):
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None

    def inputs(self, max_inputs: int, width: int) -> list[str]:
        inputs = [self.input] if isinstance(self.input, str) else list(self.input)
        return checked_inputs(inputs, self.dimensions, max_inputs, width)


class EmbeddingsRequest(_Request):
    prompt: str = Field(min_length=1)
    options: dict[str, Any] | None = None


class ShowRequest(BaseModel):
    model_config = _LENIENT
    model: Annotated[str, Field(min_length=1)] | None = None
    name: str | None = None  # the older clients' field
    verbose: bool = False

    @property
    def requested(self) -> str:
        if not (self.model or self.name):
            raise ApiError(400, "model: the model to show is required", param="model")
        return self.model or self.name


def _template_message(index: int, message: OllamaMessage) -> dict:
    if message.images:
        raise ApiError(400, f"messages.{index}.images: this server reads text only (no vision model is "
                       "supported yet)", param="messages")
    rendered: dict = {"role": message.role, "content": message.content or ""}
    if message.tool_calls:
        rendered["tool_calls"] = [{"type": "function", "function": call.function}
                                  for call in message.tool_calls]
    if message.role == "tool" and message.tool_name:
        rendered["name"] = message.tool_name
    return rendered


def _num_predict(value: object, limit: int | None) -> int | None:
    """num_predict as max_tokens: -1 (ollama's default) and -2 run to the context's end (None)."""
    if value is None or value in (-1, -2):
        return limit
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(400, f"options.num_predict must be a count of tokens, or -1, got {value!r}",
                       param="options.num_predict")
    if limit is not None and value > limit:
        raise ApiError(400, f"options.num_predict is {value}; this server allows at most {limit}",
                       param="options.num_predict")
    return value


def _number(options: dict, name: str) -> float:
    value = options[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"options.{name} must be a number, got {value!r}", param=f"options.{name}")
    return value


def _response_format(fmt: str | dict) -> dict:
    """ollama's format as OpenAI's response_format: "json" any JSON object, a dict its schema."""
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}


# -- answers ----------------------------------------------------------------------------------

def ollama_error(error: ApiError) -> dict:
    """ollama's error body: the message alone."""
    return {"error": error.message}


def now() -> str:
    """ollama's created_at: RFC 3339 in UTC, with nanoseconds' worth of digits trimmed to micro."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def chat_chunk(model: str, content: str = "", thinking: str = "", tool_calls: list[ToolCall] | None = None
               ) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if tool_calls:
        message["tool_calls"] = [ollama_call(call) for call in tool_calls]
    return {"model": model, "created_at": now(), "message": message, "done": False}


def generate_chunk(model: str, response: str = "", thinking: str = "") -> dict:
    chunk = {"model": model, "created_at": now(), "response": response, "done": False}
    if thinking:
        chunk["thinking"] = thinking
    return chunk


def done_fields(result: GenerationResult, load_seconds: float, total_seconds: float) -> dict:
    """The last object's finish and timings, in nanoseconds as ollama gives them."""
    stats = result.stats
    reason = "length" if result.finish_reason == "length" else "stop"
    return {"done": True, "done_reason": reason, "total_duration": _ns(total_seconds),
            "load_duration": _ns(load_seconds), "prompt_eval_count": stats.prompt_tokens,
            "prompt_eval_duration": _ns(stats.prefill_seconds), "eval_count": len(result.tokens),
            "eval_duration": _ns(stats.decode_seconds)}


def ollama_call(call: ToolCall) -> dict:
    """A call as ollama writes it: the arguments as an object, not JSON text."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    return {"function": {"name": call.name, "arguments": arguments}}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def details(card: ModelCard) -> dict:
    return {"parent_model": "", "format": "gguf", "family": card.arch, "families": [card.arch],
            "parameter_size": card.parameter_size, "quantization_level": card.quant_label}


def tag_entry(name: str, card: ModelCard) -> dict:
    """A model of /api/tags."""
    modified = datetime.fromtimestamp(card.modified, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"name": name, "model": name, "modified_at": modified, "size": card.file_bytes, "digest": "",
            "details": details(card)}


def show_body(card: ModelCard) -> dict:
    """/api/show: the template, the recommended parameters as a Modelfile writes them, the details."""
    parameters = "\n".join(f"{name:<15} {value}" for name, value in card.sampling.items())
    info = {"general.architecture": card.arch, "general.parameter_count": card.num_parameters,
            f"{card.arch}.context_length": card.context_length}
    modified = datetime.fromtimestamp(card.modified, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"modelfile": f"FROM {card.path}\n", "parameters": parameters,
            "template": card.chat_template or "",
            "license": card.license or "", "details": details(card), "model_info": info,
            "capabilities": list(card.capabilities), "modified_at": modified}
