"""Schemas the grammar engine cannot follow are refused when the grammar is made, before any token,
naming where: too wide for its parser, or satisfied by no finite JSON (issue 47, items 6 and 9)."""

import numpy as np
import pytest

from tierflow.errors import InvalidArgumentError
from tierflow.runtime.sampling.schema_checks import MAX_ROW_ITEMS, check_schema
from tierflow.runtime.sampling.structured import Grammar, GrammarMatcher, grammar_vocabulary


def optional_properties(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}


def objects_any_of(count: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"a{i}": {"type": "integer"}}, "required": [f"a{i}"]}
                      for i in range(count)]}


@pytest.mark.parametrize("schema, where", [(optional_properties(3000), "at /"),
                                           ({"type": "object", "properties": {"x": objects_any_of(12000)}},
                                            "at /properties/x")])
def test_a_schema_too_wide_for_the_parser_is_refused_naming_where(schema, where):
    with pytest.raises(InvalidArgumentError, match=f"too wide for structured output {where}"):
        Grammar.json_schema(schema)


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
])
def test_a_schema_no_finite_json_satisfies_is_refused(schema):
    with pytest.raises(InvalidArgumentError, match="no finite JSON satisfies|allows no text"):
        Grammar.json_schema(schema)


NODE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}},
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
     "required": ["next"]},
    {"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
    optional_properties(MAX_ROW_ITEMS // 4 - 10),
])
def test_recursive_and_wide_schemas_with_a_way_out_are_taken(schema):
    check_schema(schema)
    assert Grammar.json_schema(schema).kind == "JSON schema"


@pytest.mark.slow
def test_the_widest_schema_taken_is_followed_to_its_end(engine):
    """The parser's rows hold an object of as many properties as the check lets through."""
    schema = {**optional_properties(MAX_ROW_ITEMS // 4 - 10), "additionalProperties": False}
    vocabulary = grammar_vocabulary(engine.tokenizer, engine.config.vocab_size)
    matcher = GrammarMatcher(vocabulary, Grammar.json_schema(schema), 0)
    history = []
    for token in engine.tokenize('{"p12": 5, "p2000": 7}', add_bos=False):
        logits = np.zeros(engine.config.vocab_size, np.float32)
        matcher.mask(logits, history)
        assert logits[token] == 0, f"{engine.tokenizer.decode(history + [token])!r} was refused"
        history.append(token)


def test_a_tool_whose_parameters_recur_with_no_way_out_is_refused_when_its_call_is_forced(engine):
    tool = {"type": "function", "function": {"name": "loop", "parameters": {
        "type": "object", "properties": {"again": {"$ref": "#"}}, "required": ["again"]}}}
    with pytest.raises(InvalidArgumentError, match="no finite JSON satisfies the parameters of the tool"):
        engine.chat([{"role": "user", "content": "hi"}], tools=[tool], tool_choice="required", max_tokens=4)
