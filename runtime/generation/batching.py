"""Continuous batching: the passes of several generations' token loops computed together.

Each generation runs its own token loop (prefill chunks, decode steps, a draft's verify passes) in
its own thread, exactly as it would alone; only its passes are handed here. One pass thread
gathers what the generations ask for and runs it as one `Decoder.forward_batch`: one sweep of the
weights (one read of each streamed layer) serves every sequence, and each row is computed as it
would be alone, so each generation's tokens are those it would get by itself.

A pass runs once every generation in flight has asked for one, or, when some are busy elsewhere
(sampling, a draft model proposing, a consumer that has not asked for its next piece), once the
first request has waited a quarter of the last pass's time: a straggler joins the next pass
rather than holding everyone back. A pass holds at most MAX_PASS_TOKENS tokens (the activations
the budgets hold room for; a prefill chunk may fill it alone); the rest wait for the next.
"""

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import numpy as np

from tierflow.kv_types import MAX_PASS_TOKENS
from tierflow.runtime.decoder.decoder import Decoder, SequenceInput

STRAGGLER_SHARE = 0.25  # of the last pass's time: how long a pass waits for generations not yet asking
MAX_STRAGGLER_WAIT_S = 0.02


class PassBatcher:
    """Runs the passes of the generations in flight, batched, on its own thread (one OpenMP team
    and one kernel thread pool for every pass, however many generations ask)."""

    def __init__(self, decoder: Decoder, claim_threads: Callable[[], None]):
        self.decoder = decoder
        self._claim_threads = claim_threads  # run on the pass thread before its first pass
        self._changed = threading.Condition()
        self._pending: list[tuple[SequenceInput, Future]] = []
        self._in_flight = 0  # generations between joined() and their end
        self._last_pass_s = 0.0
        self._closed = False
        self.passes = 0  # batched passes run, and the sequences they served: what batching achieved
        self.sequences_served = 0
        self._thread = threading.Thread(target=self._run, name="tierflow-passes", daemon=True)
        self._thread.start()

    @contextmanager
    def joined(self) -> Iterator[None]:
        """Counts a generation in flight for the block: passes wait (briefly) for its requests."""
        with self._changed:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    @property
    def waiting(self) -> int:
        """Passes asked for and not yet begun."""
        with self._changed:
            return len(self._pending)

    def run(self, item: SequenceInput) -> np.ndarray:
        """The logits of one sequence's pass (Decoder.forward's), computed in the next batch."""
        done: Future = Future()
        with self._changed:
            if self._closed:
                raise RuntimeError("the pass batcher is closed")
            self._pending.append((item, done))
            self._changed.notify_all()
        return done.result()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()

    def _run(self) -> None:
        self._claim_threads()
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            started = time.perf_counter()
            self._compute(batch)
            self._last_pass_s = time.perf_counter() - started
            self.passes += 1
            self.sequences_served += len(batch)

    def _compute(self, batch: list[tuple[SequenceInput, Future]]) -> None:
        """Runs a batch, each generation given its logits or its pass's failure. A batch that
        fails is run again one sequence at a time, from where each cache was: one generation's
        failure (a bad request, memory it alone needs) fails no other generation's pass."""
        items = [item for item, _ in batch]
        lengths = [item.cache.length for item in items]
        try:
            results = self.decoder.forward_batch(items)
        except Exception as error:
            if len(batch) == 1:
                batch[0][1].set_exception(error)
                return
            for (item, _), length in zip(batch, lengths):
                item.cache.truncate(length)
            for entry in batch:
                self._compute([entry])
            return
        except BaseException as error:  # an interrupt: every generation ends with it
            for _, done in batch:
                done.set_exception(error)
            return
        for (_, done), logits in zip(batch, results):
            done.set_result(logits)

    def _next_batch(self) -> list[tuple[SequenceInput, Future]] | None:
        with self._changed:
            while not self._pending and not self._closed:
                self._changed.wait()
            if self._closed:
                for _, done in self._pending:
                    done.set_exception(RuntimeError("the pass batcher is closed"))
                return None
            deadline = time.perf_counter() + min(STRAGGLER_SHARE * self._last_pass_s, MAX_STRAGGLER_WAIT_S)
            while len(self._pending) < self._in_flight and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._changed.wait(left)
            batch, waiting, tokens = [], [], 0
            for entry in self._pending:
                count = entry[0].token_ids.shape[0]
                if batch and tokens + count > MAX_PASS_TOKENS:
                    waiting.append(entry)
                else:
                    batch.append(entry)
                    tokens += count
            self._pending = waiting
            return batch
