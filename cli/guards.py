"""ASGI middleware that refuses a request before any route sees it: foreign Host, missing API key.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between a streaming
response and the client's disconnect.
"""

import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tierflow.cli.openai_schema import ApiError

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


class HostGuard:
    """For a server bound to loopback: refuses a Host header that is not a loopback name with the
    bound port. A page on an attacker's domain that re-resolves to 127.0.0.1 (DNS rebinding)
    still sends its own name as Host, so it never reaches the API."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _is_loopback_host(scope):
            error = ApiError(403, "the Host header must name this machine (127.0.0.1, localhost or "
                             "[::1] with the server's port)", type="permission_error",
                             code="host_not_allowed")
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ApiKeyGuard:
    """Requires `Authorization: Bearer KEY` on every path but public_paths."""

    def __init__(self, app: ASGIApp, api_key: str, public_paths: frozenset[str]):
        self.app, self.public_paths = app, public_paths
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):  # constant time: no key guessing by timing
                error = ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                                 type="authentication_error", code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_loopback_host(scope: Scope) -> bool:
    server = scope.get("server")
    if server is None:  # a Unix socket: no network name to rebind
        return True
    bound, port = server
    names = {*LOOPBACK_NAMES, f"[{bound}]" if ":" in bound else bound}
    allowed = {f"{name}:{port}" for name in names} | (names if port == 80 else set())
    return Headers(scope=scope).get("host", "").lower() in allowed
