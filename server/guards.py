"""ASGI middleware that refuses a request before any route sees it: foreign Host, foreign Origin,
missing API key, a body that is not JSON.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between a streaming
response and the client's disconnect.
"""

import hmac
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tierflow.server.error_shapes import error_body
from tierflow.server.openai_schema import ApiError

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


class _Guard:
    """Passes a request on, or answers it with the error `refusal` gives (HTTP requests only)."""

    refusal_headers: dict[str, str] | None = None  # sent with every refusal

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self.refusal(scope) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
            return
        body = error_body(scope["path"], error)
        response = JSONResponse(body, status_code=error.status, headers=self.refusal_headers)
        await response(scope, receive, send)

    def refusal(self, scope: Scope) -> ApiError | None:
        raise NotImplementedError


class HostGuard(_Guard):
    """For a server bound to loopback: refuses a Host header that is not a loopback name with the
    bound port. A page on an attacker's domain that re-resolves to 127.0.0.1 (DNS rebinding)
    still sends its own name as Host, so it never reaches the API."""

    def refusal(self, scope: Scope) -> ApiError | None:
        if _is_loopback_host(scope):
            return None
        return ApiError(403, "the Host header must name this machine (127.0.0.1, localhost or [::1] with "
                        "the server's port)", type="permission_error", code="host_not_allowed")


class OriginGuard(_Guard):
    """Refuses a request whose Origin is another site than the server's own and not allowed.

    Browsers send Origin with every cross-site POST, including the "simple" ones (a text/plain
    body, no custom header) that CORS lets through without a preflight: without this, any web
    page could make the server generate, though it could not read the answer. Clients that send
    no Origin (curl, SDKs) are not browsers acting for a page, and pass.
    """

    def __init__(self, app: ASGIApp, allowed: Iterable[str]):
        super().__init__(app)
        self.allowed = {origin.lower() for origin in allowed}

    def refusal(self, scope: Scope) -> ApiError | None:
        if self._allows(scope):
            return None
        return ApiError(403, "requests from other web pages are refused; the server's --cors-origin "
                        "option lists the origins allowed", type="permission_error",
                        code="origin_not_allowed")

    def _allows(self, scope: Scope) -> bool:
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None or "*" in self.allowed:
            return True
        own = f"{scope['scheme']}://{headers.get('host', '')}"  # the page at / calls from here
        return origin.lower() in self.allowed | {own.lower()}


class ApiKeyGuard(_Guard):
    """Requires `Authorization: Bearer KEY` (or `x-api-key: KEY`, as Anthropic's clients send it)
    on every path but public_paths. The scheme's case is free (RFC 7235); the key must match
    exactly."""

    refusal_headers = {"WWW-Authenticate": "Bearer"}

    def __init__(self, app: ASGIApp, api_key: str, public_paths: frozenset[str]):
        super().__init__(app)
        self.public_paths, self.expected = public_paths, api_key.encode()

    def refusal(self, scope: Scope) -> ApiError | None:
        if scope["path"] in self.public_paths or self._authorized(scope):
            return None
        return ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                        type="authentication_error", code="invalid_api_key")

    def _authorized(self, scope: Scope) -> bool:
        headers = Headers(scope=scope)
        scheme, _, key = headers.get("authorization", "").partition(" ")
        # Headers arrive as latin-1; encoding back gives the bytes sent. Constant time: no key
        # guessing by timing (the scheme is no secret).
        bearer = hmac.compare_digest(key.lstrip(" ").encode("latin-1"), self.expected)
        anthropic = hmac.compare_digest(headers.get("x-api-key", "").encode("latin-1"), self.expected)
        return bearer and scheme.lower() == "bearer" or anthropic


class JsonBodyGuard(_Guard):
    """Refuses a POST whose body is not declared `application/json` (parameters such as charset
    allowed) with 415, before anything reads it. The HTML forms and text/plain bodies a web page
    can send without a CORS preflight are never parsed."""

    def refusal(self, scope: Scope) -> ApiError | None:
        if scope["method"] != "POST" or _is_json(scope):
            return None
        return ApiError(415, "the request body must be JSON, sent with 'Content-Type: application/json'",
                        code="unsupported_media_type")


def _is_json(scope: Scope) -> bool:
    media_type = Headers(scope=scope).get("content-type", "").partition(";")[0]
    return media_type.strip().lower() == "application/json"


def _is_loopback_host(scope: Scope) -> bool:
    server = scope.get("server")
    if server is None:  # a Unix socket: no network name to rebind
        return True
    bound, port = server
    names = {*LOOPBACK_NAMES, f"[{bound}]" if ":" in bound else bound}
    allowed = {f"{name}:{port}" for name in names} | (names if port == 80 else set())
    return Headers(scope=scope).get("host", "").lower() in allowed
