"""The GPU tier's memory: packed layers and cached experts copied to a device under gpu_memory.

On CUDA a layer's bytes are staged in pinned host memory and copied on a side stream, and an
event records when they have landed, so copies overlap compute on the default stream, which
waits on that event before using them. Without CUDA, torch's CPU device stands in for the GPU
(`Engine.load(gpu_device="cpu")`, for testing the tier): the same budget accounting and copies,
into plain memory that the CPU kernels can read.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from tierflow.errors import BudgetError
from tierflow.units import format_size


class DeviceTier:
    def __init__(self, device: torch.device, budget: int):
        self.device, self.budget, self.used = device, budget, 0
        self.peak = 0  # the most `used` has been since reset_peak()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._events: dict[int, torch.cuda.Event] = {}  # by tensor data pointer

    def upload(self, data: memoryview, what: str = "a layer") -> torch.Tensor:
        """A device copy of data (uint8), counted against the budget; `ready` before it is read."""
        with self._allocating(len(data), what):
            staging = torch.empty(len(data), dtype=torch.uint8, pin_memory=self._stream is not None)
            staging.numpy()[:] = np.frombuffer(data, np.uint8)
            if self._stream is None:
                return staging
            with torch.cuda.stream(self._stream):  # staging is pinned: the copy is asynchronous
                copy = staging.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            copy.record_stream(torch.cuda.current_stream(self.device))  # allocated on the side, used here
            self._events[copy.data_ptr()] = event
            return copy

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed tensor on the device (a layer's KV cache), counted against the budget."""
        with self._allocating(dtype.itemsize * int(np.prod(shape)), "a KV cache array"):
            return torch.zeros(shape, dtype=dtype, device=self.device)

    @contextmanager
    def _allocating(self, nbytes: int, what: str) -> Iterator[None]:
        """Counts nbytes against the budget for the allocation inside; a budget it would exceed,
        or a device that runs out of memory below the budget, is a BudgetError naming it."""
        if self.used + nbytes > self.budget:
            raise BudgetError(f"gpu_memory {format_size(self.budget)} is full ({format_size(self.used)} "
                              f"used); {what} of {format_size(nbytes)} does not fit")
        try:
            yield
        except torch.OutOfMemoryError as error:
            raise BudgetError(f"the GPU ran out of memory for {what} of {format_size(nbytes)} with "
                              f"{format_size(self.used)} of gpu_memory {format_size(self.budget)} "
                              f"used: lower gpu_memory") from error
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def reset_peak(self) -> None:
        self.peak = self.used

    def ready(self, tensor: torch.Tensor) -> None:
        """Makes the current stream wait until tensor's copy has landed (no-op off CUDA, and once
        it has been waited for): the host thread goes on at once."""
        event = self._events.pop(tensor.data_ptr(), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def free(self, tensor: torch.Tensor) -> None:
        """Gives an upload the caller drops (an evicted expert) back to the budget."""
        self._events.pop(tensor.data_ptr(), None)
        self.used -= tensor.numel() * tensor.element_size()
