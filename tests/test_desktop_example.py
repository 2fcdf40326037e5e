"""examples/desktop_chat.py: its session's logic headless, and its Tk window once under Xvfb."""

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tierflow import LoadPhase, TierflowError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "desktop_chat.py"
TIMEOUT_S = 120
STORY = "Write a long story about a dragon."


def load_example():
    spec = importlib.util.spec_from_file_location("desktop_chat", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


desktop_chat = load_example()


def updates_until(session, kinds: set[str]) -> list[tuple]:
    """The session's updates up to the first of one of `kinds`."""
    deadline, seen = time.monotonic() + TIMEOUT_S, []
    while not seen or seen[-1][0] not in kinds:
        seen.append(session.updates.get(timeout=max(deadline - time.monotonic(), 0.001)))
    return seen


@pytest.fixture(scope="module")
def loaded():
    """A session that has loaded the bundled model, and the updates its load sent."""
    session = desktop_chat.ChatSession()
    session.start_loading()
    updates = updates_until(session, {"ready", "error"})
    yield session, updates
    session.close()


def test_loading_reports_the_load_phases_then_ready(loaded):
    _, updates = loaded
    *progress, last = updates
    assert progress and all(kind == "progress" for kind, *_ in progress)
    assert all(isinstance(phase, LoadPhase) for _, phase, _, _ in progress)
    assert last[0] == "ready"


def test_an_answer_streams_its_pieces_then_finishes(loaded):
    session, _ = loaded
    session.ask("Name three fruits.")
    *pieces, last = updates_until(session, {"done", "error"})
    assert last[0] == "done" and last[1] in ("stop", "length")
    assert "".join(text for _, text in pieces) == session.messages[-1]["content"] != ""


def test_stop_cancels_the_answer(loaded):
    session, _ = loaded
    session.ask(STORY)
    updates_until(session, {"piece"})
    session.stop()
    assert updates_until(session, {"done", "error"})[-1] == ("done", "cancelled")


def test_closing_the_session_closes_its_engine():
    session = desktop_chat.ChatSession()
    session.start_loading()
    updates_until(session, {"ready", "error"})
    session.close()
    with pytest.raises(TierflowError, match="closed"):
        session.engine.generate("Hi", max_tokens=1)


@pytest.fixture
def display(monkeypatch):
    """A virtual X display (Xvfb) for the window, as DISPLAY."""
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed: the window is tested only where it is")
    if importlib.util.find_spec("tkinter") is None:
        pytest.skip("this Python has no tkinter")
    read, write = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-nolisten", "tcp"], pass_fds=(write,),
                              stderr=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read) as number:
        monkeypatch.setenv("DISPLAY", f":{number.readline().strip()}")
    yield
    server.terminate()
    server.wait(TIMEOUT_S)


def pump(root, until) -> None:
    """Runs Tk's event loop until `until()` holds."""
    deadline = time.monotonic() + TIMEOUT_S
    while not until():
        assert time.monotonic() < deadline, "the window did not get there in time"
        root.update()
        time.sleep(0.01)


@pytest.mark.slow
def test_the_window_loads_answers_and_closes_its_engine(display):
    import tkinter

    root = tkinter.Tk()
    window = desktop_chat.ChatWindow(root, desktop_chat.ChatSession())

    def ready() -> bool:  # loaded, or answered: Send is enabled
        return str(window.send_button["state"]) == "normal"

    pump(root, ready)
    window.entry.insert(0, "Name three fruits.")
    window.send()
    pump(root, lambda: not ready())
    pump(root, ready)
    answer = window.session.messages[-1]["content"]
    assert answer and window.text.get("1.0", "end").rstrip().endswith(answer.rstrip())
    engine = window.session.engine
    window.close()
    with pytest.raises(TierflowError, match="closed"):
        engine.generate("Hi", max_tokens=1)
