"""Generations started at once from their own threads, as parallel clients start them."""

import threading

from tierflow import Engine


def generate_together(engine: Engine, prompts: list[str], **kwargs) -> list[list[int]]:
    """Each prompt's generated tokens (engine.generate with kwargs), all started together."""
    tokens = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def generate(i: int) -> None:
        start.wait()
        tokens[i] = engine.generate(prompts[i], **kwargs).tokens

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tokens
