"""Structured output: grammars that constrain what a generation may write, and their matchers.

llguidance (a maintained Rust automaton) does the matching over the model's real token strings:
a `Grammar` is its grammar text, checked when built; a `GrammarMatcher` is one generation's place
in it. The Sampler asks the matcher to mask the logits before every pick (runtime/sampling/sampler.py), so
the plain loop, prompt lookup and a draft model's tree all emit only tokens the grammar allows,
and an end-of-generation token exactly where the grammar may end.

    Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    Grammar.regex(r"\\d{3}-\\d{4}")
    Grammar.gbnf('root ::= "yes" | "no"')
"""

import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import llguidance
import llguidance.llamacpp
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from tierflow.errors import InvalidArgumentError, TierflowError
from tierflow.runtime.sampling.schema_checks import MAX_ROW_ITEMS, check_schema
from tierflow.runtime.text.tokenizer import Tokenizer

# JSON as the model writes it unprompted and as json.dumps does: ", " and ": ", no free whitespace.
# llguidance's default allows any whitespace between tokens, where a small model can loop on
# newlines until max_tokens. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Short errors: llguidance's verbose ones print the parser's state and the whole grammar. Rows as
# wide as schema_checks lets through (its default of 2000 items is about 500 properties).
LIMITS = llguidance.LLParserLimits(verbose_errors=False, max_items_in_row=MAX_ROW_ITEMS)
MAX_MESSAGE_CHARS = 400  # of llguidance's message quoted in an error (it may quote the input)
RESPONSE_FORMATS = "'text', 'json_object' or 'json_schema'"


@dataclass(frozen=True)
class Grammar:
    """A constraint on generated text, in llguidance's grammar format, checked when built (a
    malformed one is an InvalidArgumentError naming the problem)."""

    kind: str  # what it was made from: "JSON schema", "regex", "Lark grammar", "GBNF grammar"
    definition: str  # llguidance's grammar text

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def json_schema(cls, schema: Mapping | bool) -> "Grammar":
        """JSON valid under `schema`: objects, arrays, strings, numbers, integers, booleans, enums,
        const, required, additionalProperties, $defs/$ref, anyOf/oneOf/allOf, nullable types,
        ranges, lengths, patterns and formats; a keyword outside that is refused by name."""
        if not isinstance(schema, (Mapping, bool)):
            raise InvalidArgumentError(f"a JSON schema must be an object (a dict), "
                                       f"not {type(schema).__name__}")
        try:
            text = json.dumps(schema)
            check_schema(schema)
            definition = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except (TypeError, ValueError, RecursionError) as error:
            raise InvalidArgumentError(f"the JSON schema cannot be read: {error}") from None
        return cls._checked("JSON schema", definition)

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """Text matching the regular expression as a whole (Rust's regex syntax)."""
        return cls._checked("regex", llguidance.LLMatcher.grammar_from_regex(_text("regex", pattern)))

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """A Lark-syntax grammar (llguidance's dialect: `start: "yes" | "no"`)."""
        lark = _text("Lark grammar", text)
        return cls._checked("Lark grammar", llguidance.LLMatcher.grammar_from_lark(lark))

    @classmethod
    def gbnf(cls, text: str) -> "Grammar":
        """A GBNF grammar, llama.cpp's format (`root ::= "yes" | "no"`)."""
        try:
            lark = gbnf_to_lark(_text("GBNF grammar", text))
        except (Exception, RecursionError) as error:  # its parser raises bare Exceptions
            raise InvalidArgumentError(f"the GBNF grammar is invalid: {_short(error)}") from None
        return cls._checked("GBNF grammar", llguidance.LLMatcher.grammar_from_lark(lark))

    @classmethod
    def _checked(cls, kind: str, definition: str) -> "Grammar":
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition, limits=LIMITS)
        if failed:
            raise InvalidArgumentError(_explained(kind, messages[0]))
        return cls(kind, definition)


def grammar_for(response_format: object = None, grammar: object = None) -> Grammar | None:
    """The constraint a generation asks for: OpenAI's response_format ({"type": "text"},
    {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}) or a Grammar, not both; None when unconstrained."""
    if grammar is not None and not isinstance(grammar, Grammar):
        raise InvalidArgumentError(f"grammar must be a tierflow Grammar (Grammar.regex(...), ...), "
                                   f"not {type(grammar).__name__}")
    from_format = _response_format_grammar(response_format)
    if grammar is not None and from_format is not None:
        raise InvalidArgumentError("give response_format or grammar, not both")
    return grammar or from_format


