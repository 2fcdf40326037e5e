"""What speculation learned about a (target, draft) pair, kept for the pair's next load.

One JSON file per pair in the cache folder beside the packs (cache_dir("speculation")), named
after a hash of the pair and holding the pair itself: the target file's identity as the pack
cache records it (device, inode, size, modification time, a hash of sampled content) and the
draft file's, or "ngram" for prompt lookup, and the draft's shape (tree or chain). A file is
used only when the pair it holds is the pair being loaded: another model, another draft, either
file changed, another shape, or a file that does not parse is ignored, never applied; the next
save replaces it.

It holds tokens per pass by tree size (the pair's acceptance, wherever it runs), seconds per pass
by tree size for each placement they were measured under (threads, layers on each tier, ring
depth: a load calibrates the cost model's curve with its own placement's, prediction.py, and
keeps the others' for loads under them, the MAX_PLACEMENTS latest), and for a draft model how
often the target took each rank of candidate (RankAcceptance's counts, scaled down to
LEARNED_TRIES passes so that the new run's passes still move them).
"""

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from tierflow.offload.pack.pack_cache import source_identity
from tierflow.offload.plan.profile import cache_dir

VERSION = 2
LEARNED_TRIES = 16.0  # the most passes' worth of evidence a learned rank acceptance counts as
MAX_PLACEMENTS = 8


@dataclass
class Learned:
    gained: dict[int, float] = field(default_factory=dict)  # tree size -> tokens per pass
    seconds: dict[int, float] = field(default_factory=dict)  # tree size -> seconds per pass, this placement's
    other_seconds: dict[str, dict[int, float]] = field(default_factory=dict)  # other placements'
    rank_taken: list[float] = field(default_factory=list)  # RankAcceptance.taken, .tries (a draft model)
    rank_tries: list[float] = field(default_factory=list)


class LearnedStore:
    """The learned file of one (target, draft) pair, the draft's tree or chain, under one placement."""

    def __init__(self, target: Path, draft: Path | None, shape: str, placement: str):
        draft_identity = "ngram" if draft is None else source_identity(draft)
        # a chain and a tree of the same draft gain differently at a size: each has its own file
        self.pair = {"target": source_identity(target), "draft": draft_identity,
                     "shape": "chain" if draft is None else shape}
        self.placement = placement
        digest = hashlib.sha256(json.dumps(self.pair, sort_keys=True).encode()).hexdigest()[:16]
        self.path = cache_dir("speculation") / f"{Path(target).stem}.{digest}.json"

    def load(self) -> Learned | None:
        """What was learned for this pair; None when nothing was, or the file is another pair's or
        damaged."""
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != VERSION or data.get("pair") != self.pair:
                return None
            seconds = {str(placement): _sizes(table) for placement, table in data["seconds"].items()}
            return Learned(_sizes(data["gained"]), seconds.pop(self.placement, {}), seconds,
                           _counts(data["rank_taken"]), _counts(data["rank_tries"]))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def save(self, learned: Learned) -> None:
        """Replaces the pair's file (atomically: a reader sees the old one or the new one). A cache
        folder this user cannot write only loses what was learned."""
        scale = min(1.0, LEARNED_TRIES / max(learned.rank_tries, default=1.0))
        others = list(learned.other_seconds.items())[-(MAX_PLACEMENTS - 1):]
        data = {"version": VERSION, "pair": self.pair, "gained": learned.gained,
                "seconds": dict([*others, (self.placement, learned.seconds)]),
                "rank_taken": [x * scale for x in learned.rank_taken],
                "rank_tries": [x * scale for x in learned.rank_tries]}
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            temporary.write_text(json.dumps(data))
            os.replace(temporary, self.path)
        except OSError:
            temporary.unlink(missing_ok=True)


def _sizes(table: dict) -> dict[int, float]:
    """A {size: value} table read back: sizes whole and non-negative, values finite and positive."""
    parsed = {int(size): float(value) for size, value in table.items()}
    if any(size < 0 or not math.isfinite(value) or value <= 0 for size, value in parsed.items()):
        raise ValueError("a learned value out of range")
    return parsed


def _counts(values: list) -> list[float]:
    parsed = [float(x) for x in values]
    if any(not math.isfinite(x) or x < 0 for x in parsed):
        raise ValueError("a learned count out of range")
    return parsed
