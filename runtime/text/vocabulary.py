"""Checks a GGUF file's vocabulary before llama.cpp's tokenizer loads it.

llama.cpp reports some bad vocabularies as an error, but others abort the whole process, at load
or at the first text it encodes: two tokens with the same text (llama.cpp keys tokens by their text
up to the first NUL, and renames an empty one "[EMPTY_<id>]"), a SentencePiece vocabulary without a
token for some byte, the 'whitespace' pre-tokenizer on a byte-level BPE vocabulary, a
'no_vocab' or 'rwkv' tokenizer. So every `tokenizer.ggml.*` entry llama.cpp reads is checked here
first, against llama.cpp's rules or stricter ones that every real vocabulary meets, and a bad one
is a ModelFileError naming the key and the problem.

tierflow runs decoder models whose vocabularies are SentencePiece (`tokenizer.ggml.model` 'llama')
or byte-level BPE ('gpt2'); llama.cpp's other tokenizers (BERT's WordPiece, T5's Unigram, RWKV,
...) belong to model families tierflow does not run, and are refused.

The metadata is as `read_gguf` decodes it: a string with invalid UTF-8 holds U+FFFD instead, so
two tokens that differ only in invalid bytes count as the same token here.
"""

import re
from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np

from tierflow.errors import ModelFileError

TOKENS_KEY = "tokenizer.ggml.tokens"
MODEL_KEY = "tokenizer.ggml.model"
PRE_KEY = "tokenizer.ggml.pre"
TYPES_KEY = "tokenizer.ggml.token_type"
SCORES_KEY = "tokenizer.ggml.scores"
MERGES_KEY = "tokenizer.ggml.merges"

MODELS = {"llama": "SentencePiece", "gpt2": "byte-level BPE"}
# Pre-tokenizers llama.cpp knows but aborts with on a byte-level BPE ('gpt2') vocabulary:
# 'whitespace' lets a space reach the merge lookup. An unknown name is llama.cpp's own load error.
ABORTING_PRE_TOKENIZERS = frozenset({"whitespace"})
BOOL_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
             "tokenizer.ggml.add_sep_token", "tokenizer.ggml.add_space_prefix",
             "tokenizer.ggml.remove_extra_whitespaces")
SPECIAL_ID_KEY = re.compile(r"tokenizer\.ggml\.\w+_token_id")
TOKEN_TYPES = range(7)  # llama.cpp's llama_token_type: UNDEFINED 0 .. BYTE 6
BYTE_TYPE = 6
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # llama.cpp reads the byte from the two hex digits
# SentencePiece's byte fallback: llama.cpp encodes a byte no piece covers as its byte token, and
# aborts when there is none.
BYTE_TOKENS = tuple(f"<0x{byte:02X}>" for byte in range(256))
_SCORE_TYPES = (np.float32, np.int32)


def check_vocabulary(metadata: Mapping[str, Any], label: str) -> None:
    """Raises ModelFileError, naming `label` (the file) and the key, unless llama.cpp can load
    the vocabulary in `metadata` and tokenize any text with it without aborting."""
    _VocabularyCheck(metadata, label).run()


