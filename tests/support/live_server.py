"""A real uvicorn server on a free loopback port, for tests that talk HTTP to it."""

import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import IO
from urllib.parse import urlsplit

import httpx
import uvicorn

from tierflow.server.routes import ServerSettings, create_app, uvicorn_config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(engine, **settings) -> Iterator[str]:
    """A real uvicorn server on a thread; yields its base URL."""
    config = ServerSettings(port=free_port(), **settings)
    server = uvicorn.Server(uvicorn_config(create_app(engine, config), config, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server failed to start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{config.port}"
    server.should_exit = True
    thread.join(10)


@contextmanager
def serve_command(*options: str, log: IO[str] | None = None) -> Iterator[str]:
    """`tierflow serve` in its own process, as a user runs it; yields its base URL once /health
    answers, and stops it (SIGTERM: a graceful shutdown) when the block ends. Its output goes to
    `log` (by default a temporary file): a pipe nobody reads would fill and stop the server."""
    port = free_port()
    command = [sys.executable, "-m", "tierflow.cli.app", "serve", "--port", str(port), *options]
    with nullcontext(log) if log is not None else tempfile.TemporaryFile("w+") as output:
        server = subprocess.Popen(command, stdout=output, stderr=output, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            while not _answers(f"{url}/health"):
                if server.poll() is not None:
                    output.seek(0)
                    raise AssertionError(f"tierflow serve exited: {output.read()}")
                time.sleep(0.1)
            yield url
        finally:
            server.terminate()
            server.wait(30)


def raw_connection(url: str, timeout: float = 30) -> socket.socket:
    """A TCP connection to the server at url, for what no HTTP client sends: a body cut short,
    headers sent slowly. Reads on it time out after `timeout` seconds."""
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    """Checks the status and OpenAI's error body (no traceback in it); returns the error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
    if code:
        assert error["code"] == code
    return error


# A streamed completion that counts on, long enough to outlast the requests a test makes beside it.
LONG_COMPLETION = {"prompt": "1, 2, 3, 4,", "max_tokens": 500, "temperature": 0, "stream": True}


@contextmanager
def slot_held(url: str, headers: dict | None = None) -> Iterator[None]:
    """Holds one of the server's slots with LONG_COMPLETION, generating text. A short generation
    could end, and free its slot, before the test's next request arrives."""
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG_COMPLETION, headers=headers) as running:
        lines = running.iter_lines()
        read_until_text(lines)
        yield


def read_until_text(lines) -> None:
    """Reads SSE lines until the first chunk with generated text. The caller keeps `lines`
    referenced: a dropped httpx line iterator closes the connection."""
    for line in lines:
        if '"content": "' in line and '"content": ""' not in line or '"text": "' in line:
            return
    raise AssertionError("the stream ended without text")
