"""The exception types tierflow raises. Every user-facing failure is one of these.

Each also derives from the closest built-in (ValueError, FileNotFoundError, ...) so callers that
already catch those keep working.
"""


class TierflowError(Exception):
    """Base class of every error tierflow raises on purpose."""


class ModelFileError(TierflowError, ValueError):
    """The model file is missing, unreadable, not GGUF, or malformed."""


class UnsupportedModelError(TierflowError, ValueError):
    """The file is valid GGUF but uses an architecture or tensor type tierflow cannot run."""


class BudgetError(TierflowError, ValueError):
    """A memory size cannot be parsed, or the model does not fit the budgets given."""


class PlanBudgetError(BudgetError):
    """A budget cannot work; `minimum_bytes` is the smallest that would (rounded up as printed)."""

    def __init__(self, message: str, minimum_bytes: int):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


class ContextLengthError(TierflowError, ValueError):
    """The prompt (plus what must be generated) does not fit in the model's context."""


class TemplateError(TierflowError, ValueError):
    """The chat template is missing, failed to render, or broke its time or size limit."""


class InvalidArgumentError(TierflowError, ValueError):
    """An argument is out of range: a sampling setting, a thread count, a token id."""
