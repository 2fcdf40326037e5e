"""The interactive loop behind `tierflow chat`."""

import sys

from rich.console import Console

HELP = "/reset forgets the conversation, /exit or Ctrl-D quits, Ctrl-C stops an answer"


class ChatSession:
    """Keeps the conversation and streams each answer; Ctrl-C ends an answer, not the session."""

    def __init__(self, engine, system: str | None, sampling: dict, console: Console):
        self.engine = engine
        self.sampling = sampling
        self.console = console
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.system)

    def run(self) -> None:
        self.console.print(f"[dim]{self.engine.config.name} - {HELP}[/dim]")
        while True:
            try:
                line = input(">>> ")
            except KeyboardInterrupt:
                self.console.print(f"\n[dim]({HELP})[/dim]")
                continue
            except EOFError:
                self.console.print()
                return
            command = line.strip()
            if command in ("/exit", "/quit", "/bye"):
                return
            if command == "/reset":
                self.messages = list(self.system)
                self.console.print("[dim]conversation cleared[/dim]")
            elif command:
                self.answer(line)

    def answer(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        reply = []
        try:
            for piece in self.engine.chat_stream(self.messages, **self.sampling):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        sys.stdout.write("\n")
        self.messages.append({"role": "assistant", "content": "".join(reply)})
