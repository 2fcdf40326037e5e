"""Streamed experts: a MoE model's experts read from its pack into an ExpertCache in RAM.

When a MoE model's experts do not all fit the cpu_memory budget, everything else stays resident
(the globals, and every layer's attention, router and shared expert: a small part of the model)
and the experts live on disk, each one extent of the pack. One ExpertCache (cache.py), with
the room the budget leaves, holds those the policy keeps (StreamedExperts). A layer step:

1. predicts the next MoE layer's experts by applying its router, early, to this layer's residual
   stream (expert_prediction.route_top_k), adds those that cross-layer affinity, learnt as the
   model runs (ExFlow), makes likely, and records the prediction;
2. gets its own experts from the cache: hits at once, misses as reads queued on a reader thread;
3. starts reading the predicted experts of the next layer that are not resident (prefetch), behind
   this layer's misses, so that disk reads overlap this layer's compute;
4. hands the experts to the decoder hits first, so the misses have the longest to arrive.

A prefetched expert that the next layer does not use is dropped at once (its read cancelled if it
has not started). Reads use O_DIRECT (offload/io/disk.py), so the page cache never holds experts and
the budget is what RAM holds; an expert's CRC-32 is checked when it is first read, and again
whenever the pack has been written since (PackedFile.check). Each read fills a buffer from a
BufferPool of the cache's budget, which a dropped expert gives back for the next read (mapping
fresh memory for every read cost more than the reads themselves).
"""

import mmap
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tierflow.offload.experts.expert_cache import ExpertCache
from tierflow.offload.experts.policy import ExpertKey
from tierflow.offload.experts.tier import ExpertTier
from tierflow.offload.io.buffer_pool import BufferPool
from tierflow.offload.io.disk import DiskFile
from tierflow.offload.pack.reader import PackedFile
from tierflow.runtime.compute.interfaces import Weights
from tierflow.runtime.models.config import ModelConfig

READERS = 2  # reads in flight: two kept this machine's disk busier than one (1.2 vs 1.0 GB/s)


class ExpertRead:
    """An expert's read in flight or done (its future gives the weights, the buffer they view and
    the expert's bytes in it); nbytes is what the cache counts. A read that failed leaves the
    cache as its error is raised, so that the next use reads again."""

    def __init__(self, future: Future, nbytes: int, failed: Callable[[], None]):
        self.future, self.nbytes, self._failed = future, nbytes, failed

    def weights(self) -> Weights:
        return self._result()[0]

    def data(self) -> memoryview:
        return self._result()[2]

    def failed(self) -> bool:
        """Whether the read ended in an error."""
        return self.future.done() and not self.future.cancelled() and self.future.exception() is not None

    def _result(self) -> tuple[Weights, mmap.mmap, memoryview]:
        try:
            return self.future.result()
        except BaseException:
            self._failed()
            raise


class StreamedExperts:
    """The experts of a pack read from disk into one cache of `budget_bytes` in RAM: what ExpertStore
    computes with, and what HybridExperts copies to the GPU from when their home is disk. The
    cache's payloads are reads (`ExpertRead`), which the caller waits on."""

    def __init__(self, packed: PackedFile, disk: DiskFile, budget_bytes: int, policy: str = "score"):
        self.packed, self.disk = packed, disk
        self._reader = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="tierflow-experts")
        self.buffers = BufferPool(budget_bytes)
        self.cache = ExpertCache(budget_bytes, lambda key: packed.experts[key[0]][key[1]].nbytes,
                                 self._fetch, policy, discard=self._discard)

    @property
    def nbytes(self) -> int:
        return self.cache.budget_bytes

    def close(self) -> None:
        self.buffers.close()  # a read waiting for a buffer ends instead of holding the shutdown
        self._reader.shutdown(wait=True, cancel_futures=True)

    def _fetch(self, key: ExpertKey) -> ExpertRead:
        extent = self.packed.experts[key[0]][key[1]]
        # a read that failed takes every failed read out of the cache with it (a bad disk fails many)
        return ExpertRead(self._reader.submit(self._read, key), extent.nbytes,
                          lambda: self.cache.forget(ExpertRead.failed))

    def _read(self, key: ExpertKey) -> tuple[Weights, mmap.mmap, memoryview]:
        layer_idx, expert_id = key
        extent = self.packed.experts[layer_idx][expert_id]
        buffer = self.buffers.take(extent.nbytes)
        try:
            changed = self.disk.changed()  # before the read: a change after it is seen at the next
            data = self.disk.read_into(buffer, extent.offset, extent.nbytes)
            self.packed.check(extent, data, self.disk.fd, changed)
            return self.packed.expert_weights(layer_idx, expert_id, data), buffer, data
        except BaseException:
            self.buffers.give(buffer)
            raise

    def _discard(self, key: ExpertKey, read: ExpertRead) -> bool:
        """A read not started yet never happens (True: nothing was read); a done or running one
        gives its buffer back once done (the cache keeps no view of a dropped expert)."""
        if read.future.cancel():
            return True
        read.future.add_done_callback(self._give_back)
        return False

    def _give_back(self, read: Future) -> None:
        if not read.cancelled() and read.exception() is None:
            self.buffers.give(read.result()[1])


class ExpertStore(ExpertTier):
    """The experts of the MoE layers `layers` (default: all) streamed through StreamedExperts and
    computed on the CPU."""

    def __init__(self, streamed: StreamedExperts, config: ModelConfig, layers: Sequence[int] | None = None):
        self.streamed, self.buffers = streamed, streamed.buffers
        super().__init__(config, streamed.cache, layers)

    @property
    def nbytes(self) -> int:
        return self.streamed.nbytes

    def close(self) -> None:
        self.streamed.close()

    def _route(self, layer_idx: int, expert_tokens: dict[int, int]
               ) -> tuple[list[int], Iterator[tuple[int, Weights]]]:
        """Every expert through the cache, those at hand first: the misses have longest to arrive."""
        hits = [e for e in expert_tokens if (layer_idx, e) in self.cache]
        return hits + [e for e in expert_tokens if (layer_idx, e) not in self.cache], iter(())

    def _weights(self, read: ExpertRead) -> Weights:
        return read.weights()

    def _on_disk(self, layer_idx: int, expert_id: int) -> bool:
        return (layer_idx, expert_id) not in self.cache

    def _arrived(self, read: ExpertRead) -> bool:
        return read.future.done()
