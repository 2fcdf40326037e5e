"""The fork server: imports tierflow (torch, llama.cpp) and parses the seeds once, then forks one
child per call, so a case costs a fork instead of a 2 s interpreter start.

    python -m tests.fuzz.forkserver SEEDS_FOLDER WORK_FOLDER

harness.ForkServer starts and drives it: on stdin one JSON line per batch of calls, on stdout a
JSON line per finished call and one when the batch is done. Each child runs in a fresh folder
under WORK_FOLDER (its working and temporary directory, removed afterwards), in its own process
group, with its address space and core dumps limited and its output in a file; it reports through
a pipe of its own and leaves with os._exit. Whatever it does, the server and the other cases do
not see it: a crash is the child's exit status, a hang its deadline, after which its process
group (the chat template workers it started included) is killed.

Forking is safe only while the server runs a single thread (a thread holding a lock at the fork
would leave it locked in the child forever): the harness starts it with one BLAS/OpenMP thread,
it runs no torch operation, and it checks its thread count before serving.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import tests.fuzz.workload  # noqa: F401  (imported here, once, for every child)
from tests.fuzz.seeds import load_seeds

OUTPUT_TAIL_BYTES = 2000  # of a failed child's stdout and stderr, into its report
DETAIL_CHARS = 4000


@dataclass
class _Child:
    index: int
    label: str
    pid: int
    reader: int  # the read end of its report pipe
    folder: Path
    deadline: float
    started: float
    received: bytearray = field(default_factory=bytearray)


# ---------------------------------------------------------------------------------------------
# In the child


def _target(name: str) -> Any:
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _isolate(folder: Path, memory_bytes: int) -> None:
    os.setpgid(0, 0)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    null = os.open(os.devnull, os.O_RDONLY)
    output = os.open(folder / "output.txt", os.O_WRONLY | os.O_CREAT, 0o600)
    for fd, source in ((0, null), (1, output), (2, output)):
        os.dup2(source, fd)
    os.chdir(folder)
    tempfile.tempdir = str(folder)


def _tail(text: str) -> str:
    return text if len(text) <= DETAIL_CHARS else "..." + text[-DETAIL_CHARS:]


def _run_child(call: dict, writer: int, folder: Path, memory_bytes: int) -> None:
    """Run the call's target(note, *args) and report how it ended; never returns."""
    try:
        _isolate(folder, memory_bytes)
        report = os.fdopen(writer, "w", encoding="utf-8")

        def send(message: dict) -> None:
            report.write(json.dumps(message) + "\n")
            report.flush()

        try:
            value = _target(call["target"])(lambda text: send({"note": text}), *call["args"])
            send({"status": "ok", "value": value})
        except MemoryError:
            send({"status": "memory", "detail": _tail(traceback.format_exc())})
        except BaseException as error:  # noqa: BLE001  (any other exception is the finding)
            send({"status": "exception", "detail": _tail(f"{type(error).__name__}: {error}\n"
                                                        f"{traceback.format_exc()}")})
    finally:
        os._exit(0)


# ---------------------------------------------------------------------------------------------
# In the server


def _start(index: int, call: dict, work: Path, batch: dict) -> _Child:
    folder = Path(tempfile.mkdtemp(prefix=f"case-{index}-", dir=work))
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        _run_child(call, writer, folder, batch["memory_bytes"])
    os.close(writer)
    try:
        os.setpgid(pid, pid)  # also done by the child; whichever runs first
    except OSError:
        pass  # the child has set it already, or has exited
    now = time.monotonic()
    return _Child(index, call["label"], pid, reader, folder, now + batch["timeout_s"], now)


def _exit_text(status: int) -> tuple[str, str]:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        return "signal", f"killed by {signal.Signals(number).name} ({number})"
    return "exit", f"exited with status {os.WEXITSTATUS(status)} without reporting"


def _outcome(child: _Child, messages: list[dict], status: int, timed_out: bool) -> dict:
    """The child's own report, or else what its end says: the deadline, a signal, an exit."""
    final = next((message for message in messages if "status" in message), None)
    if final is not None:
        return final
    if timed_out:
        return {"status": "timeout", "detail": f"no answer within {child.deadline - child.started:.0f} s"}
    kind, text = _exit_text(status)
    return {"status": kind, "detail": text}


def _finish(child: _Child, timed_out: bool) -> dict:
    """Reap the child, kill what it left running, and make its result."""
    os.close(child.reader)
    try:
        os.killpg(child.pid, signal.SIGKILL)  # its template workers; the child itself if it hangs
    except ProcessLookupError:
        pass
    _, status = os.waitpid(child.pid, 0)
    # Whole lines only: a child killed while writing leaves a partial last one.
    messages = [json.loads(line) for line in child.received.split(b"\n")[:-1]]
    result = _outcome(child, messages, status, timed_out)
    output_path = child.folder / "output.txt"  # made by the child, unless it failed before
    output = output_path.read_bytes()[-OUTPUT_TAIL_BYTES:] if output_path.exists() else b""
    if result["status"] != "ok" and output.strip():
        result["detail"] += "\noutput: " + output.decode("utf-8", "replace")
    shutil.rmtree(child.folder, ignore_errors=True)
    return {"index": child.index, "label": child.label, "seconds": round(time.monotonic() - child.started, 3),
            "notes": [message["note"] for message in messages if "note" in message], **result}


def run_batch(batch: dict, work: Path) -> None:
    """Run the batch's calls, `jobs` at a time, writing each result to stdout as it ends."""
    pending, running = deque(enumerate(batch["calls"])), {}
    while pending or running:
        while pending and len(running) < batch["jobs"]:
            child = _start(*pending.popleft(), work, batch)
            running[child.reader] = child
        wait_s = max(0.0, min(child.deadline for child in running.values()) - time.monotonic())
        readable, _, _ = select.select(list(running), [], [], wait_s)
        for reader in readable:
            chunk = os.read(reader, 1 << 16)
            if chunk:
                running[reader].received += chunk
            else:
                _send(_finish(running.pop(reader), timed_out=False))
        for reader in [r for r, child in running.items() if child.deadline <= time.monotonic()]:
            _send(_finish(running.pop(reader), timed_out=True))
    _send({"done": True})


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _check_single_thread() -> None:
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise RuntimeError(f"the fork server runs {threads} threads; a fork would copy the locks they hold "
                           "(start it through harness.ForkServer, which limits BLAS and OpenMP threads)")


def main(argv: list[str]) -> None:
    seeds_folder, work_folder = argv
    torch.set_num_threads(1)
    load_seeds(seeds_folder)
    _check_single_thread()
    _send({"ready": True})
    for line in sys.stdin:
        run_batch(json.loads(line), Path(work_folder))


if __name__ == "__main__":
    main(sys.argv[1:])
