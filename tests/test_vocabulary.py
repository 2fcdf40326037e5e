"""A malformed vocabulary is a ModelFileError at load, never an abort inside llama.cpp.

Each attack is a small generated model whose vocabulary is rewritten, loaded with `Engine.load`
and then used to encode text in a child process: without the check, llama.cpp aborts that process
(at load, or at the first text it encodes), and the test fails on its exit status instead of
taking pytest down with it. The check's other rules are tested on the bundled model's metadata.
"""

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.gguf_bytes import ARRAY, STRING, UINT32, Typed
from tests.support.gguf_writing import rewrite_metadata
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.errors import ModelFileError
from tierflow.offload.gguf.reader import read_gguf
from tierflow.offload.store.model_path import bundled_model_path
from tierflow.runtime.text.vocabulary import BYTE_TOKENS, check_vocabulary

MODEL, PRE = "tokenizer.ggml.model", "tokenizer.ggml.pre"
TOKENS, TYPES, SCORES, MERGES = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                 "tokenizer.ggml.scores", "tokenizer.ggml.merges")
TEXTS = ["Hello, world!", "naïve café 日本語 🦙", "a  b\n\tc \x00\x01\x7f\x80ÿ"]

# Each child prints what it got; ggml's backtrace (through gdb) would only slow a failing test.
CHILD_ENV = {**os.environ, "GGML_NO_BACKTRACE": "1"}
LOAD_AND_ENCODE = f"""
import sys
from tierflow import Engine
from tierflow.errors import TierflowError
try:
    engine = Engine.load(sys.argv[1], threads=1, context_length=64)
except TierflowError as error:
    print(f"{{type(error).__name__}}: {{error}}")
else:
    for text in {TEXTS!r}:
        engine.tokenizer.encode(text)
    print("loaded and encoded")
"""
TOKENIZE = """
import sys
from tierflow.runtime.text.tokenizer import Tokenizer
for path in sys.argv[2:]:
    with Tokenizer.from_gguf(path) as tokenizer:
        print(repr(tokenizer.decode(tokenizer.encode(sys.argv[1], add_bos=False))))
"""


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("vocabulary") / "small.gguf", ModelSpec())


@pytest.fixture(scope="module")
def smollm2() -> dict[str, Any]:
    with read_gguf(bundled_model_path()) as model:
        return dict(model.metadata)


def _strings(values: list[str]) -> Typed:
    return Typed(ARRAY, values, STRING)


def _token_id(token_id: int) -> Typed:
    return Typed(UINT32, token_id)  # the type llama.cpp reads token ids as


