"""Hostile values for metadata: boundary integers, odd floats, values of the wrong type, chat
templates that attack the renderer, and architecture names."""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import numpy as np

from tests.fuzz.seeds import Value
from tests.support.gguf_bytes import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    Raw,
    Typed,
)
from tierflow.runtime.models import ARCHITECTURES

INT_RANGES = {UINT8: (0, 2**8 - 1), INT8: (-2**7, 2**7 - 1), UINT16: (0, 2**16 - 1),
              INT16: (-2**15, 2**15 - 1), UINT32: (0, 2**32 - 1), INT32: (-2**31, 2**31 - 1),
              UINT64: (0, 2**64 - 1), INT64: (-2**63, 2**63 - 1)}
TYPE_NAMES = {UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16", UINT32: "uint32",
              INT32: "int32", FLOAT32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array",
              UINT64: "uint64", INT64: "int64", FLOAT64: "float64"}
BOUNDARY_INTS = (0, 1, -1, 2, 3, 7, 31, 32, 33, 63, 64, 65, 255, 256, 2**15, 2**16, 2**24, 2**24 + 1,
                 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -2**31, -2**63)
ODD_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e38, -1e38, 1e-45, 3.4028235e38, 0.5, 1.0,
              -1.0, 1e-30)
# Values that pass a type and range check, so that the file reaches the checks (and code) after it.
PLAUSIBLE_INTS = (0, 1, 2, 3, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 4096)
PLAUSIBLE_FLOATS = (0.5, 1.0, 1.0000001, 2.0, 8.0, 1e-12, 1e-6, 0.999, 1e6, 1e30, 1e-30)
PLAUSIBLE_STRINGS = ("none", "linear", "yarn", "longrope", "llama", "gpt2", "x")
WRONG_STRINGS = ("", "abc", "1e4", "10000", "\0", "nan", "-1", "llama", "x" * 70_000)
ARCHITECTURE_NAMES = (*ARCHITECTURES, "gpt2", "mixtral", "qwen", "LLAMA", "llama ", "", "llama\0x",
                      "bert", "t5", "rwkv6", "\u00e9\u00e9", "x" * 300)
# Chat templates that try the sandbox: syntax errors, unbounded loops and recursion, huge
# outputs, escapes through attributes, and format widths.
TEMPLATES = (
    "{% for message in messages %}",
    "{{ messages[0]['content'] | no_such_filter }}",
    "{% for i in range(10**9) %}x{% endfor %}",
    "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ namespace(x=1).__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ cycler.__init__.__globals__.os.system('true') }}",
    "{{ messages.pop() }}{{ messages.clear() }}",
    "{{ lipsum(10**6) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ 'x' * 10**10 }}",
    "{{ 10**10**10 }}",
    "{% set x = ['a'] %}{% for i in range(60) %}{% set x = x + x %}{% endfor %}{{ x | length }}",
    "{{ (messages * 10**6) | tojson }}",
    "{{ 'x' | center(10**9) }}",
    "{{ 'x' | indent(10**9) }}",
    "{{ range(10**9) | list | length }}",
    "{{ [1] | batch(10**9) | list }}",
    "{{ 'ab' | replace('', 'x' * 10**4) | replace('x', 'y' * 10**4) }}",
    "{{ strftime_now('%Y' * 10**6) }}",
    "{{ raise_exception('refused by the template') }}",
    "{% include 'other.jinja' %}",
    "{% extends 'base.jinja' %}",
    "{% import 'macros.jinja' as m %}",
    "{{ messages | map(attribute='__class__') | list }}",
    "{{ bos_token }}" * 10**5,
    "{{ messages[10**9] }}{{ undefined_name.attribute }}",
    "\0{{ messages }}",
    "",
)


def int_types_for(value: int) -> list[int]:
    return [vtype for vtype, (low, high) in INT_RANGES.items() if low <= value <= high]


