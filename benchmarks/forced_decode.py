"""Decode timed on held-out real text: each step feeds the text's next token, not the model's guess.

A MoEfied model (tests/support/make_moe_from_dense.py) routes real text through real weights, but its
own greedy continuation soon repeats itself (its perplexity on prose is in the hundreds), and a
text that repeats replays its routing, which flatters every expert cache. Feeding the held-out text
itself (teacher forcing) keeps the routing real, and each step is still a single-token pass: a
decode step's cost. Every step's next-token log-probabilities can come back, to measure an
approximation against the exact model (benchmarks/quality.py's KL and top-1).
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp
import numpy as np

from benchmarks.moe import TEXT
from tests.support.oracle import log_softmax
from tierflow import Engine


@dataclass
class ForcedRun:
    tokens_per_s: float  # single-token passes per second
    argmax: list[int]  # each step's most likely next token
    log_probs: np.ndarray | None  # [steps, V] float64, where asked for


def text_windows(engine: Engine, count: int, prompt_tokens: int, decode_tokens: int
                 ) -> list[tuple[list[int], list[int]]]:
    """`count` (prompt, continuation) pairs, consecutive windows of benchmarks/routing_text.txt: text
    the MoEfied models were not fitted on (they calibrate on tests/support/moe_calibration.txt), and
    no run replays the routing of another."""
    ids, size = engine.tokenize(TEXT.read_text()), prompt_tokens + decode_tokens
    if count * size > len(ids):
        raise SystemExit(f"{TEXT.name} has {len(ids)} tokens, not enough for {count} windows of {size}")
    return [(ids[i * size:i * size + prompt_tokens], ids[i * size + prompt_tokens:(i + 1) * size])
            for i in range(count)]


def forced_decode(engine: Engine, prompt: list[int], text: list[int], log_probs: bool = False,
                  after_prefill: Callable[[], None] | None = None, tokens_per_pass: int = 1) -> ForcedRun:
    """Prefills `prompt` (nothing reused from the cache), then feeds `text` a token a step, timed;
    after_prefill is called between the two. With tokens_per_pass T > 1, each step feeds T tokens
    as a draft's chain the model verifies in one pass (verify_tree, then keep_path: every guess
    accepted), a speculative step's cost on real routing; on an exact model each row equals a
    decode step's (the decoder is batch-invariant). tokens_per_s counts the text's tokens."""
    steps = []
    with engine.exclusive(prompt_ids=prompt) as generator:
        generator.prefill(prompt, threading.Event(), reuse_prefix=False)
        if after_prefill is not None:
            after_prefill()
        started = time.perf_counter()
        if tokens_per_pass == 1:
            steps = [generator.decode_step(token) for token in text]
        else:
            for i in range(0, len(text), tokens_per_pass):
                chain, start = text[i:i + tokens_per_pass], generator.cache.length
                steps.extend(generator.verify_tree(chain, list(range(-1, len(chain) - 1))))
                generator.keep_path(start, list(range(len(chain))))
        seconds = time.perf_counter() - started
    logits = np.stack(steps)
    return ForcedRun(len(text) / seconds, logits.argmax(axis=-1).tolist(),
                     log_softmax(logits) if log_probs else None)


def forced_decode_llama_cpp(llama: llama_cpp.Llama, prompt: list[int], text: list[int],
                            tokens_per_pass: int = 1) -> ForcedRun:
    """forced_decode's timing on llama.cpp (its logits are not read back)."""
    llama.reset()
    llama.eval(prompt)
    started = time.perf_counter()
    for i in range(0, len(text), tokens_per_pass):
        llama.eval(text[i:i + tokens_per_pass])
    return ForcedRun(len(text) / (time.perf_counter() - started), [], None)
