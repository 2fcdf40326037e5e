"""What `tierflow chat` reads and shows: lines with editing and history on a terminal (plain lines
from a pipe), a spinner while the prompt is processed, and answers as markdown as they stream
(plain text when stdout is not a terminal, or with --plain)."""

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live
from rich.markdown import Markdown
from rich.text import Text

if TYPE_CHECKING:
    from prompt_toolkit.history import History

PROMPT = ">>> "
LineReader = Callable[[], str]  # the next line; EOFError at the end, KeyboardInterrupt on Ctrl-C


def line_reader(history_path: Path) -> LineReader:
    """prompt_toolkit's line editor, with the history of this chat and earlier ones, when the
    user types at a terminal; otherwise plain lines (a pipe, a file, a test)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return lambda: input(PROMPT)
    from prompt_toolkit import PromptSession
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("escape", "enter")  # Alt-Enter (or Esc, Enter): a new line in the same message
    def _new_line(event) -> None:
        event.current_buffer.insert_text("\n")

    session = PromptSession(history=file_history(history_path), key_bindings=keys)
    return lambda: session.prompt(PROMPT)


def file_history(path: Path) -> "History":
    """The lines typed in earlier chats and this one, kept in `path`; a file that cannot be read or
    written costs only the history, never the chat."""
    from prompt_toolkit.history import FileHistory

    class History(FileHistory):
        def load_history_strings(self):
            try:
                return list(super().load_history_strings())
            except OSError:
                return []

        def store_string(self, string: str) -> None:
            try:
                super().store_string(string)
            except OSError:
                pass

    return History(str(path))


class AnswerView:
    """Shows one answer as it streams: a spinner (on `status`, a terminal) until its first piece,
    then the text, as markdown re-rendered as it grows when `markdown`."""

    def __init__(self, console: Console, status: Console, markdown: bool):
        self.console = console
        self.status = status
        self.markdown = markdown

    def show(self, stream, reply: list[str]) -> None:
        """Appends each piece of stream to reply as it shows it (what was shown stays in reply
        when Ctrl-C interrupts)."""
        pieces = iter(stream)
        with self._spinner(stream):
            first = next(pieces, None)
        if first is None:
            return
        reply.append(first)
        if self.markdown:
            with Live(_MarkdownSoFar(reply), console=self.console, refresh_per_second=10):
                for piece in pieces:
                    reply.append(piece)
        else:
            self._write(first)
            for piece in pieces:
                reply.append(piece)
                self._write(piece)

    def end(self, notice: str | None = None) -> None:
        """Ends the answer's line (plain text) and shows a notice about it, if any."""
        if not self.markdown:
            self._write("\n")
        if notice:
            self.console.print(Text(notice, style="dim"), soft_wrap=True)

    def _write(self, text: str) -> None:
        self.console.file.write(text)
        self.console.file.flush()

    @contextmanager
    def _spinner(self, stream) -> Iterator[None]:
        if not self.status.is_terminal:
            yield
            return
        progress = _PrefillProgress()
        stream.on_prefill = progress.update
        with self.status.status(progress, spinner="dots"):
            yield


class _PrefillProgress:
    """The spinner's text: prompt tokens processed so far and seconds since it started, rendered
    afresh each time the spinner turns."""

    def __init__(self):
        self.started = time.monotonic()
        self.done = self.total = 0

    def update(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def __rich__(self) -> Text:
        seconds = f"{time.monotonic() - self.started:.1f} s"
        if not self.total:
            return Text(f"waiting for the model, {seconds}", style="dim")
        return Text(f"processing the prompt: {self.done}/{self.total} tokens, {seconds}", style="dim")


class _MarkdownSoFar:
    """The answer's text so far as markdown, parsed only when the live view refreshes (not once
    per piece)."""

    def __init__(self, reply: list[str]):
        self.reply = reply

    def __rich__(self) -> Markdown:
        return Markdown("".join(self.reply))
