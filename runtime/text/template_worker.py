"""Renders chat templates in worker processes with hard limits: the backstop behind the in-process budget.

The in-process checks (template_guards.py) stop the work they can see coming; one C-level call
they do not foresee (`sum` over many lists, a sort of long equal strings) can still run for
minutes, and many values each within the size limit can add up to gigabytes. So a render runs in
a worker process: before each render the worker lowers its own address-space limit (RLIMIT_AS)
to what it holds plus the render's memory allowance, so an allocation beyond that fails with
MemoryError, and the parent kills the worker when its answer is later than twice the time limit
plus `_KILL_GRACE_S`.

Workers are started once and reused (chat requests render a template per turn; a round trip costs
0.1-0.3 ms), one per concurrent render; a killed worker is replaced on the next render. They wait
while someone holds the pool (each open tokenizer does, and a server that started them ahead does
until it exits): once the last holder lets go, the idle ones are stopped, so a closed engine leaves
no process behind.
Requests are pickled (they come from the trusted parent); replies are a status byte and UTF-8 text,
never pickles, since the worker runs untrusted code. Linux only (RLIMIT_AS, /proc).
"""

import atexit
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from tierflow.errors import TemplateError
from tierflow.units import format_size

_MODULE = "tierflow.runtime.text.template_worker"
_READY, _OK, _FAILED = b"R", b"0", b"1"
_FRAME_HEADER = struct.Struct(">Q")
# Starting a worker imports jinja2: well under a second, unless the machine is very busy.
_START_TIMEOUT_S = 60.0
# How much later than twice its time limit a render's answer may come before its worker is killed.
_KILL_GRACE_S = 0.25
# Workers kept waiting beyond these (after a burst of concurrent renders) are stopped.
_MAX_IDLE_WORKERS = 4


