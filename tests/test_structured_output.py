"""Structured output in the Python API: every token the grammar allows, on the bundled model, for
greedy, sampled and speculative generation; malformed or unsupported constraints refused by name."""

import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest

from tests.support.schemas import SCHEMAS, messages, response_format
from tierflow import Engine, Grammar
from tierflow.errors import InvalidArgumentError
from tierflow.offload.gguf.convert import convert_model
from tierflow.runtime.sampling.sampler import Sampler, SamplingParams
from tierflow.runtime.sampling.structured import GrammarMatcher, grammar_vocabulary

GREEDY = {"temperature": 0}
SAMPLED = {"temperature": 0.8, "seed": 7}
ROOM = 200  # tokens: every schema's answer ends well within it


def constrained(name: str, max_tokens: int = ROOM) -> dict:
    return {"response_format": response_format(name), "max_tokens": max_tokens}


def validated(text: str, schema: dict) -> dict:
    document = json.loads(text)
    jsonschema.validate(document, schema)
    return document


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_output_parses_and_validates(engine, name, sampling):
    result = engine.chat(messages(name), **constrained(name), **sampling)
    validated(result.text, SCHEMAS[name][0])
    assert result.finish_reason == "stop"


def test_json_object_output_is_a_json_object(engine):
    json_object = {"type": "json_object"}
    result = engine.chat(messages("flat"), response_format=json_object, max_tokens=ROOM, **SAMPLED)
    assert isinstance(json.loads(result.text), dict) and result.finish_reason == "stop"


def test_a_text_response_format_leaves_the_output_as_it_was(engine):
    plain = engine.chat(messages("flat"), max_tokens=12, **GREEDY)
    text = engine.chat(messages("flat"), response_format={"type": "text"}, max_tokens=12, **GREEDY)
    assert text.tokens == plain.tokens


def test_streamed_pieces_join_to_the_validated_answer(engine):
    stream = engine.chat_stream(messages("nested"), **constrained("nested"), **GREEDY)
    validated("".join(stream), SCHEMAS["nested"][0])


def test_regex_grammar_output_matches_the_regex(engine):
    result = engine.generate("My phone number is", grammar=Grammar.regex(r"\d{3}-\d{4}"), **SAMPLED)
    assert re.fullmatch(r"\d{3}-\d{4}", result.text) and result.finish_reason == "stop"


def test_the_end_token_comes_only_where_the_grammar_may_end(engine):
    """The model would stop after a word or two; twelve letters are what the regex accepts."""
    say_hi = [{"role": "user", "content": "Say hi."}]
    result = engine.chat(say_hi, grammar=Grammar.regex("[a-z]{12}"), **GREEDY)
    assert re.fullmatch("[a-z]{12}", result.text) and result.finish_reason == "stop"


def test_gbnf_grammar_output_is_one_of_its_sentences(engine):
    grammar = Grammar.gbnf('root ::= answer "."\nanswer ::= "yes" | "no" | "maybe"')
    result = engine.chat([{"role": "user", "content": "Is the sky blue?"}], grammar=grammar, **SAMPLED)
    assert result.text in ("yes.", "no.", "maybe.") and result.finish_reason == "stop"


def test_lark_grammar_output_follows_its_rules(engine):
    grammar = Grammar.lark('start: "(" NUMBER ("," NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/')
    result = engine.generate("Three small numbers:", grammar=grammar, max_tokens=ROOM, **GREEDY)
    assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", result.text) and result.finish_reason == "stop"


def test_max_tokens_cutting_the_json_off_finishes_with_length(engine):
    result = engine.chat(messages("nested"), **constrained("nested", max_tokens=5), **GREEDY)
    assert result.finish_reason == "length" and len(result.tokens) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


# -- speculative decoding: a guess the grammar forbids is rejected ------------------------------

