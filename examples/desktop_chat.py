"""A desktop chat on tierflow, in Tk: a progress bar while the model loads, the answer streamed into
the window, a stop button, and the engine closed with the window.

    python examples/desktop_chat.py [MODEL]     # a path or a model name; the bundled model by default

ChatSession holds the engine and works on worker threads, which tell the window what happened through
a queue the window drains on Tk's thread (`after`); it needs no display (tests/test_desktop_example.py).
"""

import queue
import sys
import threading

from tierflow import Engine, LoadPhase

POLL_MS = 30  # how often the window takes the workers' updates


class ChatSession:
    """The engine, loaded and asked on worker threads. Updates: ("progress", phase, done, total),
    ("ready", notices), ("piece", text), ("done", finish_reason), ("error", message)."""

    def __init__(self, model: str | None = None) -> None:
        self.model, self.engine = model, None
        self.updates: queue.Queue[tuple] = queue.Queue()
        self.messages: list[dict] = []  # the conversation so far
        self._stream = None  # the answer being written
        self._worker: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def start_loading(self) -> None:
        self._start(self._load)

    def ask(self, text: str) -> None:
        """Starts the answer to `text` (the session must not be busy)."""
        self._start(lambda: self._answer(text))

    def stop(self) -> None:
        """Cancels the answer being written: it ends with finish_reason "cancelled"."""
        if self._stream is not None:
            self._stream.cancel()

    def close(self) -> None:
        """Stops the answer, waits for the worker (a load ends first), then closes the engine."""
        self.stop()
        if self._worker is not None:
            self._worker.join()
        if self.engine is not None:
            self.engine.close()

    def _start(self, work) -> None:
        def reporting() -> None:
            try:
                work()
            except Exception as error:  # shown in the window, which stays usable
                self.updates.put(("error", str(error)))

        self._worker = threading.Thread(target=reporting, daemon=True)
        self._worker.start()

    def _load(self) -> None:
        def progress(phase: LoadPhase, done: int, total: int) -> None:  # on the load's thread
            self.updates.put(("progress", phase, done, total))

        self.engine = Engine.load(self.model, progress=progress)
        self.updates.put(("ready", self.engine.notices))

    def _answer(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        self._stream = self.engine.chat_stream(self.messages)
        for piece in self._stream:
            self.updates.put(("piece", piece))
        result, self._stream = self._stream.result, None
        self.messages.append({"role": "assistant", "content": result.text})
        self.updates.put(("done", result.finish_reason))


class ChatWindow:
    """The window: it only shows what the session's updates say, and passes the buttons on."""

    def __init__(self, root, session: ChatSession) -> None:
        from tkinter import scrolledtext, ttk

        self.root, self.session = root, session
        self.status, self.bar = ttk.Label(root, text="starting"), ttk.Progressbar(root, length=400)
        self.text, self.entry = scrolledtext.ScrolledText(root, height=20, wrap="word"), ttk.Entry(root)
        self.send_button = ttk.Button(root, text="Send", command=self.send, state="disabled")
        self.stop_button = ttk.Button(root, text="Stop", command=session.stop, state="disabled")
        for widget in (self.status, self.bar, self.text, self.entry, self.send_button, self.stop_button):
            widget.pack(fill="x", padx=6, pady=3)
        self.entry.bind("<Return>", lambda _event: self.send())
        root.protocol("WM_DELETE_WINDOW", self.close)
        session.start_loading()
        root.after(POLL_MS, self.poll)

    def send(self) -> None:
        text = self.entry.get().strip()
        if not text or self.session.busy or self.session.engine is None:
            return
        self.entry.delete(0, "end")
        self.text.insert("end", f"\nyou: {text}\nmodel: ")
        self._set_busy(True)
        self.session.ask(text)

    def poll(self) -> None:
        while not self.session.updates.empty():  # only this thread takes from the queue
            self.show(self.session.updates.get())
        self.root.after(POLL_MS, self.poll)

    def show(self, update: tuple) -> None:
        kind, *values = update
        if kind == "progress":
            phase, done, total = values
            self.status.config(text=phase.label)
            self.bar.config(maximum=total or 1, value=done if total else 0)
        elif kind == "piece":
            self.text.insert("end", values[0])
            self.text.see("end")
        elif kind == "done":
            self.text.insert("end", " [stopped]\n" if values[0] == "cancelled" else "\n")
        elif kind == "ready":
            self.status.config(text="; ".join(["ready", *values[0]]))  # and what the load decided
        else:
            self.status.config(text=f"error: {values[0]}")
        if kind in ("ready", "done", "error"):  # free for the next question
            self._set_busy(False)

    def close(self) -> None:
        self.session.close()
        self.root.destroy()

    def _set_busy(self, busy: bool) -> None:
        self.send_button.config(state="disabled" if busy else "normal")
        self.stop_button.config(state="normal" if busy else "disabled")


def main(argv: list[str]) -> None:
    import tkinter

    root = tkinter.Tk(className="tierflow chat")
    ChatWindow(root, ChatSession(argv[0] if argv else None))
    root.mainloop()


if __name__ == "__main__":
    main(sys.argv[1:])
