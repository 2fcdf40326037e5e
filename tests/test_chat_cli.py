"""`tierflow chat` as a user types it, at a real pseudo-terminal (pexpect), and as a script pipes
it (stdin and stdout not terminals: in this process, through the console script's entry point);
`tierflow run -` and `--chat`. Answers are short (-n) and greedy where they are compared."""

import io
import json
import os
import re
import sys

import pexpect
import pytest
from rich.console import Console

from tests.support.cli import Finished, run_tierflow
from tierflow import Engine
from tierflow.cli.chat_terminal import AnswerView, file_history
from tierflow.runtime.sampling.sampler import SAMPLED_REPEAT_PENALTY

TIERFLOW = [sys.executable, "-m", "tierflow.cli.app"]
# prompt_toolkit turns bracketed paste on as each prompt starts: the chat waits for a line.
READY = "\x1b[?2004h"
UP = "\x1b[A"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """A chat on a pseudo-terminal (so the line editor and the markdown view are on)."""

    def __init__(self, *args: str):
        # A pseudo-terminal answers no cursor-position request: tell prompt_toolkit not to ask.
        env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"}
        self.child = pexpect.spawn(TIERFLOW[0], [*TIERFLOW[1:], "chat", "--threads", "2", *args], env=env,
                                   encoding="utf-8", dimensions=(40, 120), timeout=120)
        self.child.expect_exact(READY)

    def type(self, keys: str) -> str:
        """Sends keys ending a line, and returns what was shown (escapes removed) until the next
        prompt."""
        self.child.send(keys)
        self.child.expect_exact(READY)
        return ANSI.sub("", self.child.before)

    def quit(self) -> int:
        self.child.send("\x04")  # Ctrl-D
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus


@pytest.fixture
def terminal():
    sessions = []

    def start(*args: str) -> Terminal:
        sessions.append(Terminal(*args))
        return sessions[-1]

    yield start
    for session in sessions:
        session.child.close(force=True)


def piped_chat(*args: str, input: str) -> Finished:
    """A chat whose stdin and stdout are not terminals, as when a script pipes them."""
    return run_tierflow("chat", "--threads", "2", *args, input=input)


def saved(path) -> dict:
    return json.loads(path.read_text())


# -- at a terminal -------------------------------------------------------------------------------


@pytest.mark.slow
def test_up_recalls_the_previous_line_of_this_chat(terminal):
    chat = terminal("-n", "4")
    chat.type("/set top_k 7\r")
    shown = chat.type(UP + "\r")
    assert "/set top_k 7" in shown and "top_k = 7" in shown
    assert chat.quit() == 0


@pytest.mark.slow
def test_up_recalls_a_line_of_an_earlier_chat(terminal):
    first = terminal("-n", "4")
    first.type("/set top_k 9\r")
    assert first.quit() == 0
    second = terminal("-n", "4")
    assert "top_k = 9" in second.type(UP + "\r")


@pytest.mark.slow
def test_ctrl_c_on_an_empty_line_shows_a_hint_and_the_chat_goes_on(terminal):
    chat = terminal("-n", "4")
    assert "Ctrl-D quits" in chat.type("\x03")
    assert "top_k = 3" in chat.type("/set top_k 3\r")
    assert chat.quit() == 0


@pytest.mark.slow
def test_help_lists_the_commands(terminal):
    shown = terminal("-n", "4").type("/help\r")
    for command in ("/system TEXT", "/set", "/save FILE", "/load FILE", "/reset", "/exit"):
        assert command in shown


@pytest.mark.slow
def test_an_unknown_command_is_refused_with_the_closest_match_and_no_answer(terminal, tmp_path):
    chat = terminal("-n", "4")
    shown = chat.type("/sav\r")
    assert "unknown command /sav (did you mean /save?); /help lists them" in shown
    assert "processing the prompt" not in shown
    chat.type(f"/save {tmp_path / 'chat.json'}\r")
    assert saved(tmp_path / "chat.json")["messages"] == []


@pytest.mark.slow
def test_with_temperature_0_the_same_question_gets_the_same_answer(terminal, tmp_path):
    chat = terminal("-n", "12", "--temperature", "1", "--seed", "0")
    chat.type("/set temperature 0\r")
    answers = []
    for name in ("first.json", "second.json"):
        chat.type("Name three colors.\r")
        chat.type(f"/save {tmp_path / name}\r")
        chat.type("/reset\r")
        answers.append(saved(tmp_path / name)["messages"][1]["content"])
    assert answers[0] and answers[0] == answers[1]


