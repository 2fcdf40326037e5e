"""The in-process half of a chat template's budget: checks made before a call allocates.

A check after a call is too late for the calls whose result can dwarf their arguments
(`'%999999999s' % 'a'`, `indent(3000)` of many lines, `replace` with a long string), so for
those the size of the result is estimated from the arguments first. Each estimate is an upper
bound on the result's length, except that printed values count one character per character of
their strings, so escapes can make a result a small constant factor longer; the check after the
call then refuses it. Whatever these checks do not foresee, the worker process's hard limits
(template_worker.py) stop.
"""

import re
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import generate_lorem_ipsum
from markupsafe import Markup

from tierflow.errors import TemplateError

# No chat template needs huge integers; Python would spend hours on 9 ** 999999999.
_MAX_INTEGER_BITS = 4096
# A lorem ipsum word is at most 12 letters, then a comma or full stop and a space.
_MAX_LIPSUM_WORD_CHARS = 14
_MAX_LIPSUM_PARAGRAPH_TAGS_CHARS = len("<p></p>\n")
_CONTAINERS = (list, tuple, dict, set, frozenset)
# A '%' conversion after its mapping key: flags, width, precision (either may be '*'), length.
_PERCENT_SPEC = re.compile(r"[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?")
# A str.format spec: [[fill]align][sign][z][#][0][width][grouping][.precision][type]; any
# character, a new line too, can fill.
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[_,]?(?:\.(\d+))?", re.DOTALL)


class Budget:
    """The time and size limits of one render."""

    def __init__(self, time_limit_s: float, max_chars: int) -> None:
        self.time_limit_s = time_limit_s
        self.max_chars = max_chars
        self.deadline = time.monotonic() + time_limit_s

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateError(f"chat template exceeded its time limit of {self.time_limit_s} s")

    def check_length(self, length: int) -> None:
        if length > self.max_chars:
            raise TemplateError(
                f"chat template exceeded its size limit of {self.max_chars} characters"
            )

    def checked(self, value: Any) -> Any:
        """`value`, after checking that it is within the size limit."""
        if isinstance(value, (str, bytes, list, tuple, dict)):
            self.check_length(len(value))
        return value

    def check_estimate(self, estimate: Callable[..., int | None], args: tuple, kwargs: dict) -> None:
        """Refuse a call whose result `estimate` (given the call's arguments) puts over the limit."""
        try:
            length = estimate(*args, **kwargs)
        except TypeError:  # arguments the callee itself will refuse, with its own message
            return
        if length is not None:
            self.check_length(length)


# Set for the duration of one render; the environment's hooks read it.
BUDGET: ContextVar[Budget] = ContextVar("tierflow_template_budget")


def printed_size(value: Any, limit: int, indent: int = 0) -> int:
    """About len(repr(value)) or len(json.dumps(value, indent=indent)), counted without printing.

    Shared references count once per use, as printing repeats them ([x, x] nested 40 times prints
    2**40 copies of x); every element counts at least one character, so the walk stops after about
    `limit` steps.
    """
    size, pending = 0, [(value, 0)]
    while pending and size <= limit:
        item, depth = pending.pop()
        if isinstance(item, _CONTAINERS):
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            # Brackets, then per element a separator and, when indented, a new line and its indent.
            size += 2 + len(children) * (2 + (1 + indent * (depth + 1) if indent else 0))
            if size <= limit:
                pending.extend((child, depth + 1) for child in children)
        else:
            size += _scalar_size(item)
    return size


def _scalar_size(value: Any) -> int:
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, int):
        return value.bit_length() // 3 + 2  # decimal digits and a sign
    return 32  # a float, None, or an object's short repr


def _check_printable(value: Any) -> None:
    if isinstance(value, _CONTAINERS):
        budget = BUDGET.get()
        budget.check_length(printed_size(value, budget.max_chars))


def printable(value: Any) -> Any:
    """`value`, after checking that printing it stays within the size limit (the env's finalize)."""
    _check_printable(value)
    return value