class _WorkerGone(Exception):
    """The worker's pipe closed: it exited or was killed."""


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self) -> None:
        self._process = subprocess.Popen([sys.executable, "-m", _MODULE],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            ready = self._read(1, time.monotonic() + _START_TIMEOUT_S)
        except (_WorkerGone, TimeoutError) as exc:
            self.stop()
            raise TemplateError(f"chat template worker did not start: {exc}") from exc
        assert ready == _READY
        self._start_bytes = _address_space_bytes(self._process.pid)

    def alive(self) -> bool:
        return self._process.poll() is None

    def render(self, request: bytes, deadline: float) -> tuple[bytes, str]:
        """Send `request`; the reply's status and text. Raises TimeoutError past `deadline`."""
        try:
            self._process.stdin.write(_FRAME_HEADER.pack(len(request)) + request)
            self._process.stdin.flush()
        except OSError as exc:
            raise _WorkerGone(f"writing the request failed: {exc}") from exc
        (length,) = _FRAME_HEADER.unpack(self._read(_FRAME_HEADER.size, deadline))
        reply = self._read(length, deadline)
        return reply[:1], reply[1:].decode("utf-8", "surrogatepass")

    def _read(self, num_bytes: int, deadline: float) -> bytes:
        fd, data = self._process.stdout.fileno(), bytearray()
        while len(data) < num_bytes:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0 or not select.select([fd], [], [], remaining_s)[0]:
                raise TimeoutError("no answer in time")
            chunk = os.read(fd, num_bytes - len(data))
            if not chunk:
                raise _WorkerGone("its pipe closed")
            data += chunk
        return bytes(data)

    def grown_bytes(self) -> int:
        """How much more address space the worker holds than when it started."""
        try:
            return _address_space_bytes(self._process.pid) - self._start_bytes
        except OSError:  # it exited meanwhile: as good as grown too much
            return sys.maxsize

    def stop(self) -> int:
        """Kill the worker (if it still runs); its exit status."""
        self._process.kill()
        status = self._process.wait()
        self._process.stdin.close()
        self._process.stdout.close()
        return status


class WorkerPool:
    """Idle workers, one taken per render, so concurrent renders (server threads) never queue."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._holders = 0  # open tokenizers, and a server that started the workers ahead

    def render(self, template: str, variables: dict, *, time_limit_s: float, max_chars: int,
               memory_bytes: int) -> str:
        """Render in a worker; every failure, the worker's own included, is a TemplateError."""
        try:
            request = pickle.dumps((template, variables, time_limit_s, max_chars, memory_bytes))
        except Exception as exc:
            raise TemplateError(f"chat template variables must be plain data: {exc}") from exc
        worker = self._take()
        try:
            status, text = worker.render(request, time.monotonic() + 2 * time_limit_s + _KILL_GRACE_S)
        except TimeoutError as exc:
            worker.stop()
            raise TemplateError(f"chat template exceeded its time limit of {time_limit_s} s") from exc
        except _WorkerGone as exc:
            status = worker.stop()
            raise TemplateError(f"chat template worker died ({exc}; exit status {status})") from exc
        except BaseException:
            worker.stop()  # interrupted mid-render: its reply can no longer be matched to a request
            raise
        self._give_back(worker, memory_bytes)
        if status != _OK:
            raise TemplateError(text)
        return text

    def hold(self) -> None:
        """One more user of the workers: idle ones wait for renders while any holds the pool."""
        with self._lock:
            self._holders += 1

    def let_go(self) -> None:
        """One user fewer: the last one stops the idle workers (a render under way keeps its own)."""
        with self._lock:
            self._holders -= 1
            if self._holders > 0:
                return
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()

    def start_idle_workers(self) -> None:
        """Starts workers, in parallel, until as many wait as the pool keeps idle, and holds the pool
        until the process exits: a server does this before it serves, so a burst of first requests
        does not start a burst of processes, nor does the first request after its models unloaded."""
        with self._lock:
            self._holders += 1
            missing = _MAX_IDLE_WORKERS - len(self._idle)
        with ThreadPoolExecutor(max(missing, 1)) as starting:
            started = list(starting.map(lambda _: _Worker(), range(missing)))
        for worker in started:
            self._keep_idle(worker)

    def _take(self) -> _Worker:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the workers are its parent's
                self._idle, self._pid = [], os.getpid()
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                worker.stop()
        return _Worker()

    def _give_back(self, worker: _Worker, memory_bytes: int) -> None:
        # Each render's limit is relative to what its worker holds, and freed memory stays mapped,
        # so a worker that kept more than one allowance is replaced: no render maps much more
        # than twice its own.
        if worker.grown_bytes() <= memory_bytes:
            self._keep_idle(worker)
        else:
            worker.stop()

    def _keep_idle(self, worker: _Worker) -> None:
        with self._lock:
            if len(self._idle) < _MAX_IDLE_WORKERS:
                self._idle.append(worker)
                return
        worker.stop()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()


POOL = WorkerPool()
atexit.register(POOL.close)


def _address_space_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _render_within(memory_bytes: int, render: Callable[..., str], *args: Any) -> str:
    """`render(*args)` with at most `memory_bytes` more address space than the worker now holds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space_bytes() + memory_bytes
    if soft != resource.RLIM_INFINITY:  # never above a limit the worker inherited (soft <= hard)
        limit = min(limit, soft)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        return render(*args)
    except MemoryError:
        pass  # reported below, once the limit is lifted and the render's values are freed
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    raise TemplateError(f"chat template exceeded its memory limit of {format_size(memory_bytes)}")


def _read_frame(stream: BinaryIO) -> bytes | None:
    header = stream.read(_FRAME_HEADER.size)
    if len(header) < _FRAME_HEADER.size:
        return None  # the parent closed the pipe: it is gone or done
    return stream.read(_FRAME_HEADER.unpack(header)[0])


def _write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_FRAME_HEADER.pack(len(payload)) + payload)
    stream.flush()


def main() -> None:
    """The worker: render requests from stdin until it closes, replies on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Imported here, not above: the parent's chat_template imports this module.
    from tierflow.runtime.text.chat_template import render_in_process

    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    replies.write(_READY)
    replies.flush()
    while (request := _read_frame(requests)) is not None:
        template, variables, time_limit_s, max_chars, memory_bytes = pickle.loads(request)
        try:
            text = _render_within(memory_bytes, render_in_process, template, variables,
                                  time_limit_s, max_chars)
            status = _OK
        except TemplateError as exc:
            status, text = _FAILED, str(exc)
        _write_frame(replies, status + text.encode("utf-8", "surrogatepass"))


if __name__ == "__main__":
    main()
