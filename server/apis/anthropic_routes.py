"""Anthropic's Messages API on the server: `/v1/messages` (whole, or the documented event stream:
message_start, a content block's start, deltas and stop for each of thinking, text and tool_use,
message_delta, message_stop) and `/v1/messages/count_tokens`."""

from collections.abc import AsyncIterator
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tierflow.runtime.api.engine import Engine
from tierflow.server.answers import Calls, EventStream, Finished, Part, Reasoning, Text, sse
from tierflow.server.apis.anthropic_schema import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error,
    message_body,
    message_id,
    message_start,
    stop_reason,
    tool_use_block,
)
from tierflow.server.generations import ReadBody, Server, Started, chat_prompt, on_worker_thread
from tierflow.server.openai_schema import ApiError, engine_error, parse_request


def add_anthropic_routes(app: FastAPI, server: Server, max_tokens_limit: int | None, context_shift: bool,
                         read_body: ReadBody) -> None:

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await parse_request(MessagesRequest, await read_body(request))
        tools, variables = body.tool_request(), body.template_variables()
        kwargs = body.generation_kwargs(max_tokens_limit)

        def prompt(engine: Engine):
            return partial(chat_prompt, engine, body.template_messages, context_shift, tools, variables)

        started = await server.begin(request, body.model, kwargs, "messages", prompt, body.prompt_chars(),
                                     tools=tools)
        return await _answer(request, started, body.stream, tools)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        body = await parse_request(CountTokensRequest, await read_body(request))
        chat, tools, variables = body.template_messages(), body.tool_request(), body.template_variables()
        lease = await server.pool.acquire(body.model)
        try:
            count = partial(lease.engine.tokenize_chat, chat, tools=tools, chat_template_kwargs=variables)
            ids = await on_worker_thread(count)
        except ApiError:
            raise
        except Exception as error:
            raise engine_error(error, "messages") from None
        finally:
            lease.release()
        return {"input_tokens": len(ids)}


async def _answer(request: Request, started: Started, stream: bool, tools) -> Response:
    trace, ident = started.traced(request), message_id()
    if stream and started.astream is not None:
        answer = started.parts(trace, "messages", tools)
        events = _events(answer, ident, started.model, len(started.prompt.ids))
        return EventStream(events, started.astream, started.release, started.headers)
    answered = await started.whole(request, trace, "messages", tools)
    if answered is None:
        return Response(status_code=499)
    result, thought = answered
    return JSONResponse(message_body(ident, started.model, result, thought), headers=started.headers)


async def _events(answer: AsyncIterator[Part], ident: str, model: str,
                  input_tokens: int) -> AsyncIterator[str]:
    """The Messages stream: each run of thinking or text one content block, each tool call one."""
    yield _event(message_start(ident, model, input_tokens))
    yield _event({"type": "ping"})
    index, open_kind = -1, None

    def start(kind: str, block: dict) -> str:
        nonlocal index, open_kind
        index, open_kind = index + 1, kind
        return _event({"type": "content_block_start", "index": index, "content_block": block})

    def stop() -> str:
        nonlocal open_kind
        open_kind = None
        return _event({"type": "content_block_stop", "index": index})

    try:
        async for part in answer:
            if isinstance(part, Reasoning):
                if open_kind != "thinking":
                    if open_kind:
                        yield stop()
                    yield start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                yield _delta(index, {"type": "thinking_delta", "thinking": part.text})
            elif isinstance(part, Text):
                if open_kind != "text":
                    if open_kind == "thinking":
                        yield _delta(index, {"type": "signature_delta", "signature": ""})
                    if open_kind:
                        yield stop()
                    yield start("text", {"type": "text", "text": ""})
                yield _delta(index, {"type": "text_delta", "text": part.text})
            elif isinstance(part, Calls):
                if open_kind:
                    yield stop()
                for call in part.calls:
                    block = tool_use_block(call)
                    yield start("tool_use", {**block, "input": {}})
                    yield _delta(index, {"type": "input_json_delta", "partial_json": call.arguments})
                    yield stop()
            elif isinstance(part, Finished):
                if open_kind:
                    yield stop()
                result = part.result
                delta = {"stop_reason": stop_reason(result), "stop_sequence": result.stop_string}
                yield _event({"type": "message_delta", "delta": delta,
                              "usage": {"output_tokens": len(result.tokens)}})
                yield _event({"type": "message_stop"})
    except ApiError as error:
        yield sse(anthropic_error(error), "error")


def _event(data: dict) -> str:
    return sse(data, data["type"])


def _delta(index: int, delta: dict) -> str:
    return _event({"type": "content_block_delta", "index": index, "delta": delta})
