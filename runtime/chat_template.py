"""Render a model's chat template: untrusted Jinja code from the model file, run in a sandbox.

The template sees what Hugging Face templates expect (`messages`, `bos_token`, `eos_token`,
`add_generation_prompt`, `tools`, `raise_exception`, `strftime_now`, a `tojson` filter with HF's
semantics, `{% break %}`/`{% continue %}` and `{% generation %}`).

Jinja's sandbox stops attribute escapes (`''.__class__.__mro__`) but not runaway work, so each
render also carries a budget of time and size, checked where work can pile up:
- between output chunks (the total output),
- on every iteration of every `{% for %}` (the parse tree is rewritten so each loop's iterable
  passes through a guard), which catches nested loops that print nothing,
- after every call, filter, `~` concatenation, `{% set %}` block and `+`/`%`, and before `*` and
  `**` (and any call or filter given an integer above the size limit, such as `center(10**9)`),
  so no string can grow past the size limit step by step.
What stays open: one C-level operation on values inside the limit can still allocate more
(`replace` can square a string's length once; a width inside a `%` or `format` string is not
inspected), and containers are measured by their length only, so a template that nests shared
references ([x, x], then [that, that], ...) can build a value whose printing explodes. Full
isolation would need a subprocess.
"""

import functools
import json
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from jinja2 import TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tierflow.errors import TemplateError

# Plain ChatML, for models whose file carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_LOOP_GUARD = "tierflow_loop_guard"
_SIZE_GUARD = "tierflow_size_guard"
# No chat template needs huge integers; Python would spend hours on 9 ** 999999999.
_MAX_POWER_BITS = 4096


class _Budget:
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


# Set for the duration of one render; the environment's hooks read it.
_BUDGET: ContextVar[_Budget] = ContextVar("tierflow_template_budget")


def _guard_loop(iterable: Iterable) -> Iterator:
    # Not a generator function itself: reading the budget eagerly makes jinja's constant folder
    # give up (no budget at compile time) instead of folding the loop into a generator object.
    budget = _BUDGET.get()

    def guarded() -> Iterator:
        for item in iterable:
            budget.check_time()
            yield item

    return guarded()


def _guard_size(value: Any) -> Any:
    return _BUDGET.get().checked(value)


def _check_arguments(args: tuple, kwargs: dict) -> None:
    """Refuse size-like arguments above the limit before the call allocates (`center(10**9)`)."""
    budget = _BUDGET.get()
    budget.check_time()
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int):
            budget.check_length(arg)


def _budgeted_filter(func: Any) -> Any:
    # The filtered value comes first, after the context when jinja passes one (pass_context
    # and friends); functools.wraps copies __dict__, which keeps that mark on the wrapper.
    num_leading = 2 if getattr(func, "jinja_pass_arg", None) else 1

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args[num_leading:], kwargs)
        return _BUDGET.get().checked(func(*args, **kwargs))

    return wrapper


def _check_binop_operands(operator: str, left: Any, right: Any) -> None:
    budget = _BUDGET.get()
    budget.check_time()
    if operator == "**" and isinstance(left, int) and isinstance(right, int):
        if abs(left) > 1 and right > 0 and left.bit_length() * right > _MAX_POWER_BITS:
            raise TemplateError(f"chat template computed a power above {_MAX_POWER_BITS} bits")
    elif operator == "*":
        count, sequence = (left, right) if isinstance(left, int) else (right, left)
        if isinstance(count, int) and isinstance(sequence, (str, bytes, list, tuple)):
            budget.check_length(len(sequence) * count)


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        return _guard_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop_operands(operator, left, right)
        return _guard_size(super().call_binop(context, operator, left, right))


class _GenerationTag(Extension):
    """HF's `{% generation %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson, not jinja's: no HTML escaping, non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template raised an error: {_one_line(str(message))}")


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _make_environment() -> _BudgetedEnvironment:
    env = _BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True,
                               extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(func) for name, func in env.filters.items()}
    # Added after wrapping: the guards are the budget checks themselves.
    env.filters[_LOOP_GUARD] = _guard_loop
    env.filters[_SIZE_GUARD] = _guard_size
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


_ENV = _make_environment()


def _guard(node: nodes.Expr | None, filter_name: str, lineno: int) -> nodes.Filter:
    # Filters, unlike globals, cannot be shadowed by a template's own {% set %} or macro.
    return nodes.Filter(node, filter_name, [], [], None, None, lineno=lineno)


def _size_guarded(node: Any) -> Any:
    return _guard(node, _SIZE_GUARD, node.lineno) if isinstance(node, nodes.Concat) else node


def _add_guards(tree: nodes.Template) -> None:
    """Rewrites the parse tree so loops check the clock and built strings check their size."""
    for loop in tree.find_all(nodes.For):
        loop.iter = _guard(loop.iter, _LOOP_GUARD, loop.lineno)
    # `{% set x %}...{% endset %}` joins its output unseen; a guard filter with no operand
    # applies to the captured text. (An explicit filter is already budgeted.)
    for block in tree.find_all(nodes.AssignBlock):
        if block.filter is None:
            block.filter = _guard(None, _SIZE_GUARD, block.lineno)
    # `a ~ b` compiles to a plain join; wrap each Concat where its parent holds it.
    for parent in list(tree.find_all(nodes.Node)):
        for field, child in parent.iter_fields():
            if isinstance(child, list):
                setattr(parent, field, [_size_guarded(item) for item in child])
            else:
                setattr(parent, field, _size_guarded(child))


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    tree = _ENV.parse(template)
    _add_guards(tree)
    return _ENV.from_string(tree)


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise TemplateError(f"messages must be a list of dicts, not {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise TemplateError(f"messages[{i}] must be a dict with string 'role' and 'content'")


def render_chat_template(template: str, messages: list[dict], *, bos_token: str = "",
                         eos_token: str = "", add_generation_prompt: bool = True,
                         time_limit_s: float = 1.0, max_output_chars: int = 1_000_000,
                         **extra: Any) -> str:
    """Render `messages` through `template` in the sandbox; every failure is a TemplateError.

    `extra` becomes template variables too (e.g. `tools`, `enable_thinking`).
    """
    _validate_messages(messages)
    variables = {"tools": None, **extra, "messages": messages, "bos_token": bos_token,
                 "eos_token": eos_token, "add_generation_prompt": add_generation_prompt}
    budget = _Budget(time_limit_s, max_output_chars)
    token = _BUDGET.set(budget)
    try:
        chunks, num_chars = [], 0
        for chunk in _compile(template).generate(variables):
            num_chars += len(chunk)
            budget.check_length(num_chars)
            budget.check_time()
            chunks.append(chunk)
        return "".join(chunks)
    except TemplateError:
        raise
    except TemplateSyntaxError as exc:
        raise TemplateError(
            f"chat template syntax error on line {exc.lineno}: {_one_line(exc.message or '')}"
        ) from exc
    except Exception as exc:  # the template is untrusted code: any failure is its failure
        raise TemplateError(
            f"chat template failed: {type(exc).__name__}: {_one_line(str(exc))}"
        ) from exc
    finally:
        _BUDGET.reset(token)