def boundary_int(rng: random.Random, current: Any = None) -> Typed:
    """A boundary integer, or one next to the current value, in a type that holds it."""
    candidates = list(BOUNDARY_INTS)
    if isinstance(current, int) and not isinstance(current, bool):
        candidates += [current - 1, current + 1, current * 2, current // 2, current * 1000]
    value = rng.choice(candidates)
    return Typed(rng.choice(int_types_for(value)), value)


def odd_float(rng: random.Random) -> Typed:
    value = rng.choice(ODD_FLOATS)
    vtype = rng.choice((FLOAT32, FLOAT64))
    return Typed(vtype, value if vtype == FLOAT64 or _fits_float32(value) else math.inf)


def _fits_float32(value: float) -> bool:
    try:
        struct.pack("<f", value)
    except OverflowError:
        return False
    return True


def wrong_type(rng: random.Random) -> Value:
    """A value of some type a reader may not expect: strings, bools, arrays, nested arrays,
    and type ids that do not exist."""
    makers = (
        lambda: Typed(STRING, rng.choice(WRONG_STRINGS)),
        lambda: Typed(BOOL, rng.random() < 0.5),
        lambda: Typed(ARRAY, np.array(rng.choice(([], [1], [2, 2], [0] * 1000)), np.int32), INT32),
        lambda: Typed(ARRAY, np.array([1.5, math.nan], np.float32), FLOAT32),
        lambda: Typed(ARRAY, ["a", "b"], STRING),
        lambda: Typed(ARRAY, [Typed(ARRAY, np.array([1, 2], np.uint32), UINT32)], ARRAY),
        lambda: Typed(ARRAY, np.zeros(100_000, np.uint64), UINT64),
        lambda: Raw(rng.choice((13, 99, 2**31, 2**32 - 1)), bytes(8)),
        lambda: Raw(STRING, struct.pack("<Q", rng.choice((2**63, 2**64 - 1, 10**9)))),
        lambda: Raw(ARRAY, struct.pack("<IQ", rng.choice((UINT8, STRING, ARRAY, 77)), 2**62)),
    )
    return rng.choice(makers)()


def plausible_value(rng: random.Random, current: Any = None) -> Typed:
    """A value of the current one's type (an integer or float when there is none) near it or
    small: what a careless converter might write."""
    if isinstance(current, bool):
        return Typed(BOOL, not current)
    if isinstance(current, str):
        return Typed(STRING, rng.choice(PLAUSIBLE_STRINGS))
    if isinstance(current, float) or current is None and rng.random() < 0.5:
        base = current or 1.0
        return Typed(FLOAT32, rng.choice(PLAUSIBLE_FLOATS + (base * 2, base / 2)))
    base = current if isinstance(current, int) else 64
    value = rng.choice(PLAUSIBLE_INTS + (base - 1, base + 1, base * 2, base // 2))
    return Typed(UINT32 if value >= 0 else INT32, value)


def hostile_value(rng: random.Random, current: Any = None) -> Value:
    """A boundary integer, an odd float or a value of a wrong type, near evenly."""
    kind = rng.randrange(3)
    if kind == 0:
        return boundary_int(rng, current)
    return odd_float(rng) if kind == 1 else wrong_type(rng)


def shown(value: Any, limit: int = 80) -> str:
    """A value as a report shows it: its GGUF type and a shortened repr."""
    if isinstance(value, Raw):
        return f"raw type {value.vtype} payload {value.payload[:24].hex()}" + (
            f"... ({len(value.payload)} bytes)" if len(value.payload) > 24 else "")
    if isinstance(value, Typed):
        kind = TYPE_NAMES.get(value.vtype, str(value.vtype))
        if value.vtype == ARRAY:
            kind = f"array of {TYPE_NAMES.get(value.element_type, value.element_type)}"
        return f"{kind} {shown(value.value, limit)}"
    if isinstance(value, np.ndarray):
        value = value.tolist()
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
