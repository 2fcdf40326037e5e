"""Runs calls in the fork server's children and hands back how each ended.

    with ForkServer(seeds_folder, work_folder) as server:
        for result in server.run([case_call(seeds_folder, 7)], jobs=2):
            print(result.label, result.status, result.detail)

A call names a function "module:function" that the child runs as function(note, *args); note(text)
sends a line ahead of the result (a case sends its description, so a crash still names it).
Statuses: "ok" (the function returned; `value` is what it returned), "exception" (it raised; any
TierflowError was already taken as an answer by the function itself), "memory" (a MemoryError: it
went past the address-space limit), "signal" (the process died of one: a segfault or abort in C),
"exit" (it left without reporting), "timeout" (killed at the time limit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# A normal case's child maps ~0.7 GiB (torch, llama.cpp, a small model); four times that is room
# for any sane load, and stops unbounded growth long before it troubles the machine.
DEFAULT_MEMORY_BYTES = 3 << 30
# A normal case takes well under a second; a hang is what is still running after this.
DEFAULT_TIMEOUT_S = 60.0
# One thread per BLAS and OpenMP pool, so the fork server has no thread but its own (see forkserver.py).
_SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Call:
    label: str
    target: str  # "module:function"
    args: tuple = ()


@dataclass(frozen=True)
class Result:
    label: str
    status: str  # see the module docstring
    detail: str  # the exception, signal or limit; empty when ok
    notes: tuple[str, ...]
    value: Any  # what the function returned, when ok
    seconds: float

    @property
    def failed(self) -> bool:
        return self.status != "ok"

    def report(self) -> str:
        """The result as a failure list shows it: the call, its notes and what happened."""
        lines = [f"{self.label}: {self.status}", *(f"  {note}" for note in self.notes)]
        lines += [f"  {line}" for line in (self.detail or json.dumps(self.value)).splitlines()]
        return "\n".join(lines)


def case_call(seeds_folder: str | os.PathLike, case: int | str) -> Call:
    """The call that runs fuzz case `case`: a number, or a name from corpus.NAMED_CASES."""
    label = f"seed {case}" if isinstance(case, int) else f"case {case!r}"
    return Call(label, "tests.fuzz.workload:run_case", (str(seeds_folder), case))


class ForkServer:
    """A running fork server (forkserver.py); close it, or use `with`."""

    def __init__(self, seeds_folder: str | os.PathLike, work_folder: str | os.PathLike):
        env = {**os.environ, **_SINGLE_THREADED}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz.forkserver", str(seeds_folder), str(work_folder)],
            cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._receive() != {"ready": True}:
            raise RuntimeError("the fork server did not start")

    def run(self, calls: Sequence[Call], *, jobs: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
            memory_bytes: int = DEFAULT_MEMORY_BYTES) -> Iterator[Result]:
        """Each call's result as it finishes, `jobs` calls at a time."""
        batch = {"calls": [{"label": c.label, "target": c.target, "args": list(c.args)} for c in calls],
                 "jobs": jobs, "timeout_s": timeout_s, "memory_bytes": memory_bytes}
        self._process.stdin.write(json.dumps(batch) + "\n")
        self._process.stdin.flush()
        while "done" not in (message := self._receive()):
            yield Result(message["label"], message["status"], message.get("detail", ""),
                         tuple(message["notes"]), message.get("value"), message["seconds"])

    def _receive(self) -> dict:
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited (status {self._process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        """Stop the server once its batch is done (results nobody read are dropped)."""
        self._process.stdin.close()
        for _ in self._process.stdout:
            pass
        self._process.wait()
        self._process.stdout.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
