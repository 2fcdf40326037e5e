"""What a JSON schema must satisfy before structured output compiles it, checked up front so that a
schema the grammar engine cannot follow is refused before the first token, naming where it fails:

- some finite JSON must satisfy it: `{"$ref": "#"}`, or required properties that recur with no way
  out, would otherwise let the model end at once with "" or write until max_tokens;
- no object or alternative may be wider than the engine's parser holds at one step: llguidance's
  Earley rows hold MAX_ROW_ITEMS items, and a row at the start of a property name holds about four
  per property the object allows there (an `anyOf`, one per alternative); a wider one would fail
  mid-generation ("Current row has 12007 items").

Only what can be read from the schema's own structure is judged; conflicting constraints (a
minimum above a maximum) are left to llguidance, which refuses them when the matcher is made.
"""

from collections.abc import Iterator

from tierflow.errors import InvalidArgumentError

# llguidance's max_items_in_row, raised from its default of 2000: about 2,500 properties in one
# object, whose masks take about 0.1 s each on 2 cores (runtime/sampling/structured.py LIMITS).
MAX_ROW_ITEMS = 10_000
ITEMS_PER_PROPERTY = 4  # measured: 500 properties make a row of 2007 items, 3000 one of 12007
_ALTERNATIVES = ("anyOf", "oneOf")


def check_schema(schema: object, where: str = "the JSON schema") -> None:
    """Raises InvalidArgumentError, naming the place (a JSON pointer), if `schema` is too wide for
    the grammar engine or no finite JSON satisfies it."""
    if not isinstance(schema, dict):
        return
    for pointer, node in _nodes(schema, ""):
        width = _row_items(node)
        if width > MAX_ROW_ITEMS:
            raise InvalidArgumentError(
                f"{where} is too wide for structured output at {pointer or '/'}: its parser would hold "
                f"about {width} items at one step, at most {MAX_ROW_ITEMS} (about "
                f"{MAX_ROW_ITEMS // ITEMS_PER_PROPERTY} properties in one object, or {MAX_ROW_ITEMS} "
                f"alternatives)")
    if not _finite(schema, schema, frozenset()):
        raise InvalidArgumentError(f"no finite JSON satisfies {where}: every instance would contain "
                                   f"itself (a $ref that recurs through required parts with no way out)")


def _row_items(node: dict) -> int:
    properties = node.get("properties")
    width = ITEMS_PER_PROPERTY * len(properties) if isinstance(properties, dict) else 0
    for keyword in _ALTERNATIVES:
        if isinstance(node.get(keyword), list):
            width = max(width, len(node[keyword]))
    return width


def _nodes(node: object, pointer: str) -> Iterator[tuple[str, dict]]:
    """Every schema object under `node`, with its JSON pointer (iteratively: schemas may nest deep)."""
    stack = [(pointer, node)]
    while stack:
        pointer, node = stack.pop()
        if isinstance(node, dict):
            yield pointer, node
            stack.extend((f"{pointer}/{_escaped(key)}", value) for key, value in node.items())
        elif isinstance(node, list):
            stack.extend((f"{pointer}/{i}", value) for i, value in enumerate(node))


def _escaped(key: object) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _finite(node: object, root: dict, visiting: frozenset[str]) -> bool:
    """Whether some finite JSON satisfies `node`, following $refs; a $ref met again on the way
    down is a cycle, which gives no finite instance along this way."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref in visiting:
            return False
        target = _resolve(root, ref)
        if target is not None and not _finite(target, root, visiting | {ref}):
            return False
    if any(not _finite(part, root, visiting) for part in node.get("allOf", []) if isinstance(part, dict)):
        return False
    for keyword in _ALTERNATIVES:
        choices = node.get(keyword)
        if isinstance(choices, list) and choices and not any(_finite(c, root, visiting) for c in choices):
            return False
    return _finite_by_type(node, root, visiting)


def _finite_by_type(node: dict, root: dict, visiting: frozenset[str]) -> bool:
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if types is not None and any(t not in ("object", "array") for t in types):
        return True  # a scalar type is always finite
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = [name for name in node.get("required", []) if isinstance(name, str)] \
        if isinstance(node.get("required"), list) else []
    if (types is None or "object" in types) and all(
            _finite(properties.get(name, True), root, visiting) for name in required):
        return True
    items = node.get("items", True)
    min_items = node.get("minItems", 0)
    return (types is None or "array" in types) and (not min_items or _finite(items, root, visiting))


def _resolve(root: dict, ref: str) -> object | None:
    """The schema a local pointer names ("#", "#/$defs/X"), or None for one that is not local."""
    if not ref.startswith("#"):
        return None
    node: object = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
