"""tierflow: run language models larger than your GPU, across SSD, RAM and one GPU.

    from tierflow import Engine
    engine = Engine.load()              # the bundled SmolLM2-135M-Instruct
    print(engine.generate("Hello", max_tokens=20).text)

Heavy modules (torch, llama.cpp) load with the first model, so `tierflow --help` and an app's
`from tierflow import Engine` stay fast (tests/test_import_cost.py).
"""

from tierflow.errors import (
    BudgetError,
    ContextLengthError,
    InvalidArgumentError,
    ModelFileError,
    TemplateError,
    TierflowError,
    UnsupportedModelError,
)
from tierflow.progress import LoadPhase
from tierflow.units import parse_size

__all__ = [
    "Engine",
    "GenerationResult",
    "Grammar",
    "LoadPhase",
    "BudgetError",
    "ContextLengthError",
    "InvalidArgumentError",
    "ModelFileError",
    "TemplateError",
    "TierflowError",
    "UnsupportedModelError",
    "parse_size",
]


def __getattr__(name: str):
    if name in ("Engine", "GenerationResult"):
        from tierflow.runtime.api import engine

        return getattr(engine, name)
    if name == "Grammar":
        from tierflow.runtime.sampling.structured import Grammar

        return Grammar
    raise AttributeError(f"module 'tierflow' has no attribute {name!r}")
