"""Which chat template a model's chats render with: the file's own, a Jinja file or text the user
gives, or one of llama.cpp's built-in formats by name (`--chat-template llama3`).

A file without a template gets ChatML, and says so once (`ChatTemplate.notice`): a model trained
on another format answers junk under ChatML, and the user can only fix what they are told about.
Jinja templates render in the sandbox (chat_template.py); a built-in name renders through
llama.cpp's own `llama_chat_apply_template`, exactly as llama-server's `--chat-template NAME` does.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from tierflow.errors import InvalidArgumentError, TemplateError
from tierflow.runtime.text.chat_template import (
    CHATML_TEMPLATE,
    check_template_syntax,
    render_chat_template,
    validate_messages,
)

NO_TEMPLATE_NOTICE = "this file has no chat template; using chatml; give one with --chat-template"
_MAX_TEMPLATE_FILE_BYTES = 1 << 20  # the largest templates people ship are about 20 KB


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template: Jinja source, or the name of a llama.cpp built-in format."""

    jinja: str | None = None
    builtin: str | None = None
    origin: str = "the model file"  # where it came from, for messages
    notice: str | None = None  # what the user should be told once about this choice

    @property
    def source(self) -> str:
        """The template's text (a built-in's name): what tool_format and markers read."""
        return self.jinja if self.jinja is not None else self.builtin or ""

    def render(self, messages: list[dict], *, bos_token: str, eos_token: str,
               add_generation_prompt: bool, **extra: Any) -> str:
        """The prompt text; a failure is a TemplateError naming the template (and its line)."""
        try:
            if self.jinja is not None:
                return render_chat_template(self.jinja, messages, bos_token=bos_token, eos_token=eos_token,
                                            add_generation_prompt=add_generation_prompt, **extra)
            return _render_builtin(self.builtin, messages, add_generation_prompt)
        except TemplateError as error:
            raise TemplateError(f"{self.origin}: {error}") from None


def choose_template(file_template: str | None, requested: str | os.PathLike | None) -> ChatTemplate:
    """The template chats use: `requested` (a Jinja file, Jinja text, or a built-in name) if given,
    else the file's own, else ChatML with a notice. A bad request is a TierflowError naming it."""
    if requested is None:
        if file_template:
            return ChatTemplate(jinja=file_template)
        return ChatTemplate(jinja=CHATML_TEMPLATE, origin="chatml", notice=NO_TEMPLATE_NOTICE)
    if not isinstance(requested, (str, os.PathLike)) or not os.fspath(requested).strip():
        raise InvalidArgumentError(f"chat_template must be a Jinja file, Jinja text or a built-in name "
                                   f"({', '.join(builtin_names())}), got {requested!r}")
    text = os.fspath(requested)
    if "{{" in text or "{%" in text:
        check_template_syntax(text, "the chat template given")
        return ChatTemplate(jinja=text, origin="the chat template given")
    if Path(text).is_file():
        return ChatTemplate(jinja=_read_template_file(Path(text)), origin=text)
    if text in builtin_names():
        return ChatTemplate(builtin=text, origin=f"llama.cpp's {text}")
    raise InvalidArgumentError(f"unknown chat template {text!r}: give a Jinja file or one of llama.cpp's "
                               f"built-in names: {', '.join(builtin_names())}")


def _read_template_file(path: Path) -> str:
    try:
        if path.stat().st_size > _MAX_TEMPLATE_FILE_BYTES:
            raise TemplateError(f"{path}: a chat template of {path.stat().st_size} bytes is not plausible "
                                f"(at most {_MAX_TEMPLATE_FILE_BYTES})")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TemplateError(f"{path}: cannot read the chat template: {error}") from None
    check_template_syntax(text, str(path))
    return text


@functools.cache
def builtin_names() -> tuple[str, ...]:
    """llama.cpp's built-in chat formats (chatml, llama3, gemma, mistral-v7, phi3, ...)."""
    count = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * count)()
    llama_cpp.llama_chat_builtin_templates(names, count)
    return tuple(name.decode() for name in names)


def _render_builtin(name: str, messages: list[dict], add_generation_prompt: bool) -> str:
    validate_messages(messages)
    encoded = [(m["role"].encode(), m["content"].encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(encoded))(*encoded)
    size = 2 * sum(len(role) + len(content) for role, content in encoded) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        length = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(encoded),
                                                     add_generation_prompt, buf, size)
        if length < 0:
            raise TemplateError(f"llama.cpp's {name} template cannot render these messages")
        if length <= size:
            return buf.raw[:length].decode("utf-8", errors="replace")
        size = length
    raise TemplateError(f"llama.cpp's {name} template asked for a larger buffer twice")
