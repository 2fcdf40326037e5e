"""How a generation's answer goes out: the parts every API sends (text with its logprobs, reasoning,
tool calls once parsed, the finish), whole or as they come, and OpenAI's server-sent events of them;
a client that leaves cancels its generation either way."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import StreamingResponse

from tierflow.errors import TierflowError
from tierflow.runtime.api.streams import AsyncStream, GenerationResult
from tierflow.runtime.sampling.logprobs import TokenLogprob
from tierflow.runtime.text.reasoning import HarmonyStream, ReasoningStream, split_whole
from tierflow.runtime.text.tool_calls import ToolCall, ToolCallStream
from tierflow.server.metrics import RequestTrace
from tierflow.server.openai_schema import ApiError, Reply, engine_error

log = logging.getLogger("tierflow.server.routes")


@dataclass(frozen=True)
class Text:
    text: str
    logprobs: list[TokenLogprob] | None = None  # of the tokens this text completes
    offset: int = 0  # the answer's characters sent before it


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Calls:
    calls: list[ToolCall]


@dataclass(frozen=True)
class Finished:
    """The end: the result (its tool calls filled in, its text the content) and the logprobs of
    tokens no text carried (a stop string's)."""

    result: GenerationResult
    reasoning: str
    rest_logprobs: list[TokenLogprob] | None = None
    offset: int = 0


Part = Text | Reasoning | Calls | Finished
ReasoningSplit = ReasoningStream | HarmonyStream


async def parts(astream: AsyncStream, trace: RequestTrace, param: str, tool_stream: ToolCallStream | None,
                reasoning: ReasoningSplit | None) -> AsyncIterator[Part]:
    """The answer's parts as they come; a failure raises an ApiError. With a reasoning stream, the
    reasoning is split from the content; with a tool_stream, content that may be a call forming is
    held back until it is known."""
    num_pieces = num_chars = num_logprobs = 0  # streamed so far
    held = []  # logprobs of pieces held back: sent with the next text
    try:
        async for piece in astream:
            trace.first_piece()
            logprobs = astream.piece_logprobs(num_pieces)
            num_pieces += 1
            if logprobs is not None:
                held, logprobs = held + logprobs, held + logprobs
            thought, content = _split(reasoning, piece)
            if thought:
                yield Reasoning(thought)
            if tool_stream is not None:
                content = tool_stream.push(content)
            if content:
                yield Text(content, logprobs, num_chars)
                num_chars, num_logprobs, held = num_chars + len(content), num_logprobs + len(held), []
    except Exception as error:
        raise generation_error(error, param) from None
    result = astream.result
    if result is None or result.finish_reason == "cancelled":
        raise ApiError(503, "the generation was cancelled (the server is stopping)", type="server_error")
    if reasoning is not None:
        tail = reasoning.finish()
        if tail.reasoning:
            yield Reasoning(tail.reasoning)
        content = tool_stream.push(tail.content) if tool_stream is not None else tail.content
        if content:
            yield Text(content, None, num_chars)
            num_chars += len(content)
        result = replace(result, text=reasoning.content)
    if tool_stream is not None:
        parsed, result = _parsed_calls(tool_stream, result)
        if parsed.content:
            yield Text(parsed.content, None, num_chars)
            num_chars += len(parsed.content)
        if parsed.tool_calls:
            yield Calls(parsed.tool_calls)
    rest = None if result.logprobs is None else result.logprobs[num_logprobs:]
    yield Finished(result, "" if reasoning is None else reasoning.reasoning, rest or None, num_chars)


def _split(reasoning: ReasoningSplit | None, piece: str) -> tuple[str, str]:
    if reasoning is None:
        return "", piece
    split = reasoning.push(piece)
    return split.reasoning, split.content


def _parsed_calls(tool_stream: ToolCallStream, result: GenerationResult):
    """What the tool stream held back, and the result with the calls (for an answer max_tokens cut
    off, those whole before the cut, finishing with "length")."""
    cut = result.finish_reason == "length"
    parsed = tool_stream.finish(cut)
    if not parsed.tool_calls:
        return parsed, result
    finish_reason = "length" if cut else "tool_calls"
    return parsed, replace(result, tool_calls=parsed.tool_calls, finish_reason=finish_reason)


async def whole(request: Request, astream: AsyncStream | None, trace: RequestTrace, param: str,
                with_tool_calls: Callable[[GenerationResult], GenerationResult],
                reasoning: ReasoningSplit | None) -> tuple[GenerationResult, str] | None:
    """The whole answer and its reasoning (split by a fresh stream; None: the model does not
    think), or None once its client has left (astream is None if it left while its prompt was
    tokenized)."""
    try:
        result = None if astream is None else await unless_disconnected(request, _collect(astream, trace))
    except Exception as error:
        raise generation_error(error, param) from None
    if result is None:
        return None
    if result.finish_reason == "cancelled":
        raise ApiError(503, "the generation was cancelled (the server is stopping)", type="server_error")
    thought = ""
    if reasoning is not None:
        split = split_whole(reasoning, result.text)
        result, thought = replace(result, text=split.content), split.reasoning
    return with_tool_calls(result), thought


async def _collect(astream: AsyncStream, trace: RequestTrace) -> GenerationResult | None:
    async for _ in astream:
        trace.first_piece()
    return astream.result


async def unless_disconnected(request: Request, work: Awaitable) -> object | None:
    """work's result, or None if the client disconnects first: work is then cancelled (which
    cancels a generation) and waited for."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    return None if task.cancelled() else task.result()


async def _disconnect(request: Request) -> None:
    # The body has been read, so the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def events(answer: AsyncIterator[Part], reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """OpenAI's server-sent events: the role (chat), the reasoning and text pieces, the tool calls,
    the finish, the usage, [DONE]; or, once something fails, an error event (OpenAI's error body)
    that ends the stream."""
    if reply.chat:
        yield sse(reply.role_chunk())
    try:
        async for part in answer:
            if isinstance(part, Reasoning):
                yield sse(reply.reasoning_chunk(part.text))
            elif isinstance(part, Text):
                yield sse(reply.text_chunk(part.text, part.logprobs, part.offset))
            elif isinstance(part, Calls):
                for chunk in reply.tool_call_chunks(part.calls):
                    yield sse(chunk)
            else:
                yield sse(reply.final_chunk(part.result, part.rest_logprobs, part.offset))
                if include_usage:
                    yield sse(reply.usage_chunk(part.result))
    except ApiError as error:
        yield sse(error.body())
        return
    yield "data: [DONE]\n\n"


def generation_error(error: Exception, param: str) -> ApiError:
    """The API error for a generation that failed after it started."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, TierflowError):
        return engine_error(error, param)
    log.error("a generation failed", exc_info=error)
    return ApiError(500, "the generation failed (an internal error; the server's log has the details)",
                    type="server_error")


def sse(data: dict, event: str | None = None) -> str:
    """A server-sent event (with its event name, as Anthropic's and the Responses API's have)."""
    head = "" if event is None else f"event: {event}\n"
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def ndjson(data: dict) -> str:
    """A line of ollama's stream."""
    return json.dumps(data, ensure_ascii=False) + "\n"


class EventStream(StreamingResponse):
    """A streamed response that, however it ends (finished, client gone, never started), cancels
    its generation and frees its queue slot. Starlette cancels the body's task on disconnect."""

    def __init__(self, events: AsyncIterator[str], astream: AsyncStream, release: Callable[[], None],
                 headers: dict[str, str], media_type: str = "text/event-stream"):
        super().__init__(events, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self._astream, self._release = astream, release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._astream.cancel()
            self._release()
