"""A request's way from a served model to a running generation, whatever API it came by: the model
held (loaded on demand, server/model_pool.py), the character limit and the model's queue, the
prompt made on a worker thread, a grammar compiled off the event loop, the generation started on
the engine's compute thread. Each API's routes then send the stream in their own shapes.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import numpy as np
from fastapi import Request

from tierflow.errors import ContextLengthError, InvalidArgumentError, TierflowError, UnsupportedModelError
from tierflow.runtime.api.engine import Engine
from tierflow.runtime.api.streams import AsyncStream, GenerationResult
from tierflow.runtime.generation.context_shift import fit_chat
from tierflow.runtime.sampling.structured import Grammar
from tierflow.runtime.text.reasoning import opened_in_prompt, reasoning_stream, thinks
from tierflow.runtime.text.tool_calls import ToolCallStream
from tierflow.runtime.text.tool_prompt import ToolRequest
from tierflow.server.admission import Admission
from tierflow.server.answers import Part, ReasoningSplit, parts, unless_disconnected, whole
from tierflow.server.metrics import TRACE_KEY, RequestTrace
from tierflow.server.model_pool import ModelPool
from tierflow.server.openai_embeddings import text_chars
from tierflow.server.openai_schema import ApiError, engine_error, response_grammar

CHARS_PER_POSITION = 16  # the default prompt character limit per context position: 4x typical text
T = TypeVar("T")
log = logging.getLogger("tierflow.server.routes")


@dataclass(frozen=True)
class Prompt:
    """A request's prompt ids, and what was left out of its messages to fit the context."""

    ids: list[int]
    shift: str | None = None  # what was left out, if anything: the X-Context-Shift header
    opens_reasoning: bool = False  # the template opened a <think> block at the prompt's end

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.shift is None else {"X-Context-Shift": self.shift}


# A prompt, or (for one whose making is slow) what makes it from the request's max_tokens.
PromptSource = Prompt | Callable[[int], Prompt]
ReadBody = Callable[[Request], Awaitable[bytes]]  # a request's body, refused past the server's limit


def chat_prompt(engine: Engine, make_messages: Callable[[], list[dict]], context_shift: bool,
                tools: ToolRequest | None, chat_template_kwargs: dict | None, max_tokens: int) -> Prompt:
    """The prompt of the messages make_messages gives (checked and converted here, on the worker
    thread, once the request's characters are admitted: a megabyte of small messages takes a while),
    with the tools offered and the extra template variables; with context_shift, their oldest turns
    dropped if they and the answer would not fit."""
    messages = make_messages()
    tokenize_chat = partial(engine.tokenize_chat, tools=tools, chat_template_kwargs=chat_template_kwargs)
    opens = partial(_opens_reasoning, engine)
    if not context_shift:
        return opens(Prompt(tokenize_chat(messages)))
    fitted = fit_chat(messages, tokenize_chat, engine.context_length, max_tokens)  # room: a share at most
    if not fitted.shifted:
        return opens(Prompt(fitted.prompt_ids))
    shift = f"dropped {len(fitted.dropped)} messages"
    if fitted.cut_chars:
        shift += f"; cut the first {fitted.cut_chars} characters of the last answer"
    log.warning("context shift: %s of a conversation of %d, to fit the context of %d tokens", shift,
                len(messages), engine.context_length)
    return opens(Prompt(fitted.prompt_ids, shift))


def text_prompt(engine: Engine, text: str, max_tokens: int) -> Prompt:
    return Prompt(engine.tokenize(text))


def _opens_reasoning(engine: Engine, prompt: Prompt) -> Prompt:
    if not thinks(engine.tokenizer.template.jinja):
        return prompt
    tail = engine.detokenize(prompt.ids[-8:])
    return Prompt(prompt.ids, prompt.shift, opened_in_prompt(tail))


