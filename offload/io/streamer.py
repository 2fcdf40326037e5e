"""The layer streamer: reads the streamed layers into a ring of RAM buffers ahead of their use.

The decoder asks for layers in order, every step, so the streamer knows what comes next: while
layer n computes, layers n+1 .. n+depth are being read, one after the other (sequential reads are
what disks are fastest at), each into its own slot of a ring of depth + 1 page-aligned buffers.
Two reader threads keep two reads in flight: a disk serves a queue of two requests faster than
one at a time, which matters for small layers (2 MB layers read at about half the disk's speed
one at a time, and at full speed two at a time, on the machine this was written on).
When the decoder moves on (to any layer, resident ones included, or past the last layer to the
output head: TieredWeights calls release()), layer n's slot takes the read of layer n+depth+1.
The last streamed layers of one step are followed by the first ones of the next, so reading
continues across tokens. Reads use os.preadv, which releases the GIL.

Plain threads rather than aiofiles: aiofiles runs each blocking read on a thread pool anyway, and
an asyncio loop in between would add a hop per read and a loop to keep alive, for nothing. Two
threads and a queue are the whole scheduler.

Every read is checked against its extent's CRC-32 (on the reader threads, which release the GIL
for it: it runs faster than the disk), so a pack changed in place while it streams is an error,
never wrong output. A read that fails (an I/O error, a truncated file, a damaged extent) ends the
generation that needed it with that error; the ring is then emptied and restarts cleanly on the
next request.
"""

import queue
import threading
import time
from dataclasses import dataclass, field

from tierflow.offload.io.disk import DiskFile, aligned_buffer
from tierflow.offload.pack.reader import PackedFile
from tierflow.runtime.compute.interfaces import Weights


@dataclass
class _Read:
    layer: int
    slot: int
    done: threading.Event = field(default_factory=threading.Event)
    weights: Weights | None = None
    error: BaseException | None = None


READERS = 2


class LayerStreamer:
    def __init__(self, disk: DiskFile, packed: PackedFile, layers: list[int], depth: int):
        self.disk, self.packed, self.order = disk, packed, layers
        self.slots = [aligned_buffer(packed.largest_layer_bytes) for _ in range(min(depth + 1, len(layers)))]
        self.slot_bytes = len(self.slots[0]) if self.slots else 0
        self._position = {layer: k for k, layer in enumerate(layers)}
        self._reads: dict[int, _Read] = {}  # by sequence number
        self._scheduled = self._consumed = 0  # sequence numbers: read n is of layer order[n % S]
        self._released = True  # whether the layer last returned is done with (its slot free)
        self._queue: queue.Queue[_Read | None] = queue.Queue()
        # Seconds during which some read was in progress, seconds the compute thread waited for
        # one, and bytes read: what the streaming benchmark reports.
        self.wait_seconds = 0.0
        self.bytes_read = 0
        self._read_seconds = 0.0
        self._stats_lock = threading.Lock()
        self._active_reads, self._busy_since = 0, 0.0
        self._threads = [threading.Thread(target=self._run, name="tierflow-streamer", daemon=True)
                         for _ in range(READERS)]
        for thread in self._threads:
            thread.start()

    @property
    def read_seconds(self) -> float:
        """Seconds during which at least one read was in progress, up to now."""
        with self._stats_lock:
            busy = time.perf_counter() - self._busy_since if self._active_reads else 0.0
            return self._read_seconds + busy

    @property
    def read_ahead(self) -> int:
        """Layers read, or being read, ahead of the one the decoder holds (at most the ring's slots)."""
        return self._scheduled - self._consumed

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self.slots)

    def get(self, layer: int) -> Weights:
        """The weights of `layer`, valid until the next get() or release()."""
        expected = self.order[self._consumed % len(self.order)]
        if layer != expected:  # a step ended early (an error, a cancel): restart at this layer
            self._restart(self._position[layer])
        self.release()
        read = self._reads.pop(self._consumed)
        if not read.done.is_set():
            started = time.perf_counter()
            read.done.wait()
            self.wait_seconds += time.perf_counter() - started
        if read.error is not None:
            self._restart(self._position[layer])
            raise read.error
        self._consumed += 1
        self._released = False
        return read.weights

    def release(self) -> None:
        """The layer last returned is done with (the decoder moved on): its slot takes a read."""
        self._released = True
        while self._scheduled < self._consumed + len(self.slots):
            n = self._scheduled
            read = _Read(self.order[n % len(self.order)], n % len(self.slots))
            self._reads[n] = read
            self._queue.put(read)
            self._scheduled += 1

    def close(self) -> None:
        for thread in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._reads.clear()

    def _count_read(self, change: int) -> None:
        with self._stats_lock:
            now = time.perf_counter()
            if self._active_reads == 0:
                self._busy_since = now
            self._active_reads += change
            if self._active_reads == 0:
                self._read_seconds += now - self._busy_since

    def _restart(self, position: int) -> None:
        """Waits out the reads in flight, then continues the order from `position`."""
        for read in self._reads.values():
            read.done.wait()
        self._reads.clear()
        start = self._consumed - self._consumed % len(self.order) + position
        self._scheduled = self._consumed = start
        self._released = True

    def _run(self) -> None:
        while (read := self._queue.get()) is not None:
            try:
                extent = self.packed.layers[read.layer]
                changed = self.disk.changed()  # before the read: a change after it is seen at the next
                self._count_read(+1)
                try:
                    data = self.disk.read_into(self.slots[read.slot], extent.offset, extent.nbytes)
                finally:
                    self._count_read(-1)
                with self._stats_lock:
                    self.bytes_read += extent.nbytes
                self.packed.check(extent, data, self.disk.fd, changed)
                read.weights = self.packed.layer_weights(read.layer, data)
            except BaseException as error:  # handed to the compute thread, which raises it
                read.error = error
            finally:
                read.done.set()

