"""The model's tool calls, read out of its text: OpenAI's `tool_calls` and the content left over.

Each family writes its calls its own way, and its chat template says which (tool_format reads the
template's text, never the architecture's name):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen2,
  Qwen2.5, Qwen3, SmolLM3, Hermes);
- llama3: the whole answer is `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`,
  several calls separated by `;` or new lines (Llama 3.1-3.3);
- harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
  (gpt-oss);
- generic: tierflow's own, for templates that know no tools (runtime/text/tool_prompt.py asks for it):
  the whole answer is `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` (or one call:
  `{"tool_call": {...}}`, or the call's object alone).

Whatever the format, a call written as a fenced JSON block (```json {"name": ..., "arguments":
{...}} ```), or an answer that is only such objects, naming offered tools, is a call too: small
models fall back to these when their own format slips (Qwen2.5-Coder-0.5B does under
`tool_choice="auto"`), and llama.cpp's and ollama's parsers read them.

Text that is not a well-formed call of an offered tool stays content: a model that fumbles a call
answers in prose, it never fails the request. An answer cut off by max_tokens in the middle of a call
keeps the calls whole before it, as llama.cpp's partial parser does (the one cut off is dropped);
with none whole, it stays content too.
"""

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum


class ToolFormat(Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    HARMONY = "harmony"
    GENERIC = "generic"


def tool_format(template: str | None) -> ToolFormat:
    """The format a chat template's model writes calls in; GENERIC when the template takes no tools
    or writes them in a format tierflow does not read (GLM's `<arg_key>` pairs, for one)."""
    if not template or "tools" not in template:
        return ToolFormat.GENERIC
    if "<|call|>" in template and "to=" in template:
        return ToolFormat.HARMONY
    if "<tool_call>" in template and "<arg_key>" not in template:
        return ToolFormat.HERMES
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    content: str
    tool_calls: list[ToolCall]


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_HARMONY_CALL = re.compile(
    r"(?:<\|start\|>assistant)?(?:<\|channel\|>\w+)?\s*to=functions\.([\w.\-]+)[^<]*"
    r"(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)(?:<\|call\|>|\Z)", re.DOTALL)
_FENCED_JSON = re.compile(r"```(?:json)?[ \t]*\n(\{.*?\})\s*```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```(?:json)?[ \t]*\n(\{(?:(?!```).)*)\Z", re.DOTALL)  # a fenced call cut off
_HARMONY_OPENING = re.compile(r"(?:<\|start\|>assistant)?(?:<\|channel\|>\w+)?\s*\Z")  # before to=functions.
_FENCE_OPENER = "```json"
_PYTHON_TAG = "<|python_tag|>"


def parse_tool_calls(text: str, fmt: ToolFormat, names: frozenset[str], *, cut: bool = False) -> ParsedReply:
    """The calls in `text` of the tools named `names`, and the rest as content. Any call that does
    not parse, or names another tool, leaves the whole text as content with no calls.

    cut: the text was cut off (by max_tokens). A call it ends inside (a JSON object begun, its
    brackets and strings unclosed) is dropped, and the calls whole before it are returned, as
    llama.cpp's partial parser does; with none whole, the text is content all the same."""
    try:
        content, calls = _PARSERS[fmt](text, cut)
        if not calls:
            content, calls = _parse_fenced(text, cut)
        if not calls:
            content, calls = _parse_llama3(text, cut)  # the answer is the calls' objects alone
    except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: JSON nested too deep
        return ParsedReply(text, [])
    if not calls or any(call.name not in names for call in calls):
        return ParsedReply(text, [])
    return ParsedReply(content.strip(), calls)


def _call(name: object, arguments: object) -> ToolCall:
    """One call from its parsed parts; arguments must be a JSON object (its text is canonical)."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise ValueError("a tool call needs a name and an object of arguments")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json_objects(text: str, cut: bool = False, closing: str = "") -> Iterator[dict]:
    """The JSON objects `text` is made of, with `;`, commas or whitespace between them (and after
    them `closing` and whitespace, or with cut, the end). cut: the text was cut off; an object it
    ends inside ends the objects."""
    decoder, position = json.JSONDecoder(), 0
    while True:
        while position < len(text) and text[position] in " \t\r\n;,":
            position += 1
        if position == len(text):
            return
        if closing and text.startswith(closing, position) and not text[position + len(closing):].strip():
            return
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            if cut and _cut_short(text[position:]):
                return
            raise
        if not isinstance(value, dict):
            raise ValueError("a tool call is a JSON object")
        yield value


def _cut_short(fragment: str) -> bool:
    """Whether `fragment` is a JSON object cut off before its end: nothing of it yet, or an object
    whose brackets and strings, as far as they go, are unclosed and never mismatched."""
    fragment = fragment.strip()
    if not fragment:
        return True
    if fragment[0] != "{":
        return False
    expected, in_string, escaped = [], False, False  # the closing brackets owed
    for char in fragment:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = char == "\\", char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            expected.append("}" if char == "{" else "]")
        elif char in "}]":
            if not expected or expected.pop() != char or not expected:
                return False  # a mismatch, or the object ended: not what the cut left
    return True


def _cut_off(match: re.Match, end_marker: str, arguments: str, cut: bool) -> bool:
    """Whether a call's match is the one a cut text ends inside: unterminated, its JSON cut short."""
    return cut and match.end() == len(match.string) and not match.group(0).endswith(end_marker) \
        and _cut_short(arguments)


def _parse_hermes(text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
    calls = []
    for match in _HERMES_CALL.finditer(text):
        if _cut_off(match, "</tool_call>", match.group(1), cut):
            continue
        value = json.loads(match.group(1))
        calls.append(_call(value["name"], value.get("arguments", {})))
    return _HERMES_CALL.sub("", text), calls


def _parse_fenced(text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
    calls = []
    for match in _FENCED_JSON.finditer(text):
        value = json.loads(match.group(1))
        calls.append(_call(value["name"], value.get("arguments", value.get("parameters", {}))))
    content = _FENCED_JSON.sub("", text)
    cut_off = _OPEN_FENCE.search(content) if cut and calls else None
    if cut_off is not None and _cut_short(cut_off.group(1)):
        content = content[:cut_off.start()]
    return content, calls


def _parse_llama3(text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix(_PYTHON_TAG)
    if not body.lstrip().startswith("{"):
        return text, []
    calls = [_call(value["name"], value.get("parameters", value.get("arguments", {})))
             for value in _json_objects(body, cut)]
    return "", calls


def _parse_harmony(text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
    calls = [_call(match.group(1), json.loads(match.group(2))) for match in _HARMONY_CALL.finditer(text)
             if not _cut_off(match, "<|call|>", match.group(2), cut)]
    content = _HARMONY_CALL.sub("", text)
    header = content.rfind("to=functions.") if cut and calls else -1
    if header != -1:  # a call cut off in its header: what is left of it is no content
        content = _HARMONY_OPENING.sub("", content[:header])
    return content, calls


def _parse_generic(text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
    if not text.lstrip().startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    start = len(text) - len(text.lstrip())
    try:
        value, end = decoder.raw_decode(text, start)
    except ValueError:
        opening = _GENERIC_OPENING.match(text, start) if cut else None
        if opening is None:
            raise
        items = _json_objects(text[opening.end():], cut=True, closing="]")
        return "", [_call(item["name"], item.get("arguments", {})) for item in items]
    # The answer asked for, or a lone call as small models write it (with or without its wrapper).
    items = value["tool_calls"] if "tool_calls" in value else [value.get("tool_call", value)]
    if not isinstance(items, list):
        raise ValueError("tool_calls is a list")
    return text[end:], [_call(item["name"], item.get("arguments", {})) for item in items]


_GENERIC_OPENING = re.compile(r'\{\s*"tool_calls"\s*:\s*\[')  # the answer asked for, up to its first call
_PARSERS = {ToolFormat.HERMES: _parse_hermes, ToolFormat.LLAMA3: _parse_llama3,
            ToolFormat.HARMONY: _parse_harmony, ToolFormat.GENERIC: _parse_generic}


# What starts a call: in any format, an answer that opens as a JSON object (or Llama's python tag
# before one), then anywhere in the text a fenced JSON block or the format's own marker.
_MARKERS = {ToolFormat.HERMES: ("<tool_call>", _FENCE_OPENER),
            ToolFormat.HARMONY: ("to=functions.", _FENCE_OPENER)}
_ANSWER_OPENERS = ("{", _PYTHON_TAG)


class ToolCallStream:
    """Streamed text split into content, sent as it comes, and calls, read at the end.

    Content is withheld from where a call may be starting (a marker, or an answer that opens like
    a call) to the end: once the text ends, what was withheld is parsed, and is calls and their
    surrounding content, or if it does not parse, content after all.
    """

    def __init__(self, fmt: ToolFormat, names: frozenset[str]):
        self._fmt, self._names = fmt, names
        self._text, self._num_sent = "", 0
        self._prose = False  # the answer did not open as a call: only a marker starts holding
        self._holding = False  # a call may have begun: everything from _num_sent on waits for the end

    def push(self, piece: str) -> str:
        """The content that can be sent now, given the next piece of text."""
        self._text += piece
        end = self._sendable_end()
        content, self._num_sent = self._text[self._num_sent:end], max(end, self._num_sent)
        return content

    def finish(self, cut: bool = False) -> ParsedReply:
        """The content still to send and the calls, once the text has ended (cut: by max_tokens,
        parse_tool_calls's)."""
        held = self._text[self._num_sent:]
        self._num_sent = len(self._text)
        parsed = parse_tool_calls(held, self._fmt, self._names, cut=cut)
        return parsed if parsed.tool_calls else ParsedReply(held, [])

    def _sendable_end(self) -> int:
        if self._holding:
            return self._num_sent
        if not self._prose:
            answer = self._text.lstrip()
            self._holding = any(answer.startswith(opener) for opener in _ANSWER_OPENERS)
            if not answer or self._holding or any(opener.startswith(answer) for opener in _ANSWER_OPENERS):
                return self._num_sent
            self._prose = True
        markers = _MARKERS.get(self._fmt, (_FENCE_OPENER,))
        end = min(_before_marker(self._text, self._num_sent, marker) for marker in markers)
        self._holding = any(self._text.startswith(marker, end) for marker in markers)
        return end


def _before_marker(text: str, start: int, marker: str) -> int:
    """Where content must stop in `text` (searched from `start`): before `marker`, or before a tail
    that may be the marker's beginning."""
    found = text.find(marker, start)
    if found != -1:
        return found
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)