def _as_read(metadata: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`metadata` with `changes` as read_gguf would give them back."""
    plain = {key: value.value if isinstance(value, Typed) else value for key, value in changes.items()}
    return {key: value for key, value in {**metadata, **plain}.items() if value is not None}


def _run_child(*args: str) -> str:
    """What the child printed, after checking that it did not die."""
    result = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True,
                            env=CHILD_ENV)
    assert result.returncode == 0, f"the child died ({result.returncode}): {result.stderr[-2000:]}"
    return result.stdout


def _spm_vocabulary(byte_token: tuple[int, str] | None = None) -> dict[str, Any]:
    """A SentencePiece vocabulary with byte fallback: a token '<0xXX>' per byte, but
    `byte_token` (byte, text) gives one byte's token another text."""
    bytes_ = list(BYTE_TOKENS)
    if byte_token is not None:
        bytes_[byte_token[0]] = byte_token[1]
    pieces = ["\u2581", "\u2581h", "\u2581hi", "h", "i"]
    tokens = ["<unk>", "<s>", "</s>", *bytes_, *pieces]
    types = [2, 3, 3] + [6 if name.startswith("<0x") else 1 for name in bytes_] + [1] * len(pieces)
    return {MODEL: "llama", TOKENS: _strings(tokens), TYPES: np.array(types, np.int32),
            SCORES: -np.arange(len(tokens), dtype=np.float32), MERGES: None, PRE: None,
            "tokenizer.ggml.unknown_token_id": _token_id(0), "tokenizer.ggml.bos_token_id": _token_id(1),
            "tokenizer.ggml.eos_token_id": _token_id(2), "tokenizer.ggml.padding_token_id": _token_id(0)}


def _tiny_bpe_vocabulary(pre: str = "smollm") -> dict[str, Any]:
    """A byte-level BPE vocabulary with tokens for 'a', 'b', 'ab' and a space only."""
    return {MODEL: "gpt2", PRE: pre, TOKENS: _strings(["<|endoftext|>", "a", "b", "ab", "\u0120"]),
            TYPES: np.array([3, 1, 1, 1, 1], np.int32), MERGES: _strings(["a b"]),
            **{f"tokenizer.ggml.{name}_token_id": _token_id(0)
               for name in ("bos", "eos", "unknown", "padding")}}


def _tokens_with(metadata: Mapping[str, Any], replacements: Mapping[int, str]) -> dict[str, Typed]:
    tokens = list(metadata[TOKENS])
    for index, text in replacements.items():
        tokens[index] = text
    return {TOKENS: _strings(tokens)}


def _with_a_flipped_bit(metadata: Mapping[str, Any]) -> dict[str, Typed]:
    """Token 500 or later with one bit of its last character flipped, so it equals another."""
    known, tokens = set(metadata[TOKENS]), metadata[TOKENS]
    flipped = (token[:-1] + chr(ord(token[-1]) ^ 1) for token in tokens[500:])
    index, twin = next((index, twin) for index, twin in enumerate(flipped, 500) if twin in known)
    return _tokens_with(metadata, {index: twin})


ATTACKS = {  # name -> (the changes to the bundled vocabulary, the error they must give)
    "repeated_token": (lambda m: _tokens_with(m, {500: m[TOKENS][501]}),
                       r"tokenizer\.ggml\.tokens: token 501 repeats token 500 \('Ġk'\)"),
    "flipped_bit_makes_a_twin": (_with_a_flipped_bit, r"tokenizer\.ggml\.tokens: token \d+ repeats token"),
    "twin_up_to_a_nul": (lambda m: _tokens_with(m, {502: m[TOKENS][501] + "\0x"}),
                         r"token 502 repeats token 501 \('Ġk'\), as llama.cpp reads a token: up to"),
    "empty_token_and_its_llama_cpp_name": (
        lambda m: _tokens_with(m, {500: "", 600: "[EMPTY_500]"}),
        r"token 600 repeats token 500 \('\[EMPTY_500\]'\), the name llama.cpp gives an empty token"),
    "spm_model_on_a_bpe_vocabulary": (lambda m: {MODEL: "llama"},
                                      "tokenizer.ggml.tokens: a SentencePiece .* 162 bytes have none"),
    "no_vocab_model": (lambda m: {MODEL: "no_vocab"}, "tokenizer 'no_vocab' is not supported"),
    "none_model": (lambda m: {MODEL: "none"}, "tokenizer 'none' is not supported"),
    "whitespace_pre_tokenizer_on_bpe": (lambda m: {PRE: "whitespace"},
                                        "tokenizer.ggml.pre: pre-tokenizer 'whitespace' cannot split"),
    "spm_vocabulary_without_a_newline_token": (lambda m: _spm_vocabulary((0x0A, "<newline>")),
                                               r"1 bytes have none \(first <0x0A>\)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("attack", ATTACKS)
def test_attack_is_a_model_file_error_not_an_abort(small_model, smollm2, tmp_path, attack):
    changes, error = ATTACKS[attack]
    path = rewrite_metadata(small_model, tmp_path / f"{attack}.gguf", changes(smollm2))
    printed = _run_child(LOAD_AND_ENCODE, str(path))
    assert printed.startswith(f"ModelFileError: {path.name}: ")
    assert re.search(error, printed), printed


def test_bundled_vocabulary_passes(smollm2):
    check_vocabulary(smollm2, "SmolLM2")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generated_models_load(tmp_path, arch):
    path = write_model(tmp_path / f"{arch}.gguf", ModelSpec(arch=arch))
    with Engine.load(path, threads=1, context_length=64) as engine:
        assert engine.tokenizer.vocab_size == 49152


def test_spm_vocabulary_with_every_byte_loads_and_encodes_newlines(small_model, tmp_path):
    path = rewrite_metadata(small_model, tmp_path / "spm.gguf", _spm_vocabulary())
    with Engine.load(path, threads=1, context_length=64) as engine:
        assert engine.tokenizer.encode("hi\n", add_bos=False)[-1] == 3 + 0x0A  # <0x0A>


def test_spm_byte_token_may_be_the_ascii_character_itself(smollm2):
    # llama.cpp falls back to the one-character token for a byte without '<0xXX>'
    check_vocabulary(_as_read(smollm2, _spm_vocabulary((0x41, "A"))), "SPM")


def test_bpe_vocabulary_missing_byte_tokens_drops_those_bytes(tmp_path):
    # llama.cpp skips a byte a BPE vocabulary has no token for (it aborts only for SentencePiece)
    path = rewrite_metadata(bundled_model_path(), tmp_path / "bpe.gguf", _tiny_bpe_vocabulary(),
                            tensors=False)
    assert _run_child(TOKENIZE, "ab é\x01ab", str(path)) == "'ab ab'\n"


LOAD = """
import sys
from tierflow.errors import ModelFileError
from tierflow.runtime.text.tokenizer import Tokenizer
try:
    Tokenizer.from_gguf(sys.argv[1]).close()
except ModelFileError as error:
    print(error)
"""


def test_an_unknown_pre_tokenizer_is_llama_cpps_load_error(tmp_path):
    vocabulary = _tiny_bpe_vocabulary("bogus")
    path = rewrite_metadata(bundled_model_path(), tmp_path / "bogus.gguf", vocabulary, tensors=False)
    check_vocabulary(_as_read({}, vocabulary), "bogus.gguf")  # ours lets llama.cpp decide
    assert "could not load the vocabulary" in _run_child(LOAD, str(path))


def _best_of_three(work) -> float:
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def test_checking_smollm2s_vocabulary_costs_less_than_twice_reading_it():
    # A load reads the metadata before it checks it: the check adds less than that reading did
    # (60-90 ms against 70-130 ms here). Both are measured in the same run, so a slow machine
    # slows both.
    def read() -> dict[str, Any]:
        with read_gguf(bundled_model_path()) as model:
            return dict(model.metadata)

    metadata = read()
    assert _best_of_three(lambda: check_vocabulary(metadata, "SmolLM2")) < 2 * _best_of_three(read)


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", "plamo2", "gemma4", "hybriddna", "whitespace",
                                   "bogus"])
def test_tokenizers_tierflow_does_not_run_are_refused(smollm2, model):
    with pytest.raises(ModelFileError, match=f"tokenizer.ggml.model: tokenizer '{model}' is not supported"):
        check_vocabulary(_as_read(smollm2, {MODEL: model}), "m.gguf")


def _types_with(metadata, index: int, token_type: int) -> dict[str, np.ndarray]:
    types = metadata[TYPES].copy()
    types[index] = token_type
    return {TYPES: types}


def _merges_with(metadata, merge: str) -> dict[str, list[str]]:
    return {MERGES: [merge, *metadata[MERGES][1:]]}


RULES = {  # name -> (the changes to the bundled vocabulary, the start of the error they must give)
    "missing_model": (lambda m: {MODEL: None}, "tokenizer.ggml.model: missing"),
    "model_not_a_string": (lambda m: {MODEL: 1}, "tokenizer.ggml.model: must be a string, not an integer"),
    "missing_tokens": (lambda m: {TOKENS: None}, "tokenizer.ggml.tokens: missing"),
    "no_tokens": (lambda m: {TOKENS: []}, "tokenizer.ggml.tokens: the vocabulary has no tokens"),
    "tokens_not_strings": (lambda m: {TOKENS: np.zeros(len(m[TOKENS]), np.int32)},
                           "tokenizer.ggml.tokens: must be an array of strings, not an array of int32"),
    "types_not_int32": (lambda m: {TYPES: m[TYPES].astype(np.uint32)},
                        "tokenizer.ggml.token_type: must be an array of int32, not an array of uint32"),
    "types_shorter_than_tokens": (lambda m: {TYPES: m[TYPES][:-1]},
                                  "tokenizer.ggml.token_type: has 49151 entries for 49152 tokens"),
    "type_out_of_range": (lambda m: _types_with(m, 500, 7),
                          "tokenizer.ggml.token_type: token 500 has type 7, not one of 0..6"),
    "byte_type_on_a_non_byte_token": (lambda m: _types_with(m, 500, 6),
                                      "tokenizer.ggml.token_type: token 500 ('ast') has the byte type but "
                                      "is not a byte token"),
    "scores_not_float32_or_int32": (lambda m: {SCORES: np.zeros(len(m[TOKENS]), np.float64)},
                                    "tokenizer.ggml.scores: must be an array of float32 or int32"),
    "scores_shorter_than_tokens": (lambda m: {SCORES: np.zeros(len(m[TOKENS]) - 1, np.float32)},
                                   "tokenizer.ggml.scores: has 49151 entries for 49152 tokens"),
    "score_not_finite": (lambda m: {SCORES: np.where(np.arange(len(m[TOKENS])) == 7, np.nan, 0)
                                    .astype(np.float32)},
                         "tokenizer.ggml.scores: token 7 has the score nan, not a finite number"),
    "special_id_outside_the_vocabulary": (
        lambda m: {"tokenizer.ggml.bos_token_id": 49152},
        "tokenizer.ggml.bos_token_id: token id 49152 is outside the vocabulary (0..49151)"),
    "special_id_not_an_integer": (lambda m: {"tokenizer.ggml.eot_token_id": "2"},
                                  "tokenizer.ggml.eot_token_id: must be an unsigned integer token id"),
    "flag_not_a_bool": (lambda m: {"tokenizer.ggml.add_bos_token": 1},
                        "tokenizer.ggml.add_bos_token: must be a bool, not an integer"),
    "missing_merges": (lambda m: {MERGES: None}, "tokenizer.ggml.merges: missing"),
    "merges_not_strings": (lambda m: {MERGES: np.zeros(3, np.int32)},
                           "tokenizer.ggml.merges: must be an array of strings, not an array of int32"),
    "merge_without_a_space": (lambda m: _merges_with(m, "Ġt"),
                              "tokenizer.ggml.merges: merge 0 ('Ġt') is not two tokens joined by one space"),
    "merge_of_three": (lambda m: _merges_with(m, "Ġ t h"),
                       "tokenizer.ggml.merges: merge 0 ('Ġ t h') is not two tokens"),
    "merge_naming_a_non_token": (lambda m: _merges_with(m, "Ġ zzqqxx"),
                                 "tokenizer.ggml.merges: merge 0 ('Ġ zzqqxx') names 'zzqqxx', which is "
                                 "not a token"),
    "merge_making_a_non_token": (lambda m: _merges_with(m, "<|endoftext|> <|endoftext|>"),
                                 "tokenizer.ggml.merges: merge 0 ('<|endoftext|> <|endoftext|>') names "
                                 "'<|endoftext|><|endoftext|>', which is not a token"),
    "pre_tokenizer_not_a_string": (lambda m: {PRE: 3}, "tokenizer.ggml.pre: must be a string, not an"),
}


@pytest.mark.parametrize("rule", RULES)
def test_vocabulary_breaking_a_rule_is_refused(smollm2, rule):
    changes, error = RULES[rule]
    with pytest.raises(ModelFileError, match="^" + re.escape(f"m.gguf: {error}")):
        check_vocabulary(_as_read(smollm2, changes(smollm2)), "m.gguf")
