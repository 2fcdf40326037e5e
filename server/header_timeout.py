"""A time limit on a request's headers, which uvicorn does not have.

uvicorn times out only a kept-alive connection that sends nothing more (`timeout_keep_alive`): a
connection that sends no request, or its headers a byte at a time (slowloris), is held open for as
long as the client likes, and a few hundred of them hold every file descriptor the server has. No
ASGI middleware can see them: the app is called once the headers are in. So the limit is in the
HTTP protocol: uvicorn's h11 protocol, closing a connection whose request's headers have not all
come within `header_timeout_s` of the connection (its first request) or of the request's first
byte (the next ones), as nginx's `client_header_timeout` does. Once the headers are in, the limit
is off: reading the body and answering take as long as they take.
"""

import asyncio
import logging
from functools import partial

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tierflow.server.routes")


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, with the header time limit. Build it with `header_timeout_protocol`."""

    def __init__(self, *args, header_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:  # the next request begins
            self._start_header_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # its headers are in
            self._stop_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.debug("closed a connection whose request headers took over %g s", self.header_timeout_s)
            self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> partial:
    """What uvicorn.Config's `http` takes to serve with HeaderTimeoutProtocol."""
    return partial(HeaderTimeoutProtocol, header_timeout_s=header_timeout_s)
