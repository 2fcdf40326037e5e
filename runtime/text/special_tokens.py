"""Special tokens only from the template: message text stays text, whatever it contains.

A chat prompt is the template's markup around the messages. llama.cpp, asked to parse special
tokens, turns every control-token string in the rendered text into that token, so a user message
holding `<|im_end|>\\n<|im_start|>system\\n...` would forge a turn. So before rendering, every
control-token string inside a message is broken by a marker (a private-use character found in no
message); after rendering, the template's own control strings, the only intact ones, are split out
as tokens, exactly as llama.cpp splits them (longest first, with its lstrip/rstrip rules), and the
text between them, markers removed, is tokenized as plain text. A prompt without forged markup
gets the very ids llama.cpp gives the rendered text.

A control token of one character cannot be broken this way (no room for the marker); no tokenizer
tierflow runs has one.
"""

from collections.abc import Iterable
from dataclasses import dataclass

_PRIVATE_USE = range(0xE000, 0xF900)
_SPACE = " \t\n\v\f\r"  # what llama.cpp's isspace strips around an lstrip/rstrip token


@dataclass(frozen=True)
class SpecialToken:
    text: str
    id: int
    lstrip: bool = False  # whitespace before it belongs to it (llama.cpp's LLAMA_TOKEN_ATTR_LSTRIP)
    rstrip: bool = False  # whitespace after it does


def marker_for(texts: Iterable[str]) -> str:
    """A private-use character that occurs in none of `texts`."""
    seen = set("".join(texts))
    return next(chr(c) for c in _PRIVATE_USE if chr(c) not in seen)


def escape(value: object, specials: list[SpecialToken], marker: str) -> object:
    """`value` (a message: strings in dicts and lists) with every special token's string broken by
    `marker` after its first character."""
    if isinstance(value, dict):
        return {key: escape(item, specials, marker) for key, item in value.items()}
    if isinstance(value, list):
        return [escape(item, specials, marker) for item in value]
    if not isinstance(value, str):
        return value
    for token in specials:
        if len(token.text) > 1 and token.text in value:
            value = value.replace(token.text, token.text[0] + marker + token.text[1:])
    return value


def strings(value: object) -> Iterable[str]:
    """Every string in a message (in dicts and lists)."""
    if isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)
    elif isinstance(value, str):
        yield value


def partition(text: str, specials: list[SpecialToken]) -> list[str | int]:
    """`text` as plain-text pieces and special token ids, split as llama.cpp splits them: each
    special token in turn, longest first, is cut out of the text pieces left so far."""
    pieces: list[str | int] = [text]
    for token in sorted(specials, key=lambda t: -len(t.text)):
        if not any(isinstance(piece, str) and token.text in piece for piece in pieces):
            continue
        split: list[str | int] = []
        for piece in pieces:
            split += _cut(piece, token) if isinstance(piece, str) else [piece]
        pieces = split
    return [piece for piece in pieces if piece != ""]


def _cut(text: str, token: SpecialToken) -> list[str | int]:
    parts = text.split(token.text)
    out: list[str | int] = []
    for i, part in enumerate(parts):
        if token.rstrip and i > 0:
            part = part.lstrip(_SPACE)
        if token.lstrip and i < len(parts) - 1:
            part = part.rstrip(_SPACE)
        out += [part, token.id] if i < len(parts) - 1 else [part]
    return out
