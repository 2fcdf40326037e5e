"""How a generation's answer goes out: whole, as one JSON body, or as OpenAI's server-sent events
(text pieces with their logprobs, tool calls once parsed, the finish, the usage), and a client that
leaves cancels its generation either way."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tierflow.errors import TierflowError
from tierflow.runtime.api.streams import AsyncStream, GenerationResult
from tierflow.runtime.text.tool_calls import ToolCallStream
from tierflow.server.metrics import RequestTrace
from tierflow.server.openai_schema import ApiError, Reply, engine_error

log = logging.getLogger("tierflow.server.routes")


async def whole_answer(request: Request, astream: AsyncStream | None, reply: Reply, param: str,
                        headers: dict[str, str], trace: RequestTrace,
                        with_tool_calls: Callable[[GenerationResult], GenerationResult]) -> Response:
    """The answer of a request that does not stream, or 499 once its client has left (astream is
    None if it left while its prompt was tokenized)."""
    try:
        result = None if astream is None else await unless_disconnected(request, _collect(astream, trace))
    except Exception as error:
        raise generation_error(error, param) from None
    if result is None:
        return Response(status_code=499)  # nobody is listening; nginx's code for it, for the log
    if result.finish_reason == "cancelled":
        raise ApiError(503, "the generation was cancelled (the server is stopping)", type="server_error")
    return JSONResponse(reply.response(with_tool_calls(result)), headers=headers)


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


async def events(astream: AsyncStream, reply: Reply, include_usage: bool, param: str,
                  trace: RequestTrace, tool_stream: ToolCallStream | None = None) -> AsyncIterator[str]:
    """Server-sent events: the role (chat), the text pieces, the tool calls, the finish, the usage,
    [DONE]; or, once something fails, an error event (OpenAI's error body) that ends the stream.
    With a tool_stream, text that may be a call forming is held back until it is known."""
    if reply.chat:
        yield _sse(reply.role_chunk())
    num_pieces = num_chars = num_logprobs = 0  # streamed so far
    held = []  # logprobs of pieces held back (a tool call may be forming): sent with the next text
    try:
        async for piece in astream:
            trace.first_piece()
            logprobs = astream.piece_logprobs(num_pieces)
            num_pieces += 1
            if tool_stream is not None:
                piece = tool_stream.push(piece)
            if logprobs is not None:
                held, logprobs = held + logprobs, held + logprobs
            if piece:
                yield _sse(reply.text_chunk(piece, logprobs, num_chars))
                num_chars, num_logprobs, held = num_chars + len(piece), num_logprobs + len(held), []
    except Exception as error:
        yield _sse(generation_error(error, param).body())
        return
    result = astream.result
    if result is None or result.finish_reason == "cancelled":
        yield _sse(ApiError(503, "the generation was cancelled", type="server_error").body())
        return
    if tool_stream is not None:
        chunks, result = _tool_call_chunks(tool_stream, reply, result)
        for chunk in chunks:
            yield _sse(chunk)
    rest = None if result.logprobs is None else result.logprobs[num_logprobs:]
    yield _sse(reply.final_chunk(result, rest or None, num_chars))
    if include_usage:
        yield _sse(reply.usage_chunk(result))
    yield "data: [DONE]\n\n"


def _tool_call_chunks(tool_stream: ToolCallStream, reply: Reply,
                      result: GenerationResult) -> tuple[list[dict], GenerationResult]:
    """The chunks of what the tool stream held back (content, calls), and the result with the calls
    (for an answer max_tokens cut off, those whole before the cut, finishing with "length")."""
    cut = result.finish_reason == "length"
    parsed = tool_stream.finish(cut)
    chunks = [reply.text_chunk(parsed.content)] if parsed.content else []
    if not parsed.tool_calls:
        return chunks, result
    return chunks + reply.tool_call_chunks(parsed.tool_calls), replace(
        result, tool_calls=parsed.tool_calls, finish_reason="length" if cut else "tool_calls")


def generation_error(error: Exception, param: str) -> ApiError:
    """The API error for a generation that failed after it started."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, TierflowError):
        return engine_error(error, param)
    log.error("a generation failed", exc_info=error)
    return ApiError(500, "the generation failed (an internal error; the server's log has the details)",
                    type="server_error")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """An SSE response that, however it ends (finished, client gone, never started), cancels its
    generation and frees its queue slot. Starlette cancels the body's task on disconnect."""

    def __init__(self, events: AsyncIterator[str], astream: AsyncStream, release: Callable[[], None],
                 headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self._astream, self._release = astream, release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._astream.cancel()
            self._release()
