"""HTTP clients in processes of their own, for tests that time a server under load: the test
process's garbage collections and threads, which a long test session makes slow, must not count
as the server's latency.

Run as `python -m tests.support.load_clients poll URL EVERY_S` or `... send URL`; the tests use
HealthPoller and send_at_once.
"""

import json
import pickle
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx

# A body is bytes, or a list of chunks sent chunked (no Content-Length).
Body = bytes | list[bytes]


class HealthPoller:
    """Polls URL/health every `every_s` from a process of its own while in its `with` block:
    `latencies` (send to answer) and `statuses` of every poll once the block has ended."""

    def __init__(self, url: str, every_s: float):
        self._process = _client("poll", url, str(every_s))
        self.latencies: list[float] = []
        self.statuses: list[int] = []

    def __enter__(self) -> "HealthPoller":
        assert self._process.stdout.readline().strip() == b"answered", "the first health check got no answer"
        return self

    def __exit__(self, *exc) -> None:
        self._process.stdin.close()
        polls = json.loads(self._process.stdout.read())
        self._process.wait(30)
        self.statuses = [status for status, _ in polls]
        self.latencies = [seconds for _, seconds in polls]


def send_at_once(url: str, requests: list[tuple[str, Body]]) -> list[int]:
    """POSTs every (path, JSON body) at once, each on a thread of a process of its own; the
    statuses, in order."""
    process = _client("send", url)
    out, _ = process.communicate(pickle.dumps(requests), timeout=600)
    assert process.returncode == 0, "the sending process failed"
    return json.loads(out)


def _client(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", __name__, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)


def _poll(url: str, every_s: float) -> None:
    """Polls until stdin closes, then prints each poll's status and latency as JSON."""
    polls = []
    with httpx.Client(timeout=120) as client:
        while not select.select([sys.stdin], [], [], every_s)[0]:
            start = time.perf_counter()
            status = client.get(f"{url}/health").status_code
            polls.append((status, time.perf_counter() - start))
            if len(polls) == 1:
                print("answered", flush=True)
    print(json.dumps(polls), flush=True)


def _send(url: str) -> None:
    requests = pickle.load(sys.stdin.buffer)
    with httpx.Client(timeout=600, headers={"Content-Type": "application/json"}) as client, \
            ThreadPoolExecutor(len(requests)) as pool:
        sent = [pool.submit(client.post, f"{url}{path}", content=_content(body)) for path, body in requests]
        print(json.dumps([future.result().status_code for future in sent]), flush=True)


def _content(body: Body) -> bytes | Iterator[bytes]:
    return body if isinstance(body, bytes) else iter(body)


if __name__ == "__main__":
    if sys.argv[1] == "poll":
        _poll(sys.argv[2], float(sys.argv[3]))
    else:
        _send(sys.argv[2])