class _VocabularyCheck:
    def __init__(self, metadata: Mapping[str, Any], label: str) -> None:
        self.metadata, self.label = metadata, label

    def fail(self, key: str, problem: str) -> NoReturn:
        raise ModelFileError(f"{self.label}: {key}: {problem}")

    def run(self) -> None:
        model = self._model()
        texts = self._token_texts()
        known = self._unique(texts)
        self._check_types(texts)
        self._check_scores(len(texts))
        self._check_special_ids(len(texts))
        self._check_flags()
        if model == "llama":
            self._check_byte_tokens(known)
        else:
            self._check_pre_tokenizer()
            self._check_merges(known)

    def _model(self) -> str:
        model = self.metadata.get(MODEL_KEY)
        if model is None:
            self.fail(MODEL_KEY, "missing: the file names no tokenizer")
        if not isinstance(model, str):
            self.fail(MODEL_KEY, f"must be a string, not {_kind(model)}")
        if model not in MODELS:
            supported = ", ".join(f"'{name}' ({kind})" for name, kind in MODELS.items())
            self.fail(MODEL_KEY, f"tokenizer {model!r} is not supported (supported: {supported})")
        return model

    def _token_texts(self) -> list[str]:
        """The tokens as llama.cpp keys them: up to the first NUL, an empty one renamed."""
        tokens = self.metadata.get(TOKENS_KEY)
        if tokens is None:
            self.fail(TOKENS_KEY, "missing: the file has no vocabulary")
        if not _is_string_list(tokens):
            self.fail(TOKENS_KEY, f"must be an array of strings, not {_kind(tokens)}")
        if not tokens:
            self.fail(TOKENS_KEY, "the vocabulary has no tokens")
        if "\0" not in "".join(tokens) and all(tokens):  # the usual case, at C speed
            return tokens
        return [token.split("\0", 1)[0] or f"[EMPTY_{index}]" for index, token in enumerate(tokens)]

    def _unique(self, texts: list[str]) -> frozenset[str]:
        known = frozenset(texts)
        if len(known) < len(texts):
            first: dict[str, int] = {}
            for index, text in enumerate(texts):
                first.setdefault(text, index)
            index = next(index for index, text in enumerate(texts) if first[text] != index)
            earlier, text = first[texts[index]], texts[index]
            raw = self.metadata[TOKENS_KEY]
            self.fail(TOKENS_KEY, f"token {index} repeats token {earlier} ({text!r})"
                      f"{_how_read(raw[earlier], raw[index])}")
        return known

    def _check_types(self, texts: list[str]) -> None:
        types = self.metadata.get(TYPES_KEY)
        if types is None:
            return
        if not isinstance(types, np.ndarray) or types.dtype != np.int32:
            self.fail(TYPES_KEY, f"must be an array of int32, not {_kind(types)}")
        if len(types) != len(texts):
            self.fail(TYPES_KEY, f"has {len(types)} entries for {len(texts)} tokens")
        outside = np.flatnonzero((types < TOKEN_TYPES.start) | (types >= TOKEN_TYPES.stop))
        if outside.size:
            index = outside[0]
            self.fail(TYPES_KEY, f"token {index} has type {types[index]}, not one of "
                      f"{TOKEN_TYPES.start}..{TOKEN_TYPES.stop - 1}")
        for index in np.flatnonzero(types == BYTE_TYPE):
            if not BYTE_TOKEN.fullmatch(texts[index]):
                self.fail(TYPES_KEY, f"token {index} ({texts[index]!r}) has the byte type but is "
                          "not a byte token '<0xXX>'")

    def _check_scores(self, num_tokens: int) -> None:
        scores = self.metadata.get(SCORES_KEY)
        if scores is None:
            return
        if not isinstance(scores, np.ndarray) or scores.dtype not in _SCORE_TYPES:
            self.fail(SCORES_KEY, f"must be an array of float32 or int32, not {_kind(scores)}")
        if len(scores) != num_tokens:
            self.fail(SCORES_KEY, f"has {len(scores)} entries for {num_tokens} tokens")
        bad = np.flatnonzero(~np.isfinite(scores))
        if bad.size:
            self.fail(SCORES_KEY, f"token {bad[0]} has the score {scores[bad[0]]}, not a finite number")

    def _check_special_ids(self, num_tokens: int) -> None:
        for key, value in self.metadata.items():
            if not SPECIAL_ID_KEY.fullmatch(key):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                self.fail(key, f"must be an unsigned integer token id, not {_kind(value)}")
            if not 0 <= value < num_tokens:
                self.fail(key, f"token id {value} is outside the vocabulary (0..{num_tokens - 1})")

    def _check_flags(self) -> None:
        for key in BOOL_KEYS:
            value = self.metadata.get(key)
            if value is not None and not isinstance(value, bool):
                self.fail(key, f"must be a bool, not {_kind(value)}")

    def _check_byte_tokens(self, known: frozenset[str]) -> None:
        """Every byte has a token: '<0xXX>', or for ASCII but NUL the character itself (as
        llama.cpp falls back to; NUL cannot be a token's text)."""
        if known.issuperset(BYTE_TOKENS):
            return
        missing = [byte for byte, name in enumerate(BYTE_TOKENS)
                   if name not in known and not (0 < byte < 0x80 and chr(byte) in known)]
        if missing:
            self.fail(TOKENS_KEY, f"a SentencePiece ('llama') vocabulary needs a token for every "
                      f"byte, but {len(missing)} bytes have none (first {BYTE_TOKENS[missing[0]]}): "
                      "llama.cpp would abort on the first text that needs one")

    def _check_pre_tokenizer(self) -> None:
        pre = self.metadata.get(PRE_KEY)
        if pre is None:
            return  # llama.cpp uses its default
        if not isinstance(pre, str):
            self.fail(PRE_KEY, f"must be a string, not {_kind(pre)}")
        if pre in ABORTING_PRE_TOKENIZERS:
            self.fail(PRE_KEY, f"pre-tokenizer {pre!r} cannot split text for a byte-level BPE ('gpt2') "
                      "vocabulary (llama.cpp would abort)")

    def _check_merges(self, known: frozenset[str]) -> None:
        merges = self.metadata.get(MERGES_KEY)
        if merges is None:
            self.fail(MERGES_KEY, "missing: a BPE ('gpt2') vocabulary needs its merges")
        if not _is_string_list(merges):
            self.fail(MERGES_KEY, f"must be an array of strings, not {_kind(merges)}")
        if _merges_name_tokens(merges, known):
            return
        for index, merge in enumerate(merges):
            left, space, right = merge.partition(" ")
            if not space or " " in right:
                self.fail(MERGES_KEY, f"merge {index} ({merge!r}) is not two tokens joined by one "
                          "space")
            for part in (left, right, left + right):
                if part not in known:
                    self.fail(MERGES_KEY, f"merge {index} ({merge!r}) names {part!r}, which is "
                              "not a token")


