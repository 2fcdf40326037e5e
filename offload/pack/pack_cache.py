"""The pack cache: which pack belongs to which model file, how much disk the packs may take, and
which packs go when room is needed.

A pack is named after its source file's device and inode, so every name of one file (a symlink, a
hard link, the file after a move within its filesystem) finds the same pack. Its manifest records
the file's whole identity (device, inode, size, modification and change times, a hash of sampled
content and a CRC-32 of all of it) and a pack is used only while it matches: a file changed in
place, even one that kept its size and modification time, has its pack rebuilt under the same name,
not a second one left beside it. The change time (ctime) moves on any write, and on a move, a link
or a chmod too: a pack whose source's ctime moved is checked against the CRC of the whole file (one
read of it) before it is used, and the ctime it was checked at is kept in its use record.
A pack of the inode under another name serves only a file of the size and modification time its
manifest records; any other was left by a deleted file whose inode the system reused, and a pack
named after the new file replaces it.

Beside each pack a use record (NAME.used: the path it was last opened through; its mtime, when) is
touched on every open; `tierflow cache list` shows it and eviction goes by it, least recently
used first. A MoE model's routing, once recorded (NAME.routing.npz), is kept beside its pack
too, and goes with it. Before a pack is built, `make_room` evicts packs over the cap
(TIERFLOW_CACHE_MAX) and checks the disk has room, before any byte is written.

A pack is written as NAME.tfpack.<pid>.tmp and renamed when whole (writer.py). A build killed
midway leaves that temporary, up to the pack's size: the temporaries of writers that are gone
(temporaries.py: the pid not alive, the file's lock free) are removed before a build's disk check
and by `prune`, which count them, and `tierflow cache list` shows them (`stale_temporaries`).
"""

import hashlib
import json
import logging
import os
import shutil
import threading
import weakref
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from tierflow.cpu_kernels.checksum import crc32
from tierflow.errors import BudgetError, InvalidArgumentError, ModelFileError, TierflowError
from tierflow.offload.gguf.split_files import split_parts
from tierflow.offload.pack.reader import PackedFile
from tierflow.offload.pack.temporaries import StaleTemporary, remove_stale, stale_temporaries
from tierflow.offload.plan.profile import cache_dir
from tierflow.units import format_size, parse_size

SUFFIX = ".tfpack"
USE_SUFFIX = ".used"
ROUTING_SUFFIX = ".routing.npz"  # a MoE model's recorded routing, for the planner's hit rates and read-ahead
RETIRED_SUFFIXES = (".routing.npy",)  # kept beside packs by an older tierflow, read by none now
SAMPLE_BYTES = 64 << 10
CRC_READ_BYTES = 16 << 20
SAMPLE_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the content samples start (the last ends the file)
# Left free on the cache's disk after a pack: a disk filled to its last byte breaks other programs
# (editors, databases, the system's logs), and the manifest is written after the extents.
DISK_MARGIN_BYTES = 1 << 30
# Without TIERFLOW_CACHE_MAX the packs may take a quarter of the cache disk: room for a few models'
# packs without crowding out the user's files. It is no reason to refuse a model whose pack alone
# is larger (the free-space check guards the disk then); a cap the user sets is kept strictly.
DEFAULT_CAP_SHARE = 0.25
CAP_VARIABLE = "TIERFLOW_CACHE_MAX"
# The probe's scratch file in the cache folder (offload/plan/probe.py), left by a probe killed midway.
PROBE_SCRATCH_PATTERN = ".tierflow-probe.*.tmp"
log = logging.getLogger(__name__)

# The packs this process has opened and still holds: never evicted from under it. Engines may load
# on several threads, and a WeakSet must not change while it is read.
_open_packs: "weakref.WeakSet[PackedFile]" = weakref.WeakSet()
_open_packs_lock = threading.Lock()


@dataclass(frozen=True)
class CachedPack:
    path: Path
    nbytes: int
    last_used_ns: int
    source: Path | None = None  # the model file it was last opened through (None: not recorded)
    source_exists: bool = False  # that file is still there and still the one packed

    def as_dict(self) -> dict:
        return {"name": self.path.name, "path": str(self.path), "bytes": self.nbytes,
                "source": None if self.source is None else str(self.source),
                "source_name": None if self.source is None else self.source.name,
                "source_exists": self.source_exists, "last_used": _iso_time(self.last_used_ns)}


def packs_folder() -> Path:
    """The cache folder's `packed` folder (created)."""
    return cache_dir("packed")


