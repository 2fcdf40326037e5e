"""The model's tokenizer: llama.cpp's, loaded from the GGUF file without its weights.

llama.cpp implements every GGUF vocabulary type (SPM, BPE with its pre-tokenizers, WPM, UGM,
RWKV) exactly as the file describes it, so tierflow uses it rather than re-implementing them; the
tests check the ids against `llama_cpp.Llama.tokenize`.

The vocabulary is loaded through llama.cpp's C API (`llama_model_load_from_file` with
`vocab_only`) rather than `llama_cpp.Llama`: `Llama` also creates a context and compiles the
file's chat template with its own Jinja setup, so a template using a tag it lacks would make the
tokenizer itself fail to load. Templates are rendered by tierflow's sandbox instead.
"""

import contextlib
import ctypes
import functools
import logging
import operator
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import llama_cpp

from tierflow.errors import InvalidArgumentError, ModelFileError, TierflowError
from tierflow.runtime.text.special_tokens import SpecialToken, escape, marker_for, partition, strings
from tierflow.runtime.text.template_choice import ChatTemplate, choose_template
from tierflow.runtime.text.template_worker import POOL

LLAMA_TOKEN_NULL = -1


@functools.cache
def _init_backend() -> None:
    llama_cpp.llama_backend_init()


class _QuietLlamaLogs:
    """Keeps llama.cpp's loading chatter off stderr while any load runs; errors still show.

    llama-cpp-python routes llama.cpp's log through the `llama-cpp-python` logger and checks its
    level per message, as `Llama(verbose=False)` relies on. Loads may overlap (Engine.load on
    several threads): the first to start saves the caller's level and sets ERROR, the
    last to end restores it, so no load reads its file with the level another has restored, and
    the caller's setting stands once all have ended.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = logging.NOTSET

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        logger = logging.getLogger("llama-cpp-python")
        with self._lock:
            if self._depth == 0:
                self._saved = logger.level
                logger.setLevel(logging.ERROR)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    logger.setLevel(self._saved)


_quiet_llama_logs = _QuietLlamaLogs()


def _load_vocab_only(path: str) -> Any:
    _init_backend()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with _quiet_llama_logs():
        model = llama_cpp.llama_model_load_from_file(os.fsencode(path), params)
    if not model:
        raise ModelFileError(f"llama.cpp could not load the vocabulary of {path}")
    return model


def _metadata_string(model: Any, key: str) -> str | None:
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        length = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, size)
        if length < 0:
            return None
        if length < size:  # the value and its NUL fit
            return buf.raw[:length].decode("utf-8", errors="replace")
        size = length + 1


def _grow_until_fits(fill: Any, ctype: Any, capacity: int) -> list | bytes:
    """Calls fill(buffer, capacity), which returns the count written or -(count needed)."""
    for _ in range(2):
        buf = (ctype * capacity)()
        count = fill(buf, capacity)
        if count >= 0:
            return buf[:count]
        capacity = -count
    raise TierflowError("llama.cpp asked for a larger buffer twice")


class Tokenizer:
    """Text <-> token ids for one model. Build it with `from_gguf`; close it (or use `with`)."""

    def __init__(self, model: Any, path: str) -> None:
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._free = weakref.finalize(self, llama_cpp.llama_model_free, model)
        POOL.hold()  # its chats render in the template workers, which the last tokenizer closed stops
        self._let_go = weakref.finalize(self, POOL.let_go)
        self.path = path
        self.vocab_size: int = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.bos_id = self._token_or_none(llama_cpp.llama_vocab_bos(self._vocab))
        self.eos_id = self._token_or_none(llama_cpp.llama_vocab_eos(self._vocab))
        # Every token that ends generation (eos, eot, <|im_end|>, ...), as llama.cpp decides it.
        self.eog_ids: frozenset[int] = frozenset(
            i for i in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(self._vocab, i))
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.add_eos: bool = bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))
        self.bos_token = self._token_text(self.bos_id)
        self.eos_token = self._token_text(self.eos_id)
        self.chat_template: str | None = _metadata_string(model, "tokenizer.chat_template")  # the file's
        self.template: ChatTemplate = choose_template(self.chat_template, None)  # what chats render with
        self.specials = self._special_tokens()  # what only a chat template may write

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ModelFileError(f"model file not found: {path}")
        return cls(_load_vocab_only(path), path)

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of `text`.

        add_bos: None follows the model (`self.add_bos`) but never adds a second BOS when the text
        already starts with one (chat templates often write `bos_token` themselves).
        special: text such as "<|im_start|>" becomes that special token (else it is text).
        """
        return self._with_bos(self._tokenize(text, special), add_bos)

    def encode_for_embedding(self, text: str) -> list[int]:
        """Token ids of `text` as llama.cpp embeds it: BOS as `encode` adds it, and EOS after the
        text where the vocabulary says so (tokenizer.ggml.add_eos_token: embedding models that
        pool the last token pool that EOS)."""
        ids = self.encode(text)
        return ids + [self.eos_id] if self.add_eos and self.eos_id is not None else ids

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """The prompt ids of `messages` through the chat template: the template's own markup
        becomes special tokens, the text of the messages and of `extra` (tools) never does
        (special_tokens.py)."""
        marker = marker_for([*strings(messages), *strings(extra), self.template.source])
        text = self.apply_chat_template(escape(messages, self.specials, marker),
                                        add_generation_prompt=add_generation_prompt,
                                        **escape(extra, self.specials, marker))
        ids = []
        for piece in partition(text, self.specials):
            ids += [piece] if isinstance(piece, int) else self._tokenize(piece.replace(marker, ""), False)
        return self._with_bos(ids, None)

    def is_grammar_token(self, text: str) -> bool:
        """Whether `text` is one token that grammars match as a special token, as llguidance reads
        the vocabulary: a control token, or a user-defined one written `<...>` (Qwen's
        `<tool_call>`)."""
        ids = self._tokenize(text, True)
        if len(ids) != 1:
            return False
        attr = llama_cpp.llama_vocab_get_attr(self._open_vocab(), ids[0])
        user_marker = attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED and text[:1] == "<" and text[-1:] == ">"
        return bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL or user_marker)

    def decode(self, ids: Sequence[int], *, special: bool = True) -> str:
        """The text of `ids`; special tokens are written out unless `special` is False.

        Like llama.cpp, drops the space an SPM vocabulary puts before the first word, so for
        ordinary text `decode(encode(t, add_bos=False)) == t`. Broken UTF-8 becomes U+FFFD.
        """
        vocab, ids = self._open_vocab(), [self._checked_id(i) for i in ids]
        if not ids:
            return ""
        tokens = (llama_cpp.llama_token * len(ids))(*ids)
        data = _grow_until_fits(
            lambda buf, n: llama_cpp.llama_detokenize(vocab, tokens, len(ids), buf, n,
                                                      False, special),
            ctypes.c_char, 16 * len(ids) + 16)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, *, special: bool = True) -> bytes:
        """The raw bytes of one token's piece: may be part of a UTF-8 character, and keeps any
        leading space (streaming concatenates these; `decode` is the whole-sequence view)."""
        vocab, token_id = self._open_vocab(), self._checked_id(token_id)
        return _grow_until_fits(
            lambda buf, n: llama_cpp.llama_token_to_piece(vocab, token_id, buf, n, 0, special),
            ctypes.c_char, 64)

    def use_template(self, requested: str | os.PathLike | None) -> None:
        """Renders chats with `requested` (a Jinja file or text, or a llama.cpp built-in name)
        instead of the file's template; None keeps the file's (ChatML if it has none)."""
        self.template = choose_template(self.chat_template, requested)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """The prompt text for `messages`, from `self.template`."""
        return self.template.render(messages, bos_token=self.bos_token, eos_token=self.eos_token,
                                    add_generation_prompt=add_generation_prompt, **extra)

    def _tokenize(self, text: str, special: bool) -> list[int]:
        vocab, data = self._open_vocab(), text.encode("utf-8")
        return _grow_until_fits(
            lambda buf, n: llama_cpp.llama_tokenize(vocab, data, len(data), buf, n, False, special),
            llama_cpp.llama_token, len(data) + 8)  # ids never outnumber bytes, bar a space prefix

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        if add_bos is None:
            add_bos = self.add_bos and not (ids and ids[0] == self.bos_id)
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def _special_tokens(self) -> list[SpecialToken]:
        """The control tokens (and the unknown token), as llama.cpp's special parsing finds them."""
        attr = llama_cpp.llama_vocab_get_attr
        special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        found = []
        for i in range(self.vocab_size):
            flags = attr(self._vocab, i)
            if flags & special and (text := self._token_text(i)):
                found.append(SpecialToken(text, i, bool(flags & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                                          bool(flags & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP)))
        return found

    def close(self) -> None:
        """Frees llama.cpp's vocabulary (later calls raise instead of touching freed memory) and lets
        go of the template workers."""
        self._free()
        self._let_go()
        self._vocab = None

    def __enter__(self) -> "Tokenizer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def llama_vocab(self) -> Any:
        """llama.cpp's vocabulary handle, for what reads the tokens through llama.cpp's C API
        (structured output's token table); valid until close()."""
        return self._open_vocab()

    def _open_vocab(self) -> Any:
        if self._vocab is None:
            raise TierflowError("the tokenizer is closed")
        return self._vocab

    def _checked_id(self, token_id: int) -> int:
        token_id = operator.index(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise InvalidArgumentError(
                f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return token_id

    def _token_or_none(self, token_id: int) -> int | None:
        return None if token_id == LLAMA_TOKEN_NULL else token_id

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return llama_cpp.llama_vocab_get_text(self._vocab, token_id).decode("utf-8", "replace")
