"""The `tierflow` command run in the test's own process, through the entry point the console script
calls (`main`, which turns a TierflowError into one line on stderr and exit code 2), with stdin (read
strictly as UTF-8, as a UTF-8 locale reads it), stdout, stderr, argv and the environment of its own.
A subprocess would check the same code and pay an interpreter start-up and a torch import, seconds
each, per run; tests of what only a process has (signals, the installed script) still start one."""

import os
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from tierflow.cli.app import main


@dataclass(frozen=True)
class Finished:
    """What a finished command left, as subprocess.run's result names it."""

    returncode: int
    stdout: str
    stderr: str


def run_tierflow(*args: str | bytes, input: str | bytes | None = None,
                 env: Mapping[str, str] | None = None) -> Finished:
    """Runs `tierflow ARGS...`; a bytes argument arrives as the interpreter decodes argv (a byte
    that is not UTF-8 becomes a lone surrogate). `env` adds to os.environ for the run."""
    argv = ["tierflow", *(os.fsdecode(arg) for arg in args)]
    with (CliRunner().isolation(input=input, env=env) as (stdout, stderr, _), _argv(argv), _engines_closed(),
          _environment_restored()):
        returncode = _exit_code()
        sys.stdout.flush()
        sys.stderr.flush()
    return Finished(returncode, stdout.getvalue().decode(), stderr.getvalue().decode(errors="replace"))


def _exit_code() -> int:
    try:
        main()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


@contextmanager
def _argv(argv: list[str]):
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


@contextmanager
def _environment_restored():
    """What the command set in os.environ (--offline sets TIERFLOW_OFFLINE) ends with it, as its
    process would."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def _engines_closed():
    """Closes the engines the command loaded when it ends, as its process's exit would (`run` and
    `chat` leave theirs open): their streamer threads and files must not outlive it here."""
    from tierflow.runtime.api.engine import Engine

    loaded, load = [], Engine.load.__func__

    def recorded(cls, *args, **kwargs):
        loaded.append(load(cls, *args, **kwargs))
        return loaded[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "load", classmethod(recorded))
        try:
            yield
        finally:
            for engine in loaded:
                engine.close()
