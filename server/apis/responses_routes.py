"""OpenAI's Responses API on the server: `/v1/responses`, whole or as its documented event stream
(response.created, response.in_progress, then for each output item its added, deltas and done
events, then response.completed, or response.incomplete when max_output_tokens cut it)."""

from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tierflow.runtime.api.engine import Engine
from tierflow.server.answers import Calls, EventStream, Finished, Part, Reasoning, Text, sse
from tierflow.server.apis.responses_schema import (
    ResponseShell,
    ResponsesRequest,
    ResponseStore,
    call_item,
    final_status,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    template_messages,
)
from tierflow.server.generations import ReadBody, Server, Started, chat_prompt
from tierflow.server.openai_schema import ApiError, parse_request


def add_responses_routes(app: FastAPI, server: Server, max_tokens_limit: int | None, context_shift: bool,
                         read_body: ReadBody) -> None:
    store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await parse_request(ResponsesRequest, await read_body(request))
        body.refuse_unhonoured()
        items = store.history(body.previous_response_id) + body.input_items()
        tools, variables = body.tool_request(), body.template_variables()
        kwargs = body.generation_kwargs(max_tokens_limit)
        chat = partial(template_messages, body.instructions, items)

        def prompt(engine: Engine):
            return partial(chat_prompt, engine, chat, context_shift, tools, variables)

        started = await server.begin(request, body.model, kwargs, "input", prompt, body.prompt_chars(items),
                                     tools=tools)
        shell = ResponseShell(body, started.model)

        def kept(output: list[dict]) -> None:
            if body.store is not False:
                store.keep(shell.id, items + output)

        return await _answer(request, started, shell, body.stream, tools, kept)


async def _answer(request: Request, started: Started, shell: ResponseShell, stream: bool, tools,
                  kept: Callable[[list[dict]], None]) -> Response:
    trace = started.traced(request)
    if stream and started.astream is not None:
        events = _events(started.parts(trace, "input", tools), shell, kept)
        return EventStream(events, started.astream, started.release, started.headers)
    answered = await started.whole(request, trace, "input", tools)
    if answered is None:
        return Response(status_code=499)
    result, thought = answered
    output = output_items(result, thought)
    kept(output)
    return JSONResponse(shell.body(final_status(result), output, result), headers=started.headers)


class _Events:
    """The event stream's state: the items output so far, the one open, the sequence numbers."""

    def __init__(self, shell: ResponseShell):
        self.shell, self.sequence, self.output = shell, 0, []
        self.open_kind: str | None = None
        self.item_id, self.text = "", ""

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(data, kind)

    def at(self) -> dict:
        return {"item_id": self.item_id, "output_index": len(self.output)}

    def open(self, kind: str) -> list[str]:
        events = self.close()
        self.open_kind, self.text = kind, ""
        if kind == "reasoning":
            self.item_id = new_id("rs")
            return events + [self.event("response.output_item.added", output_index=len(self.output),
                                        item=reasoning_item(self.item_id, ""))]
        self.item_id = new_id("msg")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return events + [self.event("response.output_item.added", output_index=len(self.output),
                                    item=message_item(self.item_id, "", "in_progress")),
                         self.event("response.content_part.added", **self.at(), content_index=0, part=part)]

    def delta(self, text: str) -> str:
        self.text += text
        if self.open_kind == "reasoning":
            return self.event("response.reasoning_text.delta", **self.at(), content_index=0, delta=text)
        return self.event("response.output_text.delta", **self.at(), content_index=0, delta=text, logprobs=[])

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        kind, self.open_kind = self.open_kind, None
        if kind == "reasoning":
            item = reasoning_item(self.item_id, self.text)
            events = [self.event("response.reasoning_text.done", **self.at(), content_index=0,
                                 text=self.text)]
        else:
            item = message_item(self.item_id, self.text)
            events = [self.event("response.output_text.done", **self.at(), content_index=0, text=self.text,
                                 logprobs=[]),
                      self.event("response.content_part.done", **self.at(), content_index=0,
                                 part=item["content"][0])]
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        return events

    def calls(self, calls) -> list[str]:
        events = self.close()
        for call in calls:
            self.item_id = new_id("fc")
            events += [self.event("response.output_item.added", output_index=len(self.output),
                                  item=call_item(self.item_id, call, "in_progress")),
                       self.event("response.function_call_arguments.delta", **self.at(),
                                  delta=call.arguments),
                       self.event("response.function_call_arguments.done", **self.at(), name=call.name,
                                  arguments=call.arguments)]
            item = call_item(self.item_id, call)
            events.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
            self.output.append(item)
        return events


async def _events(answer: AsyncIterator[Part], shell: ResponseShell,
                  kept: Callable[[list[dict]], None]) -> AsyncIterator[str]:
    state = _Events(shell)
    yield state.event("response.created", response=shell.body("in_progress", []))
    yield state.event("response.in_progress", response=shell.body("in_progress", []))
    try:
        async for part in answer:
            if isinstance(part, (Reasoning, Text)):
                kind = "reasoning" if isinstance(part, Reasoning) else "message"
                if state.open_kind != kind:
                    for event in state.open(kind):
                        yield event
                yield state.delta(part.text)
            elif isinstance(part, Calls):
                for event in state.calls(part.calls):
                    yield event
            elif isinstance(part, Finished):
                for event in state.close():
                    yield event
                status = final_status(part.result)
                kept(state.output)
                yield state.event(f"response.{'completed' if status == 'completed' else 'incomplete'}",
                                  response=shell.body(status, state.output, part.result))
    except ApiError as error:
        yield state.event("error", code=error.code or error.type, message=error.message, param=error.param)
