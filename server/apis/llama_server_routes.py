"""llama-server's small extras that apps use beside the chat API: `/tokenize`, `/detokenize` and
`/props`, for the model a request names (or the first served)."""

from functools import partial

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from tierflow.errors import TierflowError
from tierflow.server.generations import ReadBody, Server, on_worker_thread
from tierflow.server.openai_schema import STRICT, ApiError, parse_request


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


def add_llama_server_routes(app: FastAPI, server: Server, read_body: ReadBody) -> None:

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await parse_request(TokenizeRequest, await read_body(request))
        lease = await server.pool.acquire(body.model)
        try:
            engine = lease.engine
            ids = await on_worker_thread(partial(engine.tokenize, body.content, add_bos=body.add_special,
                                                 parse_special=body.parse_special))
            if not body.with_pieces:
                return {"tokens": ids}
            return {"tokens": [{"id": token, "piece": engine.detokenize([token])} for token in ids]}
        finally:
            lease.release()

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await parse_request(DetokenizeRequest, await read_body(request))
        lease = await server.pool.acquire(body.model)
        try:
            return {"content": await on_worker_thread(partial(lease.engine.detokenize, body.tokens))}
        except TierflowError as error:
            raise ApiError(400, f"tokens: {error}", param="tokens") from None
        finally:
            lease.release()

    @app.get("/props")
    async def props(request: Request) -> dict:
        lease = await server.pool.acquire(request.query_params.get("model"))
        try:
            engine = lease.engine
            return {"model_alias": lease.model.name, "model_path": str(engine.path),
                    "total_slots": engine.parallel, "chat_template": engine.tokenizer.template.jinja or "",
                    "default_generation_settings": {"n_ctx": engine.context_length,
                                                    "params": dict(engine.sampling_defaults)},
                    "modalities": {"vision": False, "audio": False}}
        finally:
            lease.release()