def source_identity(source: Path) -> dict:
    """What a pack's manifest records of its source, and must match to be used. The content hash
    reads a few fixed samples (constant time whatever the size): with size and mtime it catches a
    file rewritten in place, though not a change confined to bytes no sample covers. A split model's
later parts count by size and mtime."""
    with open(source, "rb") as f:
        stat = os.fstat(f.fileno())
        identity = {"device": stat.st_dev, "inode": stat.st_ino, "size": stat.st_size,
                    "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns,
                    "sample_sha256": _sample_hash(f, stat.st_size)}
    later_parts = (split_parts(Path(source)) or [])[1:]  # a split model's: a changed one changes it
    if later_parts:
        identity["parts"] = [[stat.st_size, stat.st_mtime_ns] for stat in map(os.stat, later_parts)]
    return identity


def content_crc(source: Path) -> int:
    """CRC-32 of the whole file and its later split parts: read once at a build, and again only when
    the file's ctime moved since (same_source)."""
    crc = 0
    for part in [Path(source), *(split_parts(Path(source)) or [])[1:]]:
        with open(part, "rb") as f:
            while block := f.read(CRC_READ_BYTES):
                crc = crc32(block, crc)
    return crc


def same_source(recorded: dict, identity: dict, pack: Path, source: Path) -> bool:
    """Whether a pack whose manifest records `recorded` was built from the file whose identity is
    now `identity`: all of it equal, or all but the ctime when the whole file's CRC still is (the
    ctime checked then is kept in the pack's use record, so the file is read once per change)."""
    built = {key: value for key, value in recorded.items() if key != "content_crc32"}
    if built == identity:
        return True
    if {**built, "ctime_ns": identity.get("ctime_ns")} != identity or "content_crc32" not in recorded:
        return False
    if _read_use(pack).get("checked_ctime_ns") == identity["ctime_ns"]:
        return True
    if content_crc(source) != recorded["content_crc32"]:
        return False
    _write_use(pack, {**_read_use(pack), "checked_ctime_ns": identity["ctime_ns"]})
    return True


def _without_change_time(identity: dict) -> dict:
    return {key: value for key, value in identity.items() if key not in ("ctime_ns", "content_crc32")}


def _sample_hash(f: BinaryIO, size: int) -> str:
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    for fraction in SAMPLE_FRACTIONS:
        f.seek(min(int(size * fraction), max(size - SAMPLE_BYTES, 0)))
        digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def pack_path(source: Path) -> Path:
    """Where the pack of `source` lives or is to be built. A pack is named after its file's stem,
    device and inode, so that a file rewritten in place has its pack rebuilt in its place.

    A pack of the same device and inode under another name is this file's when it was built from
    a file of this size and modification time: the model renamed, moved or hard-linked. Any other
    was left by a deleted file whose inode the system has since given to this one (a new download
    of another model, say): it is no pack of this file, and a pack under this file's own name
    replaces it (other_packs_of_inode)."""
    stat = os.stat(source)  # a stat, not source_identity's reads: the content is checked at open
    own = packs_folder() / f"{Path(source).resolve().stem}.{_inode_digest(stat)}{SUFFIX}"
    if own.exists():
        return own
    renamed = [pack for pack in other_packs_of_inode(own) if _built_from(pack, stat)]
    return renamed[0] if renamed else own


def other_packs_of_inode(pack: Path) -> list[Path]:
    """The packs beside `pack` named after the same device and inode, under other names."""
    digest = pack.name.removesuffix(SUFFIX).rsplit(".", 1)[-1]
    return sorted(other for other in pack.parent.glob(f"*.{digest}{SUFFIX}") if other != pack)


def _inode_digest(stat: os.stat_result) -> str:
    return hashlib.sha256(f"{stat.st_dev}:{stat.st_ino}".encode()).hexdigest()[:16]


def _built_from(pack: Path, stat: os.stat_result) -> bool:
    """Whether the manifest of `pack` records a source of this size and modification time."""
    try:
        source = PackedFile(pack).source
    except (OSError, ModelFileError):
        return False
    return (source.get("size"), source.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns)


def record_use(packed: PackedFile, source: Path) -> None:
    """Notes that `packed` was opened for `source` now: this process holds it, and its use record
    names the source and is touched (its mtime is the last use: a touch costs microseconds, where
    a rewrite would cost a rename per load). A cache folder this user cannot write only loses the
    record."""
    with _open_packs_lock:
        _open_packs.add(packed)
    record, source = _use_record(packed.path), str(Path(source).resolve())
    used = _read_use(packed.path)
    try:
        if used.get("source") == source:
            os.utime(record)
            return
    except OSError:
        return
    _write_use(packed.path, {**used, "source": source})


