"""Render a model's chat template: untrusted Jinja code from the model file, run in a sandbox.

The template sees what Hugging Face templates expect (`messages`, `bos_token`, `eos_token`,
`add_generation_prompt`, `tools`, `raise_exception`, `strftime_now`, a `tojson` filter with HF's
semantics, `{% break %}`/`{% continue %}` and `{% generation %}`).

Jinja's sandbox stops attribute escapes (`''.__class__.__mro__`) but not runaway work, so each
render carries a budget of time (`time_limit_s`) and size (`max_output_chars`), held in two layers.

Checks in the rendering process fail fast, with a message naming the limit:
- between output chunks (the total output), and on every iteration of every `{% for %}` (the
  parse tree is rewritten so each loop's iterable passes through a guard);
- after every call, filter, `~` concatenation, `{% set %}` block and `+`/`*`/`%`;
- before a call allocates (template_guards.py): integer arguments above the size limit
  (`center(10**9)`); the length that string-building calls would return, estimated from their
  arguments (`%` and the `format` filter, each str.format field's width and precision, `indent`,
  `replace`, `wordwrap`, `join`, `expandtabs`, `lipsum`, `*` repetition); the printed length of a
  container that is output, joined with `~`, formatted or passed to `tojson`/`string`, counting
  shared references as often as printing repeats them; integers above 4096 bits from `*` or `**`.
  (Jinja's sandbox itself caps `range` at 100,000 items.)

A worker process (template_worker.py) holds hard limits on what those checks cannot see coming:
one C call that runs long (`sum` over many lists, a sort of long equal strings), many values
that each fit the size limit, the captured output of a macro or `{% filter %}` block joined
unseen. The parent kills a worker whose answer is later than twice the time limit plus 0.25 s,
and a render cannot map more than 64 MiB plus 16 bytes per `max_output_chars` beyond what its
worker holds (a worker that kept more than that after a render is replaced).

What stays open is what those bounds allow: a render may take up to twice its time limit plus a
quarter second and map up to about twice its memory allowance before it fails. A worker round
trip adds 0.1-0.3 ms to a render, and the first render in a process starts a worker (a fraction
of a second) unless start_render_workers() started them. Rendering needs Linux (RLIMIT_AS, /proc).
"""

import functools
import json
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

from jinja2 import TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tierflow.errors import TemplateError
from tierflow.runtime.text.template_guards import (
    BUDGET,
    FILTER_SIZES,
    Budget,
    budgeted_str_format,
    check_arguments,
    check_binop,
    check_call,
    lipsum,
    printable,
)
from tierflow.runtime.text.template_worker import POOL

# Plain ChatML, for models whose file carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_LOOP_GUARD = "tierflow_loop_guard"
_SIZE_GUARD = "tierflow_size_guard"
_PRINT_GUARD = "tierflow_print_guard"
# What a render may allocate beyond what its worker holds: room for the output and the copies
# made on the way (4 bytes a character at worst, a few times over), plus the interpreter's slack.
_MEMORY_BYTES_PER_OUTPUT_CHAR = 16
_MEMORY_BASE_BYTES = 64 << 20


def _guard_loop(iterable: Iterable) -> Iterator:
    # Not a generator function itself: reading the budget eagerly makes jinja's constant folder
    # give up (no budget at compile time) instead of folding the loop into a generator object.
    budget = BUDGET.get()

    def guarded() -> Iterator:
        for item in iterable:
            budget.check_time()
            yield item

    return guarded()


def _guard_size(value: Any) -> Any:
    return BUDGET.get().checked(value)


