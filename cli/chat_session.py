"""The interactive loop behind `tierflow chat`: the conversation, its slash commands (handled here,
never sent to the model) and each streamed answer."""

import difflib
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.text import Text

from tierflow.cli.chat_settings import (
    current_settings,
    load_conversation,
    save_conversation,
    with_setting,
)
from tierflow.cli.chat_terminal import AnswerView, LineReader
from tierflow.errors import ContextLengthError, InvalidArgumentError
from tierflow.runtime.generation.context_shift import FittedChat, fit_chat

HINT = "/help lists the commands, Ctrl-D quits, Ctrl-C stops an answer"


class ChatSession:
    """Keeps the conversation and streams each answer; Ctrl-C ends an answer, not the session.

    An answer stopped by Ctrl-C stays in the conversation as far as it got, as llama.cpp's and
    ollama's chats keep it: the model sees the partial text as its own turn, and the message
    carries "stopped": true (kept by /save, never sent to the model). So does an answer cut by
    the end of the context: a conversation that outgrows the context drops its oldest turns
    (runtime/generation/context_shift.py), which the session forgets too, and says so once.
    """

    def __init__(self, engine, system: str | None, settings: dict, console: Console, *,
                 read_line: LineReader, view: AnswerView):
        self.engine = engine
        self.system = system
        self.settings = dict(settings)  # sampling the user chose, and max_tokens
        self.messages: list[dict] = []  # the conversation, without the system prompt
        self.console = console
        self.read_line = read_line
        self.view = view
        self.done = False
        # Turns were dropped: said once, and from then on the KV cache is shifted, not refilled.
        self.shifting = False

    def run(self) -> None:
        self._say(Text(f"{self.engine.config.name} - {HINT}", style="dim"))
        while not self.done:
            try:
                line = self.read_line()
            except KeyboardInterrupt:
                self._say(Text(f"({HINT})", style="dim"))
                continue
            except EOFError:
                self.console.print()
                return
            if line.strip().startswith("/"):
                self.command(line.strip())
            elif line.strip():
                self.answer(line)

    def command(self, line: str) -> None:
        """Runs a slash command; a bad one is a one-line error, and the chat goes on."""
        name, _, argument = line.partition(" ")
        try:
            handle = COMMANDS.get(name)
            if handle is None:
                close = difflib.get_close_matches(name, COMMANDS, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise InvalidArgumentError(f"unknown command {name}{hint}; /help lists them")
            handle[0](self, argument.strip())
        except InvalidArgumentError as error:
            self._say(Text(f"error: {error}", style="red"))

    def answer(self, text: str) -> None:
        """Streams the model's answer to text; a conversation whose kept turns still leave no room
        is a one-line notice."""
        engine = self.engine
        try:
            fitted = fit_chat(self._for_model() + [{"role": "user", "content": text}], engine.tokenize_chat,
                              engine.context_length, self.settings.get("max_tokens"))
            stream = engine.stream(fitted.prompt_ids, context_shift=self.shifting or fitted.shifted,
                                   **self.settings)
        except ContextLengthError as error:
            self._say(Text(f"error: {error}; /reset starts a new conversation", style="red"))
            return
        except KeyboardInterrupt:  # while the prompt was rendered: the conversation is as it was
            self.view.end("[stopped]")
            return
        self._forget(fitted)
        self.messages.append({"role": "user", "content": text})
        reply: list[str] = []
        try:
            self.view.show(stream, reply)
        except KeyboardInterrupt:
            self.messages.append({"role": "assistant", "content": "".join(reply), "stopped": True})
            self.view.end("[stopped]")
            return
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        self.view.end(self._cut_notice(stream))

    def _forget(self, fitted: FittedChat) -> None:
        """Forgets what fit_chat left out of the conversation, saying so the first time."""
        if not fitted.shifted:
            return
        offset = 1 if self.system else 0  # the system prompt led what was fitted
        kept = [message for i, message in enumerate(self.messages, offset) if i not in fitted.dropped]
        sent = fitted.messages[offset:-1]  # the same messages, the last answer maybe cut
        self.messages = [message | {"content": shown["content"]} for message, shown in zip(kept, sent)]
        if not self.shifting:
            self._say(Text("(the context is full: the oldest turns are dropped from now on, keeping the "
                           "system prompt and your first message)", style="dim"))
        self.shifting = True

    def _cut_notice(self, stream) -> str | None:
        """Why the answer ended early, when it did not end by itself."""
        result = stream.result
        if result is None or result.finish_reason != "length":
            return None
        if len(stream.prompt_ids) + len(result.tokens) >= self.engine.context_length:
            return "[cut: the context is full; the next turn drops the oldest turns]"
        return f"[cut at {len(result.tokens)} tokens: /set max_tokens N for longer answers]"

    def _say(self, text: Text | str) -> None:
        """One line however narrow the console: a pipe reads it whole."""
        self.console.print(text, soft_wrap=True, markup=False, highlight=False)

    def _for_model(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": m["role"], "content": m["content"]} for m in self.messages]

    # -- commands: each takes the text after its name --------------------------------------

    def show_help(self, _: str) -> None:
        for name, (_, usage, summary) in COMMANDS.items():
            if summary:
                self._say(f"  {name + usage:<20} {summary}")
        self._say("  Alt-Enter starts a new line; Up and Down recall earlier lines.")

    def set_system(self, text: str) -> None:
        self.system = text or None
        self._say(Text(f"system prompt {'set' if text else 'cleared'}; the conversation is kept",
                                style="dim"))

    def set_option(self, argument: str) -> None:
        if not argument:
            for name, value, source in current_settings(self.settings, self.engine.sampling_defaults):
                shown = "random" if value is None else value
                self._say(f"  {name:<15} {shown!s:<8} ({source})")
            return
        name, _, value = argument.partition(" ")
        if not value.strip():
            raise InvalidArgumentError(f"/set {name} needs a value, e.g. /set temperature 0.7")
        self.settings = with_setting(self.settings, name, value.strip())
        self._say(Text(f"{name} = {self.settings.get(name, 'default')}", style="dim"))

    def save(self, file: str) -> None:
        path = _path_argument(file, "/save")
        save_conversation(path, self.system, self.messages, self.settings)
        self._say(Text(f"saved {len(self.messages)} messages to {path}", style="dim"))

    def load(self, file: str) -> None:
        path = _path_argument(file, "/load")
        self.system, self.messages, self.settings = load_conversation(path)
        self.shifting = False
        self._say(Text(f"loaded {len(self.messages)} messages from {path}", style="dim"))

    def reset(self, _: str) -> None:
        self.messages, self.shifting = [], False
        self._say(Text("conversation cleared", style="dim"))

    def exit(self, _: str) -> None:
        self.done = True


def _path_argument(file: str, command: str) -> Path:
    if not file:
        raise InvalidArgumentError(f"{command} needs a file name, e.g. {command} chat.json")
    return Path(file).expanduser()


Handler = Callable[[ChatSession, str], None]
# name -> (handler, what follows the name, what it does: none for an alias), in the order /help
# lists them
COMMANDS: dict[str, tuple[Handler, str, str]] = {
    "/help": (ChatSession.show_help, "", "this list"),
    "/system": (ChatSession.set_system, " TEXT", "set the system prompt, keeping the conversation "
               "(no TEXT clears it)"),
    "/set": (ChatSession.set_option, " [NAME VALUE]", "show the settings, or set one: temperature, top_k, "
             "top_p, min_p, repeat_penalty, seed, max_tokens (VALUE none: the default)"),
    "/save": (ChatSession.save, " FILE", "save the conversation, system prompt and settings as JSON"),
    "/load": (ChatSession.load, " FILE", "load a conversation /save wrote"),
    "/reset": (ChatSession.reset, "", "forget the conversation"),
    "/exit": (ChatSession.exit, "", "quit (also /quit, /bye, Ctrl-D)"),
    "/quit": (ChatSession.exit, "", ""),
    "/bye": (ChatSession.exit, "", ""),
}