def _printed_value_size(value: Any, *args: Any, **kwargs: Any) -> int | None:
    return printed_size(value, BUDGET.get().max_chars) if isinstance(value, _CONTAINERS) else None


def _tojson_size(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                 separators: tuple[str, str] | None = None, sort_keys: bool = False) -> int | None:
    if not (indent is None or isinstance(indent, int)) or separators is not None:
        return None
    return printed_size(value, BUDGET.get().max_chars, indent=max(indent or 0, 0))


def _replace_size(s: Any, old: Any, new: Any, count: int | None = -1) -> int | None:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return None
    num_replaced = s.count(old)  # len(s) + 1 for an empty `old`, as replace inserts
    if isinstance(count, int) and count >= 0:
        num_replaced = min(num_replaced, count)
    return len(s) + num_replaced * max(len(new) - len(old), 0)


def _expandtabs_size(s: str, tabsize: int = 8) -> int | None:
    return len(s) + s.count("\t") * max(tabsize, 0) if isinstance(tabsize, int) else None


def _indent_size(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> int | None:
    if not isinstance(s, str):
        return None
    pad = len(width) if isinstance(width, str) else width
    return len(s) + (s.count("\n") + 1) * max(pad, 0) if isinstance(pad, int) else None


def _wordwrap_size(s: Any, width: int = 79, break_long_words: bool = True,
                   wrapstring: str | None = None, break_on_hyphens: bool = True) -> int | None:
    if not (isinstance(s, str) and isinstance(width, int)):
        return None
    # Any two consecutive lines hold more than `width` characters of the text (the second began
    # because the first could not take its first word), hence the number of lines.
    num_lines = 2 * len(s) // max(width, 1) + 2 * (s.count("\n") + 1)
    separator = len(wrapstring) if isinstance(wrapstring, str) else 2
    return len(s) + num_lines * separator


def _join_size(items: Any, separator: Any) -> int | None:
    if not (isinstance(items, (list, tuple)) and isinstance(separator, str)):
        return None  # an iterator would be consumed; the check after the call covers it
    limit = BUDGET.get().max_chars
    lengths = (len(item) if isinstance(item, str) else printed_size(item, limit) for item in items)
    return sum(lengths) + len(separator) * max(len(items) - 1, 0)


def _join_filter_size(value: Any, d: str = "", attribute: Any = None) -> int | None:
    return _join_size(value, d) if attribute is None else None


def _percent_size(template: str, values: Any) -> int:
    """An upper bound on len(template % values), from the widths and precisions in `template`."""
    if isinstance(values, dict):
        values = tuple(values.values())
    elif not isinstance(values, tuple):
        values = (values,)
    star = sum(abs(value) for value in values if isinstance(value, int))  # what a '*' may take
    limit = BUDGET.get().max_chars
    size = len(template) + sum(printed_size(value, limit) for value in values)
    for number in _percent_widths(template):
        size += star if number == "*" else int(number or 0)
    return size


def _percent_widths(template: str) -> Iterator[str]:
    """The width and precision (digits, '*' or '') of each '%' conversion, parsed as Python does."""
    start = template.find("%")
    while start != -1:
        position = start + 1
        if template.startswith("(", position):  # a mapping key, which may nest parentheses
            depth = 0
            for position in range(position, len(template)):
                depth += {"(": 1, ")": -1}.get(template[position], 0)
                if depth == 0:
                    break
            position += 1
        spec = _PERCENT_SPEC.match(template, position)
        yield from spec.groups(default="")
        start = template.find("%", spec.end() + 1)  # after the conversion character ('%' too)


def _format_filter_size(value: Any, *args: Any, **kwargs: Any) -> int | None:
    return _percent_size(value, kwargs or args) if isinstance(value, str) else None


# Filters whose result can be far longer than their arguments, by name: the estimate takes the
# filter's own arguments (the filtered value first).
FILTER_SIZES: dict[str, Callable[..., int | None]] = {
    "format": _format_filter_size,
    "indent": _indent_size,
    "join": _join_filter_size,
    "pprint": _printed_value_size,
    "replace": _replace_size,
    "string": _printed_value_size,
    "tojson": _tojson_size,
    "wordwrap": _wordwrap_size,
}
# The same for str methods (the string first); format and format_map go through BudgetedFormatter.
_STR_METHOD_SIZES: dict[str, Callable[..., int | None]] = {
    "expandtabs": _expandtabs_size,
    "join": lambda separator, items: _join_size(items, separator),
    "replace": _replace_size,
}


def check_arguments(args: tuple, kwargs: dict) -> None:
    """Refuse size-like arguments above the limit before the call allocates (`center(10**9)`)."""
    budget = BUDGET.get()
    budget.check_time()
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int):
            budget.check_length(arg)