def _write_use(pack: Path, contents: dict) -> None:
    record = _use_record(pack)
    temporary = record.with_name(record.name + f".{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(contents))
        os.replace(temporary, record)
    except OSError:
        temporary.unlink(missing_ok=True)


def list_packs() -> list[CachedPack]:
    """Every pack in the cache, most recently used first, with its source and whether it is
    still there."""
    return [_with_source(pack) for pack in _packs_by_use(packs_folder())]


def total_bytes(packs: list[CachedPack]) -> int:
    return sum(pack.nbytes for pack in packs)


def cap_bytes() -> int | None:
    """TIERFLOW_CACHE_MAX in bytes; None when it is not set."""
    value = os.environ.get(CAP_VARIABLE)
    if not value:
        return None
    try:
        return parse_size(value)
    except BudgetError as error:
        raise BudgetError(f"{CAP_VARIABLE}: {error}") from None


def default_cap_bytes(folder: Path) -> int:
    return int(shutil.disk_usage(folder).total * DEFAULT_CAP_SHARE)


def make_room(target: Path, nbytes: int, model_name: str) -> None:
    """Before the pack `target` (nbytes) of `model_name` is built: removes the temporaries that killed
    builds left (logged), refuses (BudgetError) a pack larger than the cap or than the disk's free
    space allows, then evicts the least recently used packs the cap needs gone. Neither `target` nor
    a pack this process holds is evicted."""
    folder = target.parent
    removed = remove_stale(folder)
    if removed:
        log.info("removed %s left in %s by builds that were killed: %s", _temporaries_said(removed), folder,
                 ", ".join(stale.path.name for stale in removed))
    cap = cap_bytes()
    if cap is not None and nbytes > cap:
        raise BudgetError(f"the pack of {model_name} takes {format_size(nbytes)}, more than the pack "
                          f"cache may hold ({CAP_VARIABLE}={format_size(cap)}); raise {CAP_VARIABLE}")
    cap = max(default_cap_bytes(folder), nbytes) if cap is None else cap
    others = [pack for pack in _packs_by_use(folder) if pack.path != target]
    victims = _evicted(others, total_bytes(others) + nbytes - cap)
    if total_bytes(others) - total_bytes(victims) + nbytes > cap:
        held = total_bytes([pack for pack in others if pack.path in _held_paths()])
        raise BudgetError(f"the pack of {model_name} ({format_size(nbytes)}) does not fit the pack cache's "
                          f"cap ({CAP_VARIABLE}={format_size(cap)}) beside the packs this process holds "
                          f"open ({format_size(held)}); raise {CAP_VARIABLE}")
    _check_disk(folder, nbytes, total_bytes(victims), model_name)
    for pack in victims:
        remove_pack(pack.path)


def _check_disk(folder: Path, nbytes: int, evictable: int, model_name: str) -> None:
    free, needed = shutil.disk_usage(folder).free, nbytes + DISK_MARGIN_BYTES
    if free + evictable < needed:
        evicting = f" (and {format_size(evictable)} in packs it would evict)" if evictable else ""
        raise BudgetError(f"not enough disk space to pack {model_name}: {folder} has {format_size(free)} "
                          f"free{evicting}, the pack needs {format_size(needed)} ({format_size(nbytes)} "
                          f"and {format_size(DISK_MARGIN_BYTES)} left free); free space there, remove "
                          f"packs (tierflow cache prune) or set TIERFLOW_CACHE to a folder on another disk")


@dataclass(frozen=True)
class Pruned:
    packs: list[CachedPack]  # removed: the source gone, changed or unknown, then least recently used
    temporaries: list[StaleTemporary]  # removed: left by builds (and probes) that were killed

    @property
    def nbytes(self) -> int:
        return total_bytes(self.packs) + sum(stale.nbytes for stale in self.temporaries)


def prune(max_bytes: int | None = None) -> Pruned:
    """Removes the temporaries killed builds (and probes) left, the packs whose source is gone,
    changed or unknown, then the least recently used ones until the rest take at most max_bytes
    (default: the cap); returns what it removed."""
    folder = packs_folder()
    temporaries = remove_stale(folder) + remove_stale(cache_dir(), PROBE_SCRATCH_PATTERN)
    packs = list_packs()
    gone = [pack for pack in packs if not pack.source_exists and pack.path not in _held_paths()]
    kept = [pack for pack in packs if pack not in gone]
    limit = max_bytes if max_bytes is not None else cap_bytes()
    limit = default_cap_bytes(folder) if limit is None else limit
    removed = gone + _evicted(kept, total_bytes(kept) - limit)
    for pack in removed:
        remove_pack(pack.path)
    for suffix in (USE_SUFFIX, ROUTING_SUFFIX):  # records of packs removed by hand
        for record in folder.glob(f"*{suffix}"):
            if not record.with_name(record.name.removesuffix(suffix) + SUFFIX).exists():
                record.unlink(missing_ok=True)
    for suffix in RETIRED_SUFFIXES:
        for record in folder.glob(f"*{suffix}"):
            record.unlink(missing_ok=True)
    return Pruned(removed, temporaries)


def stale_files() -> list[StaleTemporary]:
    """The temporaries killed builds (and probes) left in the cache, which prune removes."""
    return stale_temporaries(packs_folder()) + stale_temporaries(cache_dir(), PROBE_SCRATCH_PATTERN)


def _temporaries_said(stale: list[StaleTemporary]) -> str:
    count = len(stale)
    return f"{count} temporar{'y' if count == 1 else 'ies'} ({format_size(sum(x.nbytes for x in stale))})"


def routing_path(source: Path) -> Path:
    """Where the routing recorded with model file `source` is kept: beside its pack."""
    return pack_path(source).with_suffix(ROUTING_SUFFIX)


def remove_pack(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
        _use_record(path).unlink(missing_ok=True)
        path.with_suffix(ROUTING_SUFFIX).unlink(missing_ok=True)
    except OSError as error:
        raise TierflowError(f"cannot remove the pack {path} ({error.strerror or error})") from error


def find_pack(name_or_path: str) -> Path:
    """The pack a user names: a pack's file name (as `tierflow cache list` shows it) or path, or
    a model file, for its pack. Only a file in the packs folder is ever named."""
    folder = packs_folder()
    given = Path(name_or_path).expanduser()
    if given.is_file():
        if given.resolve().parent == folder.resolve() and given.suffix == SUFFIX:
            return given.resolve()
        pack = pack_path(given)
        if not pack.exists():
            raise InvalidArgumentError(f"{given} has no pack in {folder}")
        return pack
    if given.name == name_or_path:  # a bare name: a pack's
        for name in (given.name, given.name + SUFFIX):
            if name.endswith(SUFFIX) and (folder / name).is_file():
                return folder / name
    raise InvalidArgumentError(f"no pack named {name_or_path!r} in {folder}, and no model file at that path "
                               f"(tierflow cache list shows the packs)")


# -- listing ----------------------------------------------------------------------------------


def _use_record(pack: Path) -> Path:
    return pack.with_suffix(USE_SUFFIX)


def _read_use(pack: Path) -> dict:
    try:
        record = json.loads(_use_record(pack).read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _packs_by_use(folder: Path) -> list[CachedPack]:
    """The packs in `folder` with their sizes, most recently used first (a pack without a use
    record counts as used when it was written)."""
    packs = []
    for path in folder.glob(f"*{SUFFIX}"):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue  # removed meanwhile
        try:
            used_ns = _use_record(path).stat().st_mtime_ns
        except FileNotFoundError:
            used_ns = stat.st_mtime_ns
        packs.append(CachedPack(path, stat.st_size, used_ns))
    return sorted(packs, key=lambda pack: pack.last_used_ns, reverse=True)


def _with_source(pack: CachedPack) -> CachedPack:
    source = _read_use(pack.path).get("source")
    if not isinstance(source, str):
        return pack
    try:  # without reading the whole file: a file only moved or relinked since still counts
        recorded, identity = PackedFile(pack.path).source, source_identity(Path(source))
        exists = _without_change_time(recorded) == _without_change_time(identity)
    except (OSError, ModelFileError):
        exists = False
    return CachedPack(pack.path, pack.nbytes, pack.last_used_ns, Path(source), exists)


def _held_paths() -> set[Path]:
    with _open_packs_lock:
        return {packed.path for packed in _open_packs}


def _evicted(packs: list[CachedPack], excess: int) -> list[CachedPack]:
    """The least recently used of `packs` (most recent first) whose bytes cover `excess`, none
    that this process holds (fewer when those are not enough)."""
    held, victims = _held_paths(), []
    for pack in reversed(packs):
        if excess <= 0:
            break
        if pack.path not in held:
            victims.append(pack)
            excess -= pack.nbytes
    return victims


def _iso_time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, timezone.utc).isoformat(timespec="seconds")
