"""Work started at once from its own threads, as parallel clients start their requests."""

import threading
from collections.abc import Callable
from typing import TypeVar

from tierflow import Engine

T = TypeVar("T")


def run_together(work: Callable[[int], T], count: int) -> list[T]:
    """[work(0), ..., work(count - 1)], each called in its own thread, all released at once."""
    results: list = [None] * count
    start = threading.Barrier(count)

    def run(i: int) -> None:
        start.wait()
        results[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def generate_together(engine: Engine, prompts: list[str], **kwargs) -> list[list[int]]:
    """Each prompt's generated tokens (engine.generate with kwargs), all started together."""
    return run_together(lambda i: engine.generate(prompts[i], **kwargs).tokens, len(prompts))