@pytest.mark.slow
def test_save_then_load_restores_the_system_prompt_messages_and_settings(terminal, tmp_path):
    chat = terminal("-n", "6", "--temperature", "0")
    chat.type("/system You answer in French.\r")
    chat.type("/set top_p 0.5\r")
    chat.type("Hello!\r")
    chat.type(f"/save {tmp_path / 'chat.json'}\r")
    other = terminal("-n", "99")
    assert "loaded 2 messages" in other.type(f"/load {tmp_path / 'chat.json'}\r")
    assert re.search(r"top_p\s+0\.5\s+\(set\)", other.type("/set\r"))
    other.type(f"/save {tmp_path / 'again.json'}\r")
    assert saved(tmp_path / "again.json") == saved(tmp_path / "chat.json")
    assert saved(tmp_path / "chat.json")["system"] == "You answer in French."


@pytest.mark.slow
def test_a_spinner_counts_the_prompt_tokens_processed_until_the_answer_begins(terminal):
    shown = terminal("-n", "1", "--temperature", "0").type("word " * 600 + "\r")
    assert re.search(r"processing the prompt: \d+/6\d\d tokens, \d+\.\d s", shown)


@pytest.mark.slow
def test_ctrl_c_mid_answer_keeps_the_chat_and_the_answer_so_far_marked_stopped(terminal, tmp_path):
    chat = terminal("-n", "2000", "--temperature", "0")
    chat.child.send("Tell me a very long story about a dragon.\r")
    chat.child.expect_exact("\x1b[?2004l")  # the line is read
    chat.child.expect_exact("\x1b[?25h")  # the spinner is gone: the first piece has come
    chat.child.expect("[A-Za-z]{2}")  # and is shown (an escape sequence holds one letter at most)
    assert "[stopped]" in chat.type("\x03")
    chat.type(f"/save {tmp_path / 'chat.json'}\r")
    answer = saved(tmp_path / "chat.json")["messages"][-1]
    assert answer["role"] == "assistant" and answer["stopped"] is True and answer["content"]
    assert chat.quit() == 0


# -- through pipes -------------------------------------------------------------------------------


def test_piped_commands_are_answered_locally_and_lines_by_the_model():
    done = piped_chat("-n", "16", "--temperature", "0", input="/foo\nWhat is 2 + 2?\n/reset\n/bye\n")
    assert done.returncode == 0, done.stderr
    assert "unknown command /foo; /help lists them" in done.stdout
    assert "4" in done.stdout and "conversation cleared" in done.stdout


def test_ctrl_c_while_a_message_is_rendered_stops_its_answer_not_the_chat(monkeypatch):
    # A Ctrl-C before the answer's first token lands where the message is rendered and tokenized
    # (with a long message, most of that time): there it used to quit the chat.
    real, calls = Engine.tokenize_chat, []

    def interrupted(engine, *args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(Engine, "tokenize_chat", interrupted)
    done = piped_chat("-n", "4", input="Tell me a story.\nWhat is 2 + 2?\n")
    assert done.returncode == 0, done.stderr
    assert "[stopped]" in done.stdout and len(calls) > 1  # the next message was answered


def test_a_bad_setting_is_one_line_naming_it():
    done = piped_chat("-n", "4", input="/set temperature -1\n/set top_kk 3\n/set seed lucky\n")
    lines = [line for line in done.stdout.splitlines() if "error" in line]
    assert done.returncode == 0, done.stderr
    assert len(lines) == 3
    assert "temperature must be" in lines[0] and "did you mean top_k" in lines[1] and "seed" in lines[2]


def test_set_alone_shows_the_model_defaults_and_what_was_set():
    done = piped_chat("-n", "4", input="/set min_p 0.1\n/set\n")
    assert re.search(r"min_p\s+0\.1\s+\(set\)", done.stdout)
    assert re.search(r"temperature\s+\S+\s+\((model|tierflow)\)", done.stdout)


def test_set_alone_shows_the_repeat_penalty_generation_uses_at_each_temperature():
    done = piped_chat("-n", "4", input="/set\n/set temperature 0\n/set\n")
    sampled, greedy = re.findall(r"repeat_penalty\s+(\S+)\s+\(tierflow\)", done.stdout)
    assert (sampled, greedy) == (str(SAMPLED_REPEAT_PENALTY), "1.0")


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not a JSON file"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0]"),
    ('{"messages": [], "settings": {"temperature": "hot"}}', "temperature"),
    ("[" * 100000, "not a JSON file"),
])
def test_a_bad_conversation_file_is_one_line_and_the_chat_goes_on(tmp_path, content, problem):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    done = piped_chat("-n", "4", input=f"/load {bad}\n/set top_k 5\n")
    errors = [line for line in done.stdout.splitlines() if "error" in line]
    assert done.returncode == 0, done.stderr
    assert len(errors) == 1 and f"cannot load {bad}" in errors[0] and problem in errors[0]
    assert "top_k = 5" in done.stdout


