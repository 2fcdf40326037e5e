"""The server's address, bound before a model loads: an address that cannot be bound is one clear
error at once, not uvicorn's log line after the load."""

import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tierflow.errors import InvalidArgumentError

if TYPE_CHECKING:
    from tierflow.server.routes import ServerSettings


@contextmanager
def listening(settings: "ServerSettings") -> Iterator[list[socket.socket]]:
    """The server's address bound, each of the host's (a name may have an IPv4 and an IPv6 one) as
    asyncio's create_server binds them, until the block ends. One that cannot be bound is an
    InvalidArgumentError naming it and what to do, rather than uvicorn's log line and exit code 1;
    binding before a model loads makes that error come at once."""
    sockets: list[socket.socket] = []
    try:
        try:
            for family, kind, proto, _, address in dict.fromkeys(socket.getaddrinfo(
                    settings.host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
                sockets.append(socket.socket(family, kind, proto))
                sockets[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait
                if family == socket.AF_INET6:
                    sockets[-1].setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sockets[-1].bind(address)
        except OSError as error:
            raise InvalidArgumentError(_bind_failure(settings, error)) from None
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def _bind_failure(settings: "ServerSettings", error: OSError) -> str:
    where = settings.url.removeprefix("http://").rstrip("/")
    if error.errno == errno.EADDRINUSE:
        return f"{where} is already in use (by another server?); choose another port with --port"
    if error.errno == errno.EACCES:
        return f"no permission to listen on {where} (ports below 1024 need privileges); choose another " \
               "port with --port"
    return f"cannot listen on {where}: {error.strerror or error}; --host must be an address of this " \
           "machine (127.0.0.1, the default; 0.0.0.0 for all of its addresses)"
