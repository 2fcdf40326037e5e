"""What a fuzz case does in its child process: build its file, then use it as a user would.

The file is loaded (`Engine.load`), and when that works, generates two tokens and answers one chat
turn; `describe_model` (what `tierflow info` shows) reads it too. Each step may end in a
TierflowError, which is the right answer to a bad file and is recorded; any other exception
propagates, and the harness reports it as the case's failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from tests.fuzz.cases import random_case
from tests.fuzz.corpus import NAMED_CASES
from tests.fuzz.seeds import load_seeds
from tierflow import Engine, TierflowError
from tierflow.offload.plan.profile import cache_dir
from tierflow.runtime.api.model_info import describe_model

MESSAGE_CHARS = 300
CHAT = [{"role": "user", "content": "Hi"}]


class UnnamedProblem(Exception):
    """A TierflowError whose message is empty: the file is refused without saying why."""


def _refusal(error: TierflowError) -> str:
    if not str(error).strip():
        raise UnnamedProblem(f"{type(error).__name__} raised without a message") from error
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + "..."


def _attempt(step: Callable[[], object]) -> str:
    try:
        step()
    except TierflowError as error:
        return _refusal(error)
    return "ok"


def exercise(path: Path) -> dict[str, str]:
    """Each step's outcome: "ok", or the TierflowError it raised."""
    outcomes = {}
    try:
        engine = Engine.load(path, threads=1, context_length=64)
    except TierflowError as error:
        outcomes["load"] = _refusal(error)
    else:
        with engine:
            outcomes["load"] = "ok"
            outcomes["generate"] = _attempt(lambda: engine.generate("Hi", max_tokens=2, temperature=0))
            outcomes["chat"] = _attempt(lambda: engine.chat(CHAT, max_tokens=2))
    outcomes["info"] = _attempt(lambda: describe_model(path))
    return outcomes


def _use_private_cache() -> None:
    """Packs go to a cache folder in the case's own folder, removed with it; the session's hardware
    profiles come along, so that no case measures the machine."""
    private = Path("cache").resolve()
    private.mkdir()
    for profile in cache_dir().glob("profile-*.json"):
        shutil.copy(profile, private)
    os.environ["TIERFLOW_CACHE"] = str(private)


def run_case(note: Callable[[str], None], seeds_folder: str, case: int | str) -> dict[str, str]:
    """The harness's call for a case: a number (random_case) or a name of corpus.NAMED_CASES."""
    seeds = load_seeds(seeds_folder)
    chosen = random_case(case, seeds) if isinstance(case, int) else NAMED_CASES[case]
    note(str(chosen))
    path = Path("model.gguf").resolve()
    path.write_bytes(chosen.build(seeds))
    _use_private_cache()
    return exercise(path)
