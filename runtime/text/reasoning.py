"""A thinking model's reasoning, split from its answer as the pieces stream.

Qwen3, QwQ and DeepSeek R1 write their reasoning between `<think>` and `</think>` before the answer;
a template may open the block itself at the end of the prompt (DeepSeek R1's does), so the answer
starts inside it. The split is the server's, as llama-server's `reasoning_content`: each API then
puts the reasoning where its clients look for it.
"""

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template writes (or expects) `<think>` blocks."""
    return template is not None and CLOSE in template


def opened_in_prompt(prompt_text: str) -> bool:
    """Whether the prompt ends inside a reasoning block the template opened."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


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


def split_reasoning(text: str, inside: bool = False) -> Split:
    """The whole answer's reasoning and content."""
    stream = ReasoningStream(inside)
    first, rest = stream.push(text), stream.finish()
    return Split(first.reasoning + rest.reasoning, first.content + rest.content)


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