def check_call(func: Any, args: tuple, kwargs: dict) -> None:
    """The checks before a template calls `func` (a global, a macro, a method)."""
    check_arguments(args, kwargs)
    owner = getattr(func, "__self__", None)
    estimate = _STR_METHOD_SIZES.get(getattr(func, "__name__", "")) if isinstance(owner, str) else None
    if estimate is not None:
        BUDGET.get().check_estimate(estimate, (owner, *args), kwargs)


def check_binop(operator: str, left: Any, right: Any) -> None:
    """The checks before `left <operator> right`: no huge integers, no repetition or '%' too long."""
    budget = BUDGET.get()
    budget.check_time()
    if isinstance(left, int) and isinstance(right, int) and operator in ("*", "**"):
        # a ** b has about bits(a) * b bits, a * b about bits(a) + bits(b).
        num_bits = left.bit_length() * right if operator == "**" else left.bit_length() + right.bit_length()
        if abs(left) > 1 and num_bits > _MAX_INTEGER_BITS:
            result = "power" if operator == "**" else "product"
            raise TemplateError(f"chat template computed a {result} above {_MAX_INTEGER_BITS} bits")
    elif operator == "*":
        count, sequence = (left, right) if isinstance(left, int) else (right, left)
        if isinstance(count, int) and isinstance(sequence, (str, bytes, list, tuple)):
            budget.check_length(len(sequence) * count)
    elif operator == "%" and isinstance(left, str):
        budget.check_length(_percent_size(left, right))


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    """Jinja's lipsum, refused when its `n` paragraphs of up to `max` words could be too long."""
    if isinstance(n, int) and isinstance(max, int):
        per_paragraph = max * _MAX_LIPSUM_WORD_CHARS + _MAX_LIPSUM_PARAGRAPH_TAGS_CHARS
        BUDGET.get().check_length(n * per_paragraph)
    return generate_lorem_ipsum(n, html, min, max)


class _BudgetedFields:
    """Checks each replacement field of a str.format before it is formatted.

    A field's width and precision are known only here, after nested fields (`{:{width}}`) are
    resolved, and the fields formatted so far count towards the limit too.
    """

    num_chars = 0

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        _check_printable(value)
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> str:
        _check_printable(value)
        width, precision = _FORMAT_SPEC.match(format_spec).groups()
        budget = BUDGET.get()
        budget.check_length(self.num_chars + int(width or 0) + int(precision or 0))
        text = super().format_field(value, format_spec)
        self.num_chars += len(text)
        budget.check_length(self.num_chars)
        return text


class _BudgetedFormatter(_BudgetedFields, SandboxedFormatter):
    pass


class _BudgetedEscapeFormatter(_BudgetedFields, SandboxedEscapeFormatter):
    pass


def budgeted_str_format(env: Any, method: Any) -> Callable[..., str]:
    """`method` (a string's bound format or format_map) run by a budgeted sandbox formatter."""
    text = method.__self__

    def vformat(args: tuple, kwargs: Any) -> str:
        if isinstance(text, Markup):
            formatter = _BudgetedEscapeFormatter(env, escape=text.escape)
        else:
            formatter = _BudgetedFormatter(env)
        return type(text)(formatter.vformat(text, args, kwargs))

    if method.__name__ == "format_map":
        return lambda mapping: vformat((), mapping)
    return lambda *args, **kwargs: vformat(args, kwargs)