def _budgeted_filter(func: Any, estimate: Callable[..., int | None] | None) -> Any:
    # The filtered value comes first, after the context when jinja passes one (pass_context
    # and friends); functools.wraps copies __dict__, which keeps that mark on the wrapper.
    num_leading = 2 if getattr(func, "jinja_pass_arg", None) else 1

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_arguments(args[num_leading:], kwargs)
        if estimate is not None:
            BUDGET.get().check_estimate(estimate, args[num_leading - 1:], kwargs)
        return BUDGET.get().checked(func(*args, **kwargs))

    return wrapper


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        check_call(__obj, args, kwargs)
        return _guard_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return _guard_size(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Any:
        # The sandbox's own wrapper (None when `value` is no str.format or format_map) says which.
        if super().wrap_str_format(value) is None:
            return None
        return functools.update_wrapper(budgeted_str_format(self, value), value)


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
    env = _BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, finalize=printable,
                               extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(func, FILTER_SIZES.get(name))
                   for name, func in env.filters.items()}
    # Added after wrapping: the guards are the budget checks themselves.
    env.filters[_LOOP_GUARD] = _guard_loop
    env.filters[_SIZE_GUARD] = _guard_size
    env.filters[_PRINT_GUARD] = printable
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, lipsum=lipsum)
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
    # `a ~ b` prints each operand, then joins them: a list of shared references can print
    # enormous, so each operand is checked first, then each Concat where its parent holds it.
    for concat in list(tree.find_all(nodes.Concat)):
        concat.nodes = [_guard(operand, _PRINT_GUARD, concat.lineno) for operand in concat.nodes]
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


def validate_messages(messages: Any) -> None:
    """A TemplateError unless messages is a list of dicts with string role and content."""
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

    `extra` becomes template variables too (e.g. `tools`, `enable_thinking`); like `messages`, it
    must be plain data (it is pickled to the worker process).
    """
    validate_messages(messages)
    variables = {"tools": None, **extra, "messages": messages, "bos_token": bos_token,
                 "eos_token": eos_token, "add_generation_prompt": add_generation_prompt}
    memory_bytes = _MEMORY_BASE_BYTES + _MEMORY_BYTES_PER_OUTPUT_CHAR * max_output_chars
    return POOL.render(template, variables, time_limit_s=time_limit_s, max_chars=max_output_chars,
                       memory_bytes=memory_bytes)


def check_template_syntax(template: str, origin: str) -> None:
    """Parses a template the user gave (nothing runs): invalid Jinja is a TemplateError naming
    `origin` and the line."""
    try:
        _ENV.parse(template)
    except TemplateSyntaxError as exc:
        raise TemplateError(f"{origin}: chat template syntax error on line {exc.lineno}: "
                            f"{_one_line(exc.message or '')}") from None
    except RecursionError:
        raise TemplateError(f"{origin}: the chat template nests too deeply to parse") from None


def _where(error: BaseException) -> str:
    """" (line N)": the template's line the error came from (jinja's traceback gives the template's
    frames the file name "<template>"), or "" when none did."""
    lines = []
    traceback = error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<template>":
            lines.append(traceback.tb_lineno)
        traceback = traceback.tb_next
    return f" (line {lines[-1]})" if lines else ""


def start_render_workers() -> None:
    """Starts the worker processes that renders take, ahead of the first renders (each start is a
    fraction of a second of CPU): for a server, before it answers requests."""
    POOL.start_idle_workers()


def render_in_process(template: str, variables: dict, time_limit_s: float, max_chars: int) -> str:
    """Render with the in-process budget only: what a worker runs (render_chat_template is the API).

    MemoryError passes through, for the worker to report against its memory limit.
    """
    budget = Budget(time_limit_s, max_chars)
    token = BUDGET.set(budget)
    try:
        chunks, num_chars = [], 0
        for chunk in _compile(template).generate(variables):
            num_chars += len(chunk)
            budget.check_length(num_chars)
            budget.check_time()
            chunks.append(chunk)
        return "".join(chunks)
    except MemoryError:
        raise
    except TemplateError as exc:
        raise TemplateError(f"{exc}{_where(exc)}") from exc
    except TemplateSyntaxError as exc:
        raise TemplateError(
            f"chat template syntax error on line {exc.lineno}: {_one_line(exc.message or '')}"
        ) from exc
    except Exception as exc:  # the template is untrusted code: any failure is its failure
        raise TemplateError(
            f"chat template failed: {type(exc).__name__}: {_one_line(str(exc))}{_where(exc)}"
        ) from exc
    finally:
        BUDGET.reset(token)
