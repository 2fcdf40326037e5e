"""The context a load gets: the one asked for if the model and the budgets hold it, else by
default the model's trained context when the budgets hold its KV cache and activations beside the
least the weights need (they may stream), else the largest multiple of CONTEXT_STEP that fits.

Larger contexts take more (the KV cache and the attention scores of a prefill chunk grow with it),
so whether a context fits is monotone, and the largest that fits is found by bisection over plans.
"""

from collections.abc import Callable

from tierflow.errors import ContextLengthError, InvalidArgumentError, PlanBudgetError
from tierflow.offload.plan.plan_result import Plan
from tierflow.runtime.models.config import ModelConfig

CONTEXT_STEP = 256  # a context shortened to fit is a multiple of this


def check_context(requested: int | None, config: ModelConfig, allow_extension: bool) -> None:
    """Refuses a context that is not a positive count, or one past the model's trained context
    unless allow_extension (positions it never saw: its output degrades, so only on request)."""
    if requested is None:
        return
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise InvalidArgumentError(f"context_length must be a positive integer, got {requested!r}")
    if requested > config.context_length and not allow_extension:
        raise ContextLengthError(f"context_length {requested} exceeds the {config.context_length} positions "
                                 f"{config.name or 'the model'} was trained on; to run past them, ask "
                                 f"explicitly (allow_context_extension=True, --allow-context-extension)")


def plan_context(plan_at: Callable[[int], Plan], requested: int | None, trained: int
                 ) -> tuple[Plan, str | None]:
    """The plan at the requested context, or by default at the trained context or else the largest
    that fits, with a notice saying so. A context the budgets cannot hold is refused naming the
    largest that they can; if none can, the refusal is the smallest context's (the weights do not
    fit)."""
    target = trained if requested is None else requested
    try:
        return plan_at(target), None
    except PlanBudgetError as error:
        largest = largest_fitting(plan_at, target - 1)
        if largest is None:
            if target > CONTEXT_STEP:
                plan_at(CONTEXT_STEP)  # raises: the need named is the smallest context's, not this one's
            raise
        if requested is not None:
            raise PlanBudgetError(f"{error}; or a context of at most {largest} positions fits "
                                  f"(context_length {requested} does not)", error.minimum_bytes) from None
        notice = (f"context: {largest} positions, not the model's {trained}: the budgets cannot hold a "
                  f"longer one's KV cache and activations (a smaller --kv-type, or more memory, holds more)")
        return plan_at(largest), notice


def largest_fitting(plan_at: Callable[[int], Plan], upper: int) -> int | None:
    """The largest multiple of CONTEXT_STEP up to `upper` whose plan fits; None if none does."""
    def fits(steps: int) -> bool:
        try:
            plan_at(steps * CONTEXT_STEP)
            return True
        except PlanBudgetError:
            return False

    low, high = 0, upper // CONTEXT_STEP  # steps: low fits (0: none yet), every one above high fails
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low * CONTEXT_STEP or None