@dataclass
class Started:
    """A generation under way (astream None: its client left before it started), and what to
    call when its answer is sent: the queue slot and the model's hold are freed."""

    astream: AsyncStream | None
    engine: Engine
    model: str  # the served name
    prompt: Prompt | None
    release: Callable[[], None]
    load_seconds: float = 0.0  # the model's load, when this request waited for it
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.prompt is None else self.prompt.headers

    def traced(self, request: Request) -> RequestTrace:
        """The request's trace (server/metrics.py), told of this generation."""
        trace: RequestTrace = getattr(request.state, TRACE_KEY)
        trace.stream, trace.context_shift = self.astream, self.prompt and self.prompt.shift
        return trace

    def parts(self, trace: RequestTrace, param: str, tools: ToolRequest | None = None,
              reasoning: bool = True) -> AsyncIterator[Part]:
        """The answer's parts as they come (answers.parts): with reasoning, a thinking model's
        reasoning apart; with tools offered, the calls parsed out."""
        return parts(self.astream, trace, param, self._tool_stream(tools),
                     self._reasoning_stream() if reasoning else None)

    async def whole(self, request: Request, trace: RequestTrace, param: str, tools: ToolRequest | None = None,
                    reasoning: bool = True) -> tuple[GenerationResult, str] | None:
        """The whole answer and its reasoning (as parts() splits them), the request's slot then
        freed; None once its client has left."""
        try:
            with_calls = partial(self.engine.with_tool_calls, tools=tools)
            return await whole(request, self.astream, trace, param, with_calls,
                               self._reasoning_stream() if reasoning else None)
        finally:
            self.release()

    def _reasoning_stream(self) -> ReasoningSplit | None:
        if self.prompt is None:
            return None
        return reasoning_stream(self.engine.tokenizer.template.jinja, self.prompt.opens_reasoning)

    def _tool_stream(self, tools: ToolRequest | None) -> ToolCallStream | None:
        if tools is None or not tools.offered:
            return None
        return ToolCallStream(self.engine.tool_format, tools.names)


class Generations:
    """One loaded model's admission: the requests it answers at once and queues."""

    def __init__(self, engine: Engine, max_queued: int, max_prompt_chars: int | None):
        self.engine = engine
        self.max_chars = max_prompt_chars or CHARS_PER_POSITION * engine.context_length
        self.admission = Admission(engine.parallel, max_queued)

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuses prompt text past the limit; for messages, num_chars counts their framing too."""
        if num_chars > self.max_chars:
            counted = " (each message's role and template framing count too)" if param == "messages" else ""
            raise ApiError(400, f"{param}: {num_chars} characters of prompt text{counted}; this server "
                           f"accepts at most {self.max_chars} (--max-prompt-chars)", param=param,
                           code="prompt_too_long")


class Server:
    """The served models and how a request reaches one."""

    def __init__(self, pool: ModelPool[Generations]):
        self.pool = pool

    async def begin(self, request: Request, model: str | None, kwargs: dict, param: str,
                    source: Callable[[Engine], PromptSource], chars: int, keep_alive_s: float | None = None,
                    tools: ToolRequest | None = None) -> Started:
        """Holds the model (loading it if need be), admits the request and starts its generation.
        kwargs are Engine.astream's, max_tokens None running to the context's end; param names
        the prompt's field in errors; source makes the prompt from the engine."""
        lease = await self.pool.acquire(model, keep_alive_s)
        try:
            generations, engine = lease.state, lease.engine
            generations.check_chars(chars, param)
            kwargs = _with_max_tokens(kwargs, engine) | tool_grammar(engine, tools)
            release_slot = generations.admission.acquire()
        except BaseException:
            lease.release()
            raise
        release = _both(release_slot, lease.release)
        try:
            prompt = await self._prompt(request, param, source(engine), kwargs["max_tokens"])
            start = partial(_start, engine, param, prompt, kwargs)
            constrained = "response_format" in kwargs  # its grammar is compiled off the event loop
            astream = None if prompt is None else await on_worker_thread(start) if constrained else start()
            if astream is not None:
                await _made(astream, param)
        except BaseException:
            release()
            raise
        return Started(astream, engine, lease.model.name, prompt, release, lease.load_seconds)

    async def embed(self, model: str | None, make_inputs: Callable[[Engine], list],
                    keep_alive_s: float | None = None) -> tuple[np.ndarray, int, str]:
        """The embeddings (vectors [N, E]) of the inputs make_inputs gives for the model's engine,
        their token count and the model's name, in a queue slot like a generation: tokenized on a
        worker thread, computed on the engine's compute thread."""
        lease = await self.pool.acquire(model, keep_alive_s)
        try:
            inputs = make_inputs(lease.engine)
            lease.state.check_chars(text_chars(inputs), "input")
            release = lease.state.admission.acquire()
            try:
                ids = await on_worker_thread(partial(lease.engine.embedding_tokens, inputs))
                vectors = await lease.engine.aembed(ids)
            except UnsupportedModelError as error:  # the model cannot embed: no request would do
                raise ApiError(400, str(error), param="model", code="model_not_supported") from None
            except InvalidArgumentError as error:  # an input is empty or holds a bad id
                raise ApiError(400, str(error), param="input") from None
            except TierflowError as error:
                raise engine_error(error, "input") from None
            finally:
                release()
        finally:
            lease.release()
        return vectors, sum(len(item) for item in ids), lease.model.name

    async def _prompt(self, request: Request, param: str, source: PromptSource,
                      max_tokens: int) -> Prompt | None:
        """The prompt, made on a worker thread; None if the client left meanwhile."""
        if isinstance(source, Prompt):
            return source
        try:
            return await unless_disconnected(request, on_worker_thread(partial(source, max_tokens)))
        except TierflowError as error:
            raise engine_error(error, param) from None


