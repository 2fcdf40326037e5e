"""Peak memory measured in a child process: what a block of code adds to the RSS of a process of its own.

    measured = in_child('''
        before = rss()
        ...the code measured...
        report(before=before, peak=peak_rss())
    ''', env={"TIERFLOW_CACHE": str(folder)})

The body runs with this module's helpers in scope (rss, peak_rss, report); it runs from the repository's
root, so `tests.support` imports, and its environment is this process's with `env` on top. `report`
sends keyword arguments back as JSON (the last report wins); a child that fails is an AssertionError
carrying its stderr. Peak RSS is the kernel's high-water mark of the process's memory (VmHWM), not
getrusage's ru_maxrss: that one survives exec, so a child started from a large parent (pytest, having
written a model) would report its parent's RSS.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "MEASURED "

PRELUDE = f'''
import json as _json
import resource as _resource


def rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _resource.getpagesize()


def peak_rss() -> int:
    """The most this process has had resident so far, in bytes: its memory's high-water mark."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def report(**fields) -> None:
    print({MARK!r} + _json.dumps(fields), flush=True)

'''


def in_child(body: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    """Runs `body` in a new Python process and returns what it reported."""
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout)
    assert done.returncode == 0, f"the child failed ({done.returncode}):\n{done.stderr[-4000:]}"
    reports = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    assert reports, f"the child reported nothing:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return json.loads(reports[-1][len(MARK):])
