"""A thinking model's reasoning, split from its answer as the pieces stream.

Qwen3, QwQ and DeepSeek R1 write their reasoning between `<think>` and `</think>` before the answer;
a template may open the block itself at the end of the prompt (DeepSeek R1's does), so the answer
starts inside it. gpt-oss writes harmony messages, its reasoning in the analysis channel and its
answer in the final one. The split is the server's, as llama-server's `reasoning_content`: each API
then puts the reasoning where its clients look for it.
"""

import re
from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
HARMONY_MESSAGE, HARMONY_ENDS = "<|message|>", ("<|end|>", "<|return|>", "<|call|>")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>(\w+)")
MAX_HARMONY_HEADER_CHARS = 200  # a header longer than this is no header: the model wrote plain text


def thinks(template: str | None) -> bool:
    """Whether a chat template writes (or expects) reasoning: `<think>` blocks or harmony's channels."""
    return template is not None and (CLOSE in template or _speaks_harmony(template))


def opened_in_prompt(prompt_text: str) -> bool:
    """Whether the prompt ends inside a reasoning block the template opened."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def reasoning_stream(template: str | None, inside: bool = False) -> "ReasoningStream | HarmonyStream | None":
    """The split of an answer to a prompt of this template (inside: the prompt opened a block)."""
    if template is None:
        return None
    if _speaks_harmony(template):
        return HarmonyStream()
    if CLOSE in template:
        return ReasoningStream(inside)
    return None


def _speaks_harmony(template: str) -> bool:
    return "<|channel|>" in template


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningStream:
    """Takes the answer's text pieces, gives each one's reasoning and content. Only a block at the
    answer's start is reasoning; text that may be the start of a tag is held until it is known, and
    the blank lines that open the reasoning and follow `</think>` are dropped."""

    def __init__(self, inside: bool = False):
        self.state = "inside" if inside else "start"  # then "content", for good
        self._pending = ""
        self._at_edge = True  # whitespace at a block's start or after </think> is dropped
        self.reasoning = self.content = ""  # all released so far

    def push(self, piece: str) -> Split:
        self._pending += piece
        split = Split()
        if self.state == "start":
            head = self._pending.lstrip()
            if head.startswith(OPEN):
                self.state, self._pending = "inside", head[len(OPEN):]
            elif OPEN.startswith(head):
                return split  # blank, or maybe a tag forming
            else:
                self.state = "content"
        if self.state == "inside":
            index = self._pending.find(CLOSE)
            if index == -1:
                keep = _partial_tag_length(self._pending, CLOSE)
                self._release(split, self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return split
            self._release(split, self._pending[:index])
            self.state, self._at_edge = "content", True
            self._pending = self._pending[index + len(CLOSE):]
        self._release(split, self._pending)
        self._pending = ""
        return split

    def finish(self) -> Split:
        """What is still held, at the end of the answer."""
        split = Split()
        if self.state == "start":
            self.state = "content"
        self._release(split, self._pending)
        self._pending = ""
        return split

    def _release(self, split: Split, text: str) -> None:
        if self._at_edge:
            text = text.lstrip()
            self._at_edge = not text
        if not text:
            return
        if self.state == "inside":
            split.reasoning += text
            self.reasoning += text
        else:
            split.content += text
            self.content += text


class HarmonyStream:
    """gpt-oss's answer, as harmony messages: `<|channel|>NAME<|message|>TEXT<|end|>`, each after
    `<|start|>assistant` but the first (the prompt ends with it). The analysis channel is reasoning,
    the final channel content; a commentary message (a tool call) goes to content as written, for
    the tool-call parser. Same interface as ReasoningStream."""

    def __init__(self) -> None:
        self.state = "header"  # then the message's: "reasoning" or "content", and "header" again
        self._header = self._pending = ""
        self._call = False  # the message is a tool call: its markers are content too
        self.reasoning = self.content = ""

    def push(self, piece: str) -> Split:
        self._pending += piece
        split = Split()
        while self._pending:
            if self.state == "header" and not self._read_header(split):
                break
            if self.state != "header" and not self._read_message(split):
                break
        return split

    def finish(self) -> Split:
        split = Split()
        if self.state == "header":
            self.state, self._pending = "content", self._header + self._pending
        self._release(split, self._pending)
        self._pending = self._header = ""
        return split

    def _read_header(self, split: Split) -> bool:
        """Takes a header up to its <|message|>; False while it is incomplete."""
        self._header += self._pending
        self._pending = ""
        index = self._header.find(HARMONY_MESSAGE)
        if index == -1:
            if len(self._header) > MAX_HARMONY_HEADER_CHARS:  # not harmony: all of it is content
                self.state, self._pending, self._header = "content", self._header, ""
                return True
            return False
        cut = index + len(HARMONY_MESSAGE)
        header, self._pending, self._header = self._header[:cut], self._header[cut:], ""
        channel = _HARMONY_CHANNEL.search(header)
        self._call = "to=" in header
        if self._call:
            self.state = "content"
            self._release(split, header)
        else:
            self.state = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        return True

    def _read_message(self, split: Split) -> bool:
        """Takes the message's text up to its end marker; False while it goes on."""
        ends = [(self._pending.find(end), end) for end in HARMONY_ENDS if end in self._pending]
        if not ends:
            keep = max(_partial_tag_length(self._pending, end) for end in HARMONY_ENDS)
            self._release(split, self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        index, end = min(ends)
        self._release(split, self._pending[:index] + (end if self._call else ""))
        self._pending, self.state = self._pending[index + len(end):], "header"
        return True

    def _release(self, split: Split, text: str) -> None:
        if not text:
            return
        if self.state == "reasoning":
            split.reasoning += text
            self.reasoning += text
        else:
            split.content += text
            self.content += text


def split_whole(stream: "ReasoningStream | HarmonyStream", text: str) -> Split:
    """The whole answer's reasoning and content, by a fresh stream."""
    first, rest = stream.push(text), stream.finish()
    return Split(first.reasoning + rest.reasoning, first.content + rest.content)



def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