def test_an_answer_cut_by_max_tokens_says_so():
    done = piped_chat("-n", "3", "--temperature", "0", input="Tell me a story.\n")
    assert "[cut at 3 tokens: /set max_tokens N for longer answers]" in done.stdout


SHIFT_NOTICE = "(the context is full: the oldest turns are dropped from now on"
QUESTIONS = [f"Tell me about {thing}." for thing in ("the sea", "mountains", "rivers", "forests", "deserts")]


@pytest.mark.slow
def test_a_conversation_that_outgrows_the_context_drops_its_oldest_turns_saying_so_once(tmp_path):
    done = piped_chat("-n", "40", "--ctx", "256", "--temperature", "0",
                      input="".join(f"{q}\n" for q in QUESTIONS) + f"/save {tmp_path / 'chat.json'}\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(SHIFT_NOTICE) == 1 and "error" not in done.stdout
    messages = saved(tmp_path / "chat.json")["messages"]
    asked = [m["content"] for m in messages if m["role"] == "user"]
    assert asked[0] == QUESTIONS[0] and asked[-1] == QUESTIONS[-1] and len(asked) < len(QUESTIONS)
    assert messages[-1]["role"] == "assistant" and messages[-1]["content"]


def test_an_answer_cut_by_the_context_end_is_kept_and_the_next_turn_goes_on(tmp_path):
    done = piped_chat("-n", "500", "--ctx", "64", "--temperature", "0",
                      input=f"Tell me a very long story.\nAnd another.\n/save {tmp_path / 'chat.json'}\n")
    assert done.returncode == 0, done.stderr
    assert "[cut: the context is full; the next turn drops the oldest turns]" in done.stdout
    assert done.stdout.count(SHIFT_NOTICE) == 1 and "error" not in done.stdout
    roles = [(m["role"], m["content"][:1]) for m in saved(tmp_path / "chat.json")["messages"]]
    assert roles[:3] == [("user", "T"), ("assistant", "…"), ("user", "A")]  # the story's start cut
    assert roles[3][0] == "assistant"


# -- tierflow run ---------------------------------------------------------------------------------


def run(*args: str, input: str | None = None) -> dict:
    done = run_tierflow("run", *args, "-n", "8", "--temperature", "0", "--threads", "2", "--ctx", "1024",
                        "--json", input=input)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_run_reads_the_prompt_from_stdin_given_a_dash():
    assert run("-", input="The capital of France is")["tokens"] == run("The capital of France is")["tokens"]


def test_run_chat_answers_the_prompt_as_one_user_message(engine):
    question = "What is 2 + 2?"
    expected = engine.chat([{"role": "user", "content": question}], max_tokens=8, temperature=0)
    assert run("-", "--chat", input=question)["tokens"] == expected.tokens


# -- the parts a terminal shows --------------------------------------------------------------------


def shown(markdown: bool, pieces: list[str]) -> tuple[str, list[str]]:
    """What an AnswerView writes to a terminal for a stream of pieces, and the reply it kept."""
    screen = Console(file=io.StringIO(), force_terminal=True, width=60, color_system="standard")
    quiet = Console(file=io.StringIO(), force_terminal=False)
    reply: list[str] = []
    view = AnswerView(screen, quiet, markdown=markdown)
    view.show(iter(pieces), reply)
    view.end()
    return screen.file.getvalue(), reply


MARKDOWN = ["# Fruit", "s\n\n", "- **ap", "ples**\n", "- pears\n"]


def test_an_answer_on_a_terminal_is_rendered_as_markdown():
    screen, reply = shown(True, MARKDOWN)
    assert "**" not in screen and "# " not in screen and "apples" in screen
    assert "\x1b[1m" in screen  # bold
    assert reply == MARKDOWN


def test_a_plain_answer_is_the_text_as_it_came():
    screen, reply = shown(False, MARKDOWN)
    assert screen == "".join(MARKDOWN) + "\n" and reply == MARKDOWN


def test_a_history_file_that_cannot_be_used_costs_the_history_not_the_chat(tmp_path):
    history = file_history(tmp_path)  # a folder: neither readable nor writable as a file
    history.store_string("/help")
    assert list(history.load_history_strings()) == []