@pytest.fixture(scope="module")
def prompt_lookup(model_path):
    with Engine.load(model_path, threads=2, context_length=1024, draft="ngram", draft_tokens=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def drafted(model_path, tmp_path_factory):
    """A 3-bit draft of the bundled model, whose greedy guesses ignore the grammar."""
    draft = convert_model(None, tmp_path_factory.mktemp("draft") / "smollm2-3bit.gguf", 3, "rtn").path
    with Engine.load(model_path, threads=2, context_length=512, draft=draft, draft_tokens=6) as engine:
        yield engine


@pytest.mark.slow
@pytest.mark.parametrize("speculating", ["prompt_lookup", "drafted"])
def test_greedy_constrained_output_is_the_same_with_speculation(engine, speculating, request):
    speculative = request.getfixturevalue(speculating)
    expected = engine.chat(messages("refs"), **constrained("refs"), **GREEDY)
    result = speculative.chat(messages("refs"), **constrained("refs"), **GREEDY)
    assert result.tokens == expected.tokens and result.stats.drafted_tokens > 0


@pytest.mark.parametrize("speculating", ["prompt_lookup", "drafted"])
def test_sampled_constrained_output_validates_with_speculation(speculating, request):
    speculative = request.getfixturevalue(speculating)
    result = speculative.chat(messages("nested"), **constrained("nested"), **SAMPLED)
    validated(result.text, SCHEMAS["nested"][0])
    assert result.stats.drafted_tokens > 0


def test_a_greedy_drafts_guesses_are_tokens_the_grammar_allows(drafted):
    """Under a grammar the draft ranks its guesses by the masked logits: any other would be rejected."""
    grammar = Grammar.json_schema(SCHEMAS["nested"][0])
    prompt = drafted.tokenize_chat(messages("nested"))
    root = drafted.tokenize('{"', add_bos=False)
    vocabulary = grammar_vocabulary(drafted.tokenizer, drafted.config.vocab_size)
    matcher = GrammarMatcher(vocabulary, grammar, len(prompt))
    sampler = Sampler(SamplingParams(temperature=0), len(prompt), constraint=matcher)
    with drafted.speculator.draft.turn:  # the draft model is shared by the sequences
        tree = drafted.speculator.draft.propose(prompt + root, 6, sampler)
    for node in range(1, len(tree)):
        path = root + tree.path_tokens(node)
        assert llguidance.LLMatcher(vocabulary, grammar.definition).validate_tokens(path) == len(path)


def test_the_matcher_follows_a_history_that_goes_back(engine):
    """As speculative acceptance walks a token tree: the mask after going back is the one a fresh
    matcher gives."""
    vocabulary = grammar_vocabulary(engine.tokenizer, engine.config.vocab_size)
    grammar, prompt = Grammar.json_schema(SCHEMAS["flat"][0]), [1, 2, 3]
    walked, fresh = GrammarMatcher(vocabulary, grammar, len(prompt)), GrammarMatcher(vocabulary, grammar, 3)
    ahead = engine.tokenize('{"city": "Paris", "country', add_bos=False)
    masks = [np.zeros(engine.config.vocab_size) for _ in range(3)]
    walked.mask(masks[0], prompt + ahead)
    walked.mask(masks[1], prompt + ahead[:1])
    fresh.mask(masks[2], prompt + ahead[:1])
    assert np.array_equal(masks[1], masks[2]) and not np.array_equal(masks[0], masks[1])


# -- refused --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("keyword", "schema"), [
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("if", {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
])
def test_an_unsupported_schema_keyword_is_refused_by_name(engine, keyword, schema):
    with pytest.raises(InvalidArgumentError, match=f"'{keyword}'.*not support"):
        engine.generate("x", response_format=response_format(schema))


@pytest.mark.parametrize(("schema", "problem"), [
    ({"type": "strin"}, "Invalid type: strin"),
    ({"type": "string", "pattern": "[a-z"}, "unclosed character class"),
    ({"type": "string", "format": "postcode"}, "Unknown format: postcode"),
    ({"$ref": "#/$defs/missing"}, "/\\$defs/missing"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum \\(5\\) is greater than maximum \\(2\\)"),
    ({"enum": [], "type": "string"}, "Unsatisfiable"),
    ([1, 2], "must be an object"),
])
def test_a_malformed_schema_is_refused_naming_the_problem(engine, schema, problem):
    with pytest.raises(InvalidArgumentError, match=problem):
        engine.generate("x", response_format=response_format(schema))


def test_a_schema_nested_too_deeply_is_refused_not_a_crash(engine):
    schema = {"type": "string"}
    for _ in range(1000):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    with pytest.raises(InvalidArgumentError, match="JSON schema cannot be read.*recursion"):
        engine.generate("x", response_format=response_format(schema))


@pytest.mark.parametrize(("make", "problem"), [
    (lambda: Grammar.regex("(abc"), "regex is invalid.*unclosed group"),
    (lambda: Grammar.lark("start: foo"), "Lark grammar is invalid.*unknown name"),
    (lambda: Grammar.gbnf('root ::= ( "yes"'), "GBNF grammar is invalid.*Expected '\\)'"),
    (lambda: Grammar.gbnf("root ::= missing"), "GBNF grammar is invalid.*'missing' not found"),
    (lambda: Grammar.regex(b"[0-9]"), "must be a str"),
    (lambda: Grammar.json_schema({"type": "object", "default": object()}), "cannot be read"),
])
def test_a_malformed_grammar_is_refused_naming_the_problem(make, problem):
    with pytest.raises(InvalidArgumentError, match=f"(?s){problem}"):  # its message may quote the grammar
        make()


@pytest.mark.parametrize(("response_format", "problem"), [
    ("json_object", "response_format must be an object"),
    ({"type": "xml"}, "response_format.type must be 'text', 'json_object' or 'json_schema', not 'xml'"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "s"}}, "response_format.json_schema.schema is missing"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "name must be a string"),
])
def test_a_bad_response_format_is_refused_naming_it(engine, response_format, problem):
    with pytest.raises(InvalidArgumentError, match=re.escape(problem)):
        engine.generate("x", response_format=response_format)


def test_a_response_format_and_a_grammar_together_are_refused(engine):
    with pytest.raises(InvalidArgumentError, match="not both"):
        engine.generate("x", response_format={"type": "json_object"}, grammar=Grammar.regex("a"))


def test_a_grammar_that_is_not_a_grammar_is_refused(engine):
    with pytest.raises(InvalidArgumentError, match="grammar must be a tierflow Grammar"):
        engine.generate("x", grammar=r"\d+")
