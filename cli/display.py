"""The CLI's consoles, and what it shows while it works: progress bars and the pack's notices."""

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from rich.console import Console

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


@contextmanager
def progress_bar(label: str):
    """A progress bar on stderr (when stderr is a terminal), fed (phase, bytes done, total)."""
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

        def update(phase: str, done: int, total: int) -> None:
            if phase != phases[-1]:  # a new phase: its rate and time left are its own
                phases.append(phase)
                bar.reset(task, description=f"{label}: {phase}")
            bar.update(task, completed=done, total=total or None)

        yield update


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


@contextmanager
def pack_notices():
    """Shows, while a model loads, where its pack goes and how large it is, if it is built (on a
    terminal, like the progress bar: piped stderr stays one line per error)."""
    if not err.is_terminal:
        yield
        return
    logger, handler = logging.getLogger("tierflow.offload.pack"), _Notices(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextmanager
def status(label: str):
    """A spinner on stderr (when stderr is a terminal) naming the step, fed step names."""
    if not err.is_terminal:
        yield None
        return
    with err.status(label) as status:
        yield lambda step: status.update(f"{label} {step}")