def _merges_name_tokens(merges: list[str], known: frozenset[str]) -> bool:
    """Whether each merge is 'left right' with left, right and their concatenation all tokens
    (as HF tokenizers requires of a BPE model); False also when unsure (a merge holds a newline).

    Done with whole-list string operations, since a loop over the ~10^5 merges of a real
    vocabulary would take most of the check's time."""
    joined = "\n".join(merges)
    merged = joined.replace(" ", "").split("\n")
    if len(merged) != len(merges):
        return False
    spaces = (np.fromiter(map(len, merges), np.int64, len(merges))
              - np.fromiter(map(len, merged), np.int64, len(merges)))
    parts = joined.replace("\n", " ").split(" ")  # left, right, left, right, ...
    return bool((spaces == 1).all()) and known.issuperset(parts) and known.issuperset(merged)


def _is_string_list(value: Any) -> bool:
    """An array of strings as read_gguf gives it (GGUF arrays are homogeneous)."""
    return isinstance(value, list) and (not value or isinstance(value[0], str))


def _kind(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype}"
    if isinstance(value, list):
        return "an array of strings" if _is_string_list(value) else "an array of arrays"
    names = {bool: "a bool", int: "an integer", float: "a float", str: "a string"}
    return names.get(type(value), f"a {type(value).__name__}")


def _how_read(*tokens: str) -> str:
    """Why tokens that differ in the file are the same to llama.cpp."""
    if any("\0" in token for token in tokens):
        return ", as llama.cpp reads a token: up to its first NUL"
    if not all(tokens):
        return ", the name llama.cpp gives an empty token"
    return ""
