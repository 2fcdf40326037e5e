"""JSON schemas in OpenAI's strict subset (every property required, additionalProperties false),
for the structured-output tests: each with the prompt that asks for it. Strings and arrays are
bounded so that the bundled model's greedy output, which repeats itself, still ends."""

NAME = {"type": "string", "maxLength": 24}

FLAT = {
    "type": "object",
    "properties": {"city": NAME, "country": NAME,
                   "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}},
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}

NESTED = {
    "type": "object",
    "properties": {
        "name": NAME,
        "address": {
            "type": "object",
            "properties": {"street": NAME, "city": NAME},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "hobbies": {"type": "array", "items": {"type": "string", "enum": ["chess", "golf", "music"]},
                    "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "address", "hobbies", "employed"],
    "additionalProperties": False,
}

RANGES = {
    "type": "object",
    "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        "wind": {"type": "integer", "exclusiveMinimum": 0, "maximum": 12},
    },
    "required": ["temperature", "humidity", "wind"],
    "additionalProperties": False,
}

REFS = {
    "$defs": {
        "item": {
            "type": "object",
            "properties": {"title": NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000},
                           "note": {"type": ["string", "null"], "maxLength": 24}},
            "required": ["title", "price", "note"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2},
        "discount": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"type": "null"}]},
    },
    "required": ["items", "discount"],
    "additionalProperties": False,
}

# name -> (schema, what to ask for)
SCHEMAS = {
    "flat": (FLAT, "Describe the capital of France as JSON."),
    "nested": (NESTED, "Describe a person with an address and hobbies, as JSON."),
    "ranges": (RANGES, "Give today's weather in Paris as JSON."),
    "refs": (REFS, "List a shopping order of two items as JSON."),
}


def response_format(schema: dict | str) -> dict:
    """OpenAI's response_format for a schema, or for the one SCHEMAS names."""
    schema = SCHEMAS[schema][0] if isinstance(schema, str) else schema
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def messages(name: str) -> list[dict]:
    return [{"role": "user", "content": SCHEMAS[name][1]}]
