"""What a load reports as it goes: its phase, and bytes done of a total.

    def progress(phase: LoadPhase, done: int, total: int) -> None: ...
    Engine.load(model, progress=progress)

The callback runs on the thread doing the work (the caller's for Engine.load, the load's worker
thread for Engine.aload, one of the pack builder's threads while a pack is built; a download's for
pull), one call at a time: an app with a UI hands the update to its own thread (a queue its UI
thread polls with Tk's `after`, asyncio's `call_soon_threadsafe`). total is 0 while it is not known.
`phase.label` is what a progress bar shows.
"""

from collections.abc import Callable
from enum import Enum


class LoadPhase(str, Enum):
    """A load's phases, in the order they come; a phase may be skipped (no download for a file on
    the disk, no probe once the machine is measured, no pack when the weights build in RAM)."""

    DOWNLOADING = "downloading"  # the model's file(s) from Hugging Face: bytes
    PROBING = "probing"  # measuring this machine's speeds, once: steps (offload/plan/probe.py)
    PACKING = "packing"  # the weights laid out for the kernels, once per file: the GGUF's bytes
    LOADING = "loading"  # the weights read into RAM (and the GPU): bytes

    @property
    def label(self) -> str:
        """The phase in words, for a progress bar."""
        return _LABELS[self]


_LABELS = {
    LoadPhase.DOWNLOADING: "downloading the model",
    LoadPhase.PROBING: "measuring this machine (once)",
    LoadPhase.PACKING: "packing the weights (once)",
    LoadPhase.LOADING: "loading the weights",
}


LoadProgress = Callable[[LoadPhase, int, int], None]