def tool_grammar(engine: Engine, tools: ToolRequest | None) -> dict:
    """The grammar keyword that makes a required or named call well-formed; a tool whose
    parameters llguidance cannot compile is a 400."""
    try:
        grammar = engine.tool_grammar(tools)
    except TierflowError as error:
        raise ApiError(400, f"tools: {error}", param="tools") from None
    return {} if grammar is None else {"grammar": grammar}


def _with_max_tokens(kwargs: dict, engine: Engine) -> dict:
    """max_tokens None (none asked, no server limit) is the context: the answer ends at its end."""
    return kwargs if kwargs.get("max_tokens") is not None else {**kwargs, "max_tokens": engine.context_length}


def _start(engine: Engine, param: str, prompt: Prompt, kwargs: dict) -> AsyncStream:
    if "response_format" in kwargs:
        kwargs = {**kwargs, "response_format": None, "grammar": _answer_grammar(kwargs)}
    try:
        if len(prompt.ids) > engine.context_length:  # refused before the engine checks each id
            raise ContextLengthError(f"the prompt has {len(prompt.ids)} tokens but the context holds "
                                     f"{engine.context_length}")
        return engine.astream(prompt.ids, context_shift=prompt.shift is not None, **kwargs)
    except TierflowError as error:
        raise engine_error(error, param) from None


async def _made(astream: AsyncStream, param: str) -> None:
    """The generation made (off the event loop), so that a bad argument is answered before any
    part of the answer is sent."""
    try:
        await astream.start()
    except TierflowError as error:
        raise engine_error(error, param) from None


def _answer_grammar(kwargs: dict) -> Grammar | None:
    """The response_format's grammar, or a required or named tool call's: not both."""
    grammar, tool_grammar = response_grammar(kwargs["response_format"]), kwargs.get("grammar")
    if grammar is not None and tool_grammar is not None:
        raise ApiError(400, "a required or named tool_choice constrains the answer to a call: give no "
                       "response_format with it", param="response_format")
    return grammar or tool_grammar


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def release() -> None:
        try:
            first()
        finally:
            second()
    return release


async def on_worker_thread(work: Callable[[], T]) -> T:
    """work() on a worker thread. A thread cannot be stopped, so a cancelled caller waits for it to
    end before it lets the cancellation through: the caller's queue slot stays held meanwhile, and
    the slots bound the threads a client can set working and then leave."""
    future = asyncio.get_running_loop().run_in_executor(None, work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise
