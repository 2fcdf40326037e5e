"""Files written under a temporary name and then renamed into place: the name, the lock that tells a
live writer's temporary from one a killed process left, and the cleanup of those.

    with writing(path) as (temporary, file):  # NAME.<pid>.tmp beside path, created and locked
        file.write(...)                       # removed on an exception, and on SIGTERM (see below)
        os.replace(temporary, path)
    stale = stale_temporaries(folder)    # the temporaries of writers that are gone, with their sizes
    removed = remove_stale(folder)       # ... removed (those it could remove)

A process killed midway (kill -9, an out-of-memory kill, a power cut) runs no cleanup: its temporary
stays, up to the size of the file it was writing. A temporary is stale when both

- no process of its pid is alive here (a live one keeps its temporaries however long it writes), and
- nobody holds its lock: the writer takes an exclusive flock on it for as long as it writes, and the
  system lets go of the lock when the process dies. That keeps a live writer's temporary whose pid
  means nothing here (another container's pid namespace, another host sharing the folder over NFS,
  where flock is a byte-range lock the server keeps).

SIGTERM (what `timeout`, `docker stop` and systemd send) kills a Python process without running its
`finally` blocks. While a temporary is being written on the main thread of a process that leaves
SIGTERM at its default, a handler removes the temporaries being written and then lets the signal
kill the process as it would have (same exit status). A process that handles SIGTERM itself, or a
write on another thread (where Python cannot install a handler), keeps its own behaviour: its
temporary is removed by the next cleanup once the process is gone.
"""

import fcntl
import os
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

SUFFIX = ".tmp"
_PID_NAME = re.compile(r"\.(\d+)\.tmp$")


@dataclass(frozen=True)
class StaleTemporary:
    path: Path
    nbytes: int
    pid: int  # the process that was writing it, gone

    def as_dict(self) -> dict:
        return {"name": self.path.name, "path": str(self.path), "bytes": self.nbytes, "pid": self.pid}


def temporary_path(path: Path) -> Path:
    """Where this process writes `path` before renaming it: NAME.<pid>.tmp beside it."""
    return path.with_name(f"{path.name}.{os.getpid()}{SUFFIX}")


@contextmanager
def writing(path: Path, mode: str = "wb") -> Iterator[tuple[Path, BinaryIO]]:
    """Creates path's temporary (opened with `mode`: "wb" truncates one this pid left), locks it for as
    long as the block runs, removes it on SIGTERM (module docstring) and, unless the block renamed it
    away, at the block's end. The block gets the temporary's path and its open file, which it may
    close (that lets go of the lock) once it has renamed it."""
    temporary = temporary_path(path)
    with open(temporary, mode) as file:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX)
        try:
            with _removed_on_sigterm(temporary):
                yield temporary, file
        finally:
            temporary.unlink(missing_ok=True)


def stale_temporaries(folder: Path, pattern: str = f"*{SUFFIX}") -> list[StaleTemporary]:
    """The temporaries in `folder` matching `pattern` (NAME.<pid>.tmp) whose writer is gone: its pid
    not alive here, and its lock free."""
    stale = []
    for path in sorted(folder.glob(pattern)):
        match = _PID_NAME.search(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _alive(pid) or _locked(path):
            continue
        try:
            stale.append(StaleTemporary(path, path.stat().st_size, pid))
        except FileNotFoundError:
            continue  # removed meanwhile
    return stale


def remove_stale(folder: Path, pattern: str = f"*{SUFFIX}") -> list[StaleTemporary]:
    """Removes the stale temporaries in `folder` (stale_temporaries); returns those it removed."""
    removed = []
    for stale in stale_temporaries(folder, pattern):
        try:
            stale.path.unlink()
        except FileNotFoundError:
            continue  # another process removed it first
        except OSError:
            continue  # not ours to remove (a read-only or foreign folder): left as it is
        removed.append(stale)
    return removed


def _alive(pid: int) -> bool:
    """Whether a process of this pid exists here (a zombie, not yet reaped, counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _locked(path: Path) -> bool:
    """Whether a process holds the lock on the file (or it cannot be opened to find out)."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))  # NFS locks exclusively only for writing
    except FileNotFoundError:
        return True  # gone: nothing to remove
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # lets go of the lock if taken
    return False


# -- SIGTERM ----------------------------------------------------------------------------------

_being_written: set[Path] = set()
_sigterm_lock = threading.Lock()
_installed = False  # whether our handler replaced the default one


@contextmanager
def _removed_on_sigterm(temporary: Path) -> Iterator[None]:
    global _installed
    with _sigterm_lock:
        _being_written.add(temporary)
        if not _installed and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _installed = True
    try:
        yield
    finally:
        with _sigterm_lock:
            _being_written.discard(temporary)
            if _installed and not _being_written and threading.current_thread() is threading.main_thread() \
                    and signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                _installed = False


def _on_sigterm(signum, frame) -> None:
    """Removes the temporaries being written, then dies of the signal as the default would."""
    try:
        being_written = list(_being_written)  # no lock: the thread holding it may be the one interrupted
    except RuntimeError:  # changed by another thread meanwhile
        being_written = list(_being_written)
    for temporary in being_written:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