def _response_format_grammar(response_format: object) -> Grammar | None:
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidArgumentError(f"response_format must be an object with a 'type' ({RESPONSE_FORMATS}), "
                                   f"not {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        return Grammar.json_schema(_schema_of(response_format.get("json_schema")))
    raise InvalidArgumentError(f"response_format.type must be {RESPONSE_FORMATS}, not {kind!r}")


def _schema_of(spec: object) -> Mapping:
    """The schema of OpenAI's {"name", "schema", "strict", "description"}."""
    where = "response_format.json_schema"
    if not isinstance(spec, Mapping):
        raise InvalidArgumentError(f"{where} must be an object with 'name' and 'schema'")
    if not isinstance(spec.get("name", ""), str):
        raise InvalidArgumentError(f"{where}.name must be a string")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InvalidArgumentError(f"{where}.strict must be true or false")
    if "schema" not in spec:
        raise InvalidArgumentError(f"{where}.schema is missing: it is the JSON schema the output must follow")
    return spec["schema"]


def grammar_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokens (their bytes; the end-of-generation ones, which it
    allows exactly where the grammar may end). Built once per engine: about 0.25 s."""
    with warnings.catch_warnings():  # it reads each token's attributes by a deprecated name
        warnings.simplefilter("ignore", DeprecationWarning)
        return llguidance.llamacpp.lltokenizer_from_vocab(tokenizer.llama_vocab, n_vocab=vocab_size,
                                                          eos_token=sorted(tokenizer.eog_ids))


class GrammarMatcher:
    """One generation's place in a grammar: masks the logits to what may come next.

    It follows the history it is handed (the prompt's ids, then the generated ones) rather than
    being told each emitted token: the token loop and speculative acceptance ask the Sampler at
    every position they emit, with the history up to it, so walking a token tree or rejecting a
    guess only moves the matcher forward and back (llguidance rolls back), and neither loop needs
    to know about grammars.
    """

    def __init__(self, vocabulary: llguidance.LLTokenizer, grammar: Grammar, prompt_length: int):
        self.grammar = grammar
        self.prompt_length = prompt_length
        self.matcher = llguidance.LLMatcher(vocabulary, grammar.definition, log_level=0, limits=LIMITS)
        if self.matcher.is_error():  # such as an unsatisfiable schema (minimum > maximum)
            raise InvalidArgumentError(_explained(grammar.kind, self.matcher.get_error()))
        self.end_ids = frozenset(vocabulary.eos_tokens)
        self.consumed: list[int] = []  # the generated tokens the matcher has taken
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocabulary.vocab_size)  # [1, V/32]
        self._disallowed: np.ndarray | None = None  # [V] bool, for the matcher's current state
        self._check_satisfiable()

    def _check_satisfiable(self) -> None:
        """A grammar whose language is empty (a schema that is only `{"$ref": "#"}`) lets llguidance
        offer nothing but the end at the start, which would answer "": refused before any token."""
        try:
            allowed = set(np.flatnonzero(~self._disallowed_now()).tolist())
        except TierflowError:
            allowed = set()
        if not self.matcher.is_accepting() and allowed <= self.end_ids:
            raise InvalidArgumentError(f"the {self.grammar.kind} allows no text at all")

    def mask(self, logits: np.ndarray, history: Sequence[int]) -> None:
        """Sets the logits [V] of the tokens the grammar forbids after history to -inf, in place."""
        self._follow(list(history[self.prompt_length:]))
        np.copyto(logits, -np.inf, where=self._disallowed_now()[:logits.shape[-1]])

    def _follow(self, generated: list[int]) -> None:
        """Moves the matcher to the end of `generated`: back to where `generated` and `consumed`
        part ways, then on through the rest (usually one token, or none), up to an
        end-of-generation token: that ends the generation (a stopped matcher refuses it), and
        what a token tree guesses past it is never emitted."""
        kept = len(self.consumed)
        if generated[:kept] != self.consumed:
            kept = _common_length(generated, self.consumed)
            self.matcher.rollback(len(self.consumed) - kept)
            del self.consumed[kept:]
            self._disallowed = None
        new = generated[kept:]
        new = new[:next((i for i, token in enumerate(new) if token in self.end_ids), len(new))]
        if not new:
            return
        if not self.matcher.consume_tokens(new):
            raise TierflowError(f"a generated token broke the {self.grammar.kind}: "
                                f"{_short(self.matcher.get_error())}")
        self.consumed.extend(new)
        self._disallowed = None

    def _disallowed_now(self) -> np.ndarray:
        if self._disallowed is None:
            llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
            allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little").view(bool)
            if not allowed.any():
                raise TierflowError(f"the {self.grammar.kind} allows no token here: "
                                    f"{_short(self.matcher.get_error() or self.matcher.stop_reason())}")
            self._disallowed = ~allowed
        return self._disallowed


def _common_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _text(kind: str, text: object) -> str:
    if not isinstance(text, str):
        raise InvalidArgumentError(f"a {kind} must be a str, not {type(text).__name__}")
    return text


def _explained(kind: str, message: str) -> str:
    """llguidance's message, with an unsupported schema keyword named as such."""
    unsupported = re.match(r"Unimplemented keys: (\[.*?\])", message)
    if unsupported:
        keys = ", ".join(repr(key) for key in json.loads(unsupported.group(1)))
        return f"the {kind} uses {keys}, which structured output does not support"
    return f"the {kind} is invalid: {_short(message)}"


def _short(message: object) -> str:
    text = str(message).strip()
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."
