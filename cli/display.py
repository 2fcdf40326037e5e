"""The CLI's consoles, and what it shows while it works: progress bars and the pack's notices."""

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from rich.console import Console

from tierflow.progress import LoadPhase

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


@contextmanager
def progress_bar(label: str):
    """A progress bar on stderr (when stderr is a terminal), fed (phase, done, total): a load's
    LoadPhase, shown by its label, or a phase named in words (a conversion's). A phase's done and
    total are bytes, but the probe's, which are steps."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    if not err.is_terminal:
        yield None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as bar:
        task, phases = bar.add_task(label, total=None), [None]

        def update(phase: LoadPhase | str, done: int, total: int) -> None:
            if phase != phases[-1]:  # a new phase: its rate and time left are its own
                phases.append(phase)
                bar.reset(task)
            bar.update(task, description=_described(label, phase, done, total))
            if phase != LoadPhase.PROBING:  # bytes (the probe's steps are said in the description)
                bar.update(task, completed=done, total=total or None)

        yield update


def _described(label: str, phase: LoadPhase | str, done: int, total: int) -> str:
    if not isinstance(phase, LoadPhase):
        return f"{label}: {phase}"
    if phase == LoadPhase.PROBING:
        return f"{label}: {phase.label}, step {min(done + 1, total)} of {total}"
    return f"{label}: {phase.label}"


def model_name(model: Optional[str]) -> str:
    """A file's name, or the model name as given."""
    if model is None:
        return "SmolLM2-135M-Instruct (bundled)"
    return Path(model).name if Path(model).exists() else model


def loading(model: Optional[str]):
    """A progress bar on stderr while weights load (when stderr is a terminal)."""
    return progress_bar(f"loading {model_name(model)}")


class _Notices(logging.Handler):
    """Shows the library's INFO messages (a pack's size and place, as it is built) on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        err.print(record.getMessage(), markup=False, soft_wrap=True)


# The library's loggers whose INFO messages a load shows: the pack's (where it goes, how large, the
# temporaries of killed builds removed) and the probe's (how long measuring the machine takes).
NOTICE_LOGGERS = ("tierflow.offload.pack", "tierflow.offload.plan.probe")


@contextmanager
def pack_notices():
    """Shows, while a model loads, where its pack goes and how large it is, if it is built, and how
    long measuring the machine takes, if it is measured first (on a terminal, like the progress bar:
    piped stderr stays one line per error)."""
    if not err.is_terminal:
        yield
        return
    handler = _Notices(logging.INFO)
    loggers = [logging.getLogger(name) for name in NOTICE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


@contextmanager
def status(label: str):
    """A spinner on stderr (when stderr is a terminal) naming the step, fed (step, steps done, steps)
    as the probe reports them (offload/plan/probe.py)."""
    if not err.is_terminal:
        yield None
        return
    with err.status(label) as status:
        yield lambda step, done, total: status.update(f"{label} {step}")


def load_engine(model, **options):
    """Engine.load with a command's options; what the load decided for the user (a shorter
    default context) is said once, on stderr."""
    from tierflow.runtime.api.engine import Engine

    with pack_notices(), loading(model) as progress:
        engine = Engine.load(model, progress=progress, **options)
    for notice in engine.notices:
        err.print(f"[yellow]note:[/yellow] {notice}", soft_wrap=True)
    return engine
