"""`tierflow pull`: a model's GGUF file(s) from Hugging Face into the Hugging Face cache, where every
other tool shares them and `-m Org/Model` finds them (model_stores.py).

huggingface_hub lists the repository, reads each file's metadata and speaks the hub's protocol
(HF_ENDPOINT, HF_TOKEN, its errors). The transfer is tierflow's own, because the library neither
resumes a download that another process began nor checks the bytes it got: each file is written to
`blobs/<sha256>.incomplete`, resumed with a Range request, hashed as it comes, and takes its name in
the cache only once its SHA-256 is the hub's LFS etag. A file the cache names is always whole.
"""

import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tierflow.errors import InvalidArgumentError, ModelFileError
from tierflow.offload.gguf.split_files import first_part, split_parts
from tierflow.offload.store.model_stores import RepoName, hf_hub, matches_quant
from tierflow.progress import LoadPhase, LoadProgress
from tierflow.units import format_size

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_QUANT = "Q4_K_M"  # ollama's and llama.cpp's choice when a name gives none
OFFLINE_VARIABLES = ("TIERFLOW_OFFLINE", "HF_HUB_OFFLINE")
CHUNK_BYTES = 1 << 20
ATTEMPTS = 5  # per file: a connection cut midway is resumed this many times before the pull fails
TIMEOUT_S = 30.0
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Quant tags as file names carry them: Q4_K_M, Q8_0, IQ4_XS, TQ1_0, BF16, MXFP4, ...
_QUANT_TAG = re.compile(r"(?<![A-Za-z0-9])(I?Q\d_[A-Z0-9]+(?:_[A-Z0-9]+)?|TQ\d_\d|BF16|F16|F32|MXFP4)"
                        r"(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class HubFile:
    path: str  # within the repository
    size: int
    etag: str  # the blob's name in the cache: an LFS file's SHA-256


@dataclass(frozen=True)
class Pulled:
    name: str  # Org/Model/file.gguf, as -m takes it
    path: Path  # the model's file in the cache (a split model's first part)
    files: tuple[HubFile, ...]
    downloaded_bytes: int  # 0 when every file was already in the cache


def hub_endpoint() -> str:
    """The hub to pull from: HF_ENDPOINT (a mirror, or a local stand-in), read at each pull."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def is_offline() -> bool:
    """Whether TIERFLOW_OFFLINE (or huggingface_hub's HF_HUB_OFFLINE) forbids reaching the hub."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in OFFLINE_VARIABLES)


def hub_name(name: str) -> RepoName:
    """The repository (and quant tag or file) a name pulls; anything else is named."""
    repo = RepoName.parse(name)
    if repo is None:
        raise InvalidArgumentError(f"{name!r} is not a Hugging Face model name: write Org/Model, "
                                   f"Org/Model:QUANT, Org/Model/file.gguf or hf.co/Org/Model:QUANT")
    return repo


def _quiet_hub_client() -> None:
    """Before huggingface_hub's first import: its first request of a process would otherwise also
    ask huggingface.co itself for telemetry, whatever HF_ENDPOINT says (a mirror's user, or a test's
    local hub, must reach nothing else)."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def pull(name: str, *, progress: LoadProgress | None = None, cache: Path | None = None) -> Pulled:
    """Downloads the GGUF file a name means (the quant tag's, Q4_K_M by default; every part of a split
    model) into the Hugging Face cache, and returns where it is. Files already whole there are not
    downloaded again. progress(LoadPhase.DOWNLOADING, bytes done, total) is called on this thread."""
    repo = hub_name(name)
    if is_offline():
        raise ModelFileError(f"cannot pull {name}: offline ({_offline_variable()} is set)")
    endpoint, repo_id = hub_endpoint(), f"{repo.org}/{repo.model}"
    _quiet_hub_client()
    with _hub_errors(repo_id, endpoint):
        commit, paths = _list_repository(repo_id, endpoint)
        files = [_file_metadata(repo_id, path, commit, endpoint) for path in _chosen_paths(repo, paths)]
        folder = (cache or hf_hub()) / f"models--{repo.org}--{repo.model}"
        _check_room(folder, files)
        transfer = _Transfer(sum(file.size for file in files), progress)
        for file in files:
            _fetch(folder, repo_id, commit, file, endpoint, transfer)
    for file in files:
        _link(folder, commit, file)
    _write_ref(folder, commit)
    model = first_part(PurePosixPath(files[0].path))
    return Pulled(f"{repo_id}/{model}", folder / "snapshots" / commit / model, tuple(files),
                  transfer.downloaded)


def _offline_variable() -> str:
    return next(name for name in OFFLINE_VARIABLES if os.environ.get(name))


@contextmanager
def _hub_errors(repo_id: str, endpoint: str) -> Iterator[None]:
    """The hub's answers and a network's failures, as errors that say what to do."""
    import httpx2
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except GatedRepoError:
        raise ModelFileError(f"{repo_id} is gated: accept its terms at {endpoint}/{repo_id}, then set "
                             "HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelFileError(f"{repo_id} is not a model repository on {endpoint} (a private one needs "
                             "HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelFileError(f"{repo_id} has no main revision on {endpoint}") from None
    except EntryNotFoundError as error:
        raise ModelFileError(f"{repo_id}: a file is missing on {endpoint} ({error})") from None
    except HfHubHTTPError as error:
        raise ModelFileError(f"{endpoint} answered {error.response.status_code} for {repo_id}: "
                             f"{str(error).splitlines()[0]}") from None
    except httpx2.HTTPError as error:
        raise ModelFileError(f"cannot reach {endpoint} for {repo_id}: {error or type(error).__name__} "
                             "(a model on this disk needs no network; TIERFLOW_OFFLINE=1 keeps "
                             "tierflow from trying)") from None


def _list_repository(repo_id: str, endpoint: str) -> tuple[str, list[str]]:
    """The main revision's commit and the repository's file paths."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint).model_info(repo_id, revision="main", timeout=TIMEOUT_S)
    if info.sha is None or not re.fullmatch(r"[0-9a-f]{40}", info.sha):
        raise ModelFileError(f"{endpoint} gave {repo_id} no commit id ({info.sha!r})")
    return info.sha, [sibling.rfilename for sibling in info.siblings or []]


def _chosen_paths(repo: RepoName, paths: list[str]) -> list[str]:
    """The repository's files a name means: the file it names, else the model of its quant tag
    (Q4_K_M without one, or the only model), with every part of a split model."""
    repo_id = f"{repo.org}/{repo.model}"
    models = sorted({str(first_part(PurePosixPath(path))) for path in paths
                     if path.lower().endswith(".gguf") and "mmproj" not in path.lower()})
    if repo.file is not None:
        chosen = [model for model in models if model == str(first_part(PurePosixPath(repo.file)))]
        if not chosen:
            raise ModelFileError(f"{repo_id} has no file {repo.file}; its GGUF files: {_listed(models)}")
    else:
        chosen = [model for model in models if matches_quant(PurePosixPath(model).name,
                                                             repo.quant or DEFAULT_QUANT)]
        if not chosen and repo.quant is None and len(models) == 1:
            chosen = models
        if not models:
            raise ModelFileError(f"{repo_id} holds no GGUF file (its files: {_listed(paths)})")
        if not chosen:
            wanted = repo.quant or f"{DEFAULT_QUANT} (the default)"
            raise ModelFileError(f"{repo_id} has no {wanted} file; it has {_quants(models)}: name one, as "
                                 f"{repo_id}:{_quant(models[0]) or 'QUANT'}")
        if len(chosen) > 1:
            raise ModelFileError(f"{repo_id}:{repo.quant or DEFAULT_QUANT} matches {len(chosen)} files, "
                                 f"name one as {repo_id}/FILE: {_listed(chosen)}")
    model = PurePosixPath(chosen[0])
    parts = [str(part) for part in split_parts(model) or [model]]
    missing = [part for part in parts if part not in paths]
    if missing:
        raise ModelFileError(f"{repo_id}: {model} is split in {len(parts)} parts, and {missing[0]} is "
                             "not in the repository")
    return parts


def _quant(path: str) -> str | None:
    found = _QUANT_TAG.search(PurePosixPath(path).name)
    return found.group(1).upper() if found else None


def _quants(models: list[str]) -> str:
    tags = sorted({_quant(model) for model in models} - {None})
    return ", ".join(tags) if tags else f"the files {_listed(models)}"


def _listed(paths: list[str], most: int = 20) -> str:
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "") or "none"


def _file_metadata(repo_id: str, path: str, commit: str, endpoint: str) -> HubFile:
    """A file's size and LFS etag (its SHA-256), from the hub's answer to a HEAD request."""
    from huggingface_hub import get_hf_file_metadata

    metadata = get_hf_file_metadata(_url(repo_id, commit, path, endpoint), timeout=TIMEOUT_S,
                                    endpoint=endpoint)
    if metadata.size is None or metadata.etag is None:
        raise ModelFileError(f"{endpoint} gave {repo_id}/{path} no size or etag")
    etag = metadata.etag.lower()
    if not _SHA256.fullmatch(etag):
        raise ModelFileError(f"{repo_id}/{path} is not stored in LFS on {endpoint} (its etag {etag!r} is "
                             "no SHA-256), so its bytes cannot be checked")
    return HubFile(path, metadata.size, etag)


def _check_room(folder: Path, files: list[HubFile]) -> None:
    """Refuses before any byte comes when the disk cannot hold what is left to download."""
    needed = sum(file.size - _partial_bytes(folder, file) for file in files
                 if not (folder / "blobs" / file.etag).exists())
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise ModelFileError(f"pulling {', '.join(file.path for file in files)} needs {format_size(needed)} "
                             f"more and the disk of {existing} has {format_size(free)} free")


def _partial_bytes(folder: Path, file: HubFile) -> int:
    partial = folder / "blobs" / f"{file.etag}.incomplete"
    return min(partial.stat().st_size, file.size) if partial.exists() else 0


class _Transfer:
    """The bytes of a pull done so far, across its files, reported to progress."""

    def __init__(self, total: int, progress: LoadProgress | None) -> None:
        self.total, self.progress = total, progress
        self.done = self.downloaded = 0

    def advance(self, nbytes: int, downloaded: bool = True) -> None:
        self.done += nbytes
        self.downloaded += nbytes if downloaded else 0
        if self.progress is not None:
            self.progress(LoadPhase.DOWNLOADING, self.done, self.total)


def _fetch(folder: Path, repo_id: str, commit: str, file: HubFile, endpoint: str,
           transfer: _Transfer) -> None:
    """Makes blobs/<etag> whole and checked: resumed from its .incomplete, hashed, renamed."""
    from filelock import FileLock

    blob = folder / "blobs" / file.etag
    lock = folder.parent / ".locks" / folder.name / f"{file.etag}.lock"  # huggingface_hub's own lock
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock):
        if blob.exists():
            transfer.advance(file.size, downloaded=False)
            return
        partial = _Partial.resumed(blob.with_name(f"{file.etag}.incomplete"), file, transfer)
        url = _url(repo_id, commit, file.path, endpoint)
        for attempt in range(ATTEMPTS):
            try:
                _download(partial, file, url, transfer)
                break
            except _Cut as cut:
                if attempt == ATTEMPTS - 1:
                    raise ModelFileError(f"the download of {repo_id}/{file.path} was cut {ATTEMPTS} times "
                                         f"({cut}); pull again to resume it") from None
        if partial.digest.hexdigest() != file.etag:
            partial.path.unlink()
            raise ModelFileError(f"{repo_id}/{file.path} came with SHA-256 {partial.digest.hexdigest()}, "
                                 f"not the {file.etag} {endpoint} names: nothing was kept")
        os.replace(partial.path, blob)


class _Cut(Exception):
    """A transfer that ended before its last byte; the next attempt resumes it."""


class _Partial:
    """blobs/<etag>.incomplete and the SHA-256 of the bytes it holds, kept in step."""

    def __init__(self, path: Path) -> None:
        self.path, self.digest = path, hashlib.sha256()

    @classmethod
    def resumed(cls, path: Path, file: HubFile, transfer: _Transfer) -> "_Partial":
        """What an earlier, interrupted pull left, hashed; one longer than the file is begun again."""
        partial = cls(path)
        if path.exists() and path.stat().st_size > file.size:
            path.unlink()
        if path.exists():
            with open(path, "rb") as kept:
                while chunk := kept.read(CHUNK_BYTES):
                    partial.digest.update(chunk)
            transfer.advance(path.stat().st_size, downloaded=False)
        return partial

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def restart(self, transfer: _Transfer) -> None:
        transfer.advance(-self.nbytes, downloaded=False)
        self.path.unlink(missing_ok=True)
        self.digest = hashlib.sha256()


def _url(repo_id: str, commit: str, path: str, endpoint: str) -> str:
    """The file's address at the commit: what HEAD's metadata and GET's bytes are asked of."""
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo_id, path, revision=commit, endpoint=endpoint)


def _download(partial: _Partial, file: HubFile, url: str, transfer: _Transfer) -> None:
    """Appends the rest of the file to partial (a Range request from its length), hashing it."""
    import httpx2
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    start = partial.nbytes
    if start == file.size:
        return
    headers = build_hf_headers() | ({"Range": f"bytes={start}-"} if start else {})
    try:
        with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                  timeout=TIMEOUT_S) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            if start and response.status_code != 206:  # the server ignored the Range: begin again
                partial.restart(transfer)
            with open(partial.path, "ab") as out:
                for chunk in response.iter_bytes():  # as it arrives: a cut keeps every byte that came
                    out.write(chunk)
                    partial.digest.update(chunk)
                    transfer.advance(len(chunk))
    except (httpx2.TransportError, httpx2.StreamError) as error:
        raise _Cut(str(error) or type(error).__name__) from None
    got = partial.nbytes
    if got < file.size:
        raise _Cut(f"{got} of {file.size} bytes")
    if got > file.size:
        partial.path.unlink()
        raise ModelFileError(f"{url} sent {got} bytes, more than the {file.size} the hub names: "
                             "nothing was kept")


def _link(folder: Path, commit: str, file: HubFile) -> None:
    """snapshots/<commit>/<path> → ../../blobs/<etag>, as huggingface_hub lays the cache out."""
    link = folder / "snapshots" / commit / file.path
    link.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(folder / "blobs" / file.etag, link.parent)
    if link.is_symlink() and os.readlink(link) == target:
        return
    if os.path.lexists(link):
        link.unlink()
    os.symlink(target, link)


def _write_ref(folder: Path, commit: str) -> None:
    ref = folder / "refs" / "main"
    ref.parent.mkdir(parents=True, exist_ok=True)
    temporary = ref.with_name(f".main.{os.getpid()}")
    temporary.write_text(commit)
    os.replace(temporary, ref)

