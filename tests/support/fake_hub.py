"""A stand-in for the Hugging Face hub on 127.0.0.1, for tests that drive the real huggingface_hub
(`endpoint=hub.url`) and must never reach the real one.

It speaks what huggingface_hub 2.4.0 asks of the hub to download a model's files: HEAD and GET on
`/{repo}/resolve/{revision}/{path}` (byte ranges included), `/api/models/{repo}[/revision/{rev}]`
(model info, `?blobs=true` for sizes and LFS hashes) and `/api/models/{repo}/tree/{rev}[/{path}]`
(the listing `list_repo_files`, `list_repo_tree` and `snapshot_download` read). Failures come back
as the hub sends them, an `X-Error-Code` header that huggingface_hub turns into its own exception
types. Faults on demand: a transfer cut mid-body, metadata naming the wrong SHA-256.

    with FakeHub() as hub:
        hub.add_repo("Org/Model-GGUF", {"model-Q4_K_M.gguf": b"...", "README.md": b"# hi"})
        isolate_hub_client(monkeypatch, hub)   # no token, no telemetry, default endpoint = hub
        hf_hub_download("Org/Model-GGUF", "model-Q4_K_M.gguf", endpoint=hub.url, cache_dir=tmp_path)
"""

import hashlib
import json
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

CHUNK_BYTES = 1 << 20  # a body is streamed in pieces of this size: a Path is never read whole
LFS_MIN_BYTES = 10 << 20  # the hub keeps files this large, and every .gguf, in LFS

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_MODEL = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_RANGE = re.compile(r"^bytes=(?P<start>\d*)-(?P<end>\d*)$")


class HubRequest(NamedTuple):
    method: str
    path: str  # as sent, query included
    range: str | None  # the Range header


class HubError(Exception):
    """An answer the hub gives as an error: the status, its X-Error-Code and X-Error-Message."""

    def __init__(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


@dataclass
class HubFile:
    path: str  # in the repository
    source: bytes | Path
    size: int
    sha256: str  # of the content
    lfs: bool
    etag_sha256: str = ""  # what the metadata names as the content's SHA-256 (wrong_sha256 changes it)

    @classmethod
    def of(cls, path: str, source: bytes | Path) -> "HubFile":
        size, digest = _size(source), hashlib.sha256()
        for chunk in _chunks(source, 0, size):
            digest.update(chunk)
        lfs = path.endswith(".gguf") or size >= LFS_MIN_BYTES
        return cls(path, source, size, digest.hexdigest(), lfs, digest.hexdigest())

    @property
    def git_oid(self) -> str:
        """Git's blob id of what the repository holds: the content, or its LFS pointer."""
        return hashlib.sha1(b"blob %d\0" % len(self.stored) + self.stored).hexdigest()

    @property
    def stored(self) -> bytes:
        if not self.lfs:
            return self.source if isinstance(self.source, bytes) else self.source.read_bytes()
        return (f"version https://git-lfs.github.com/spec/v1\n"
                f"oid sha256:{self.etag_sha256}\nsize {self.size}\n").encode()

    @property
    def etag(self) -> str:
        return self.etag_sha256 if self.lfs else self.git_oid


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, HubFile]
    gated: bool
    commit: str = field(init=False)

    def __post_init__(self):
        names = "".join(f"{f.path}\0{f.sha256}\0" for f in sorted(self.files.values(), key=lambda f: f.path))
        self.commit = hashlib.sha1(f"{self.repo_id}\0{names}".encode()).hexdigest()

    def folders(self) -> set[str]:
        return {str(Path(p).parents[i]) for p in self.files for i in range(len(Path(p).parents) - 1)}


class FakeHub:
    """The hub's file protocol on 127.0.0.1 and a free port, served from a daemon thread between
    `__enter__` and `__exit__`. Any request to a repository it does not hold gets the hub's
    RepoNotFound, so nothing falls through to a real network."""

    def __init__(self) -> None:
        self._repos: dict[str, HubRepo] = {}
        self._cuts: dict[tuple[str, str], list[int]] = {}  # (repo, path) -> byte counts of the next GETs
        self._requests: list[HubRequest] = []
        self.ignores_ranges = False  # True: a Range header is ignored, the whole file sent with 200
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.hub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-hub", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def requests(self) -> list[HubRequest]:
        with self._lock:
            return list(self._requests)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def add_repo(self, repo_id: str, files: Mapping[str, bytes | Path], *, gated: bool = False) -> str:
        """Holds a model repository at a made-up commit (40 hex, the same for the same content);
        returns the commit. A gated one serves its files only to a request with a bearer token."""
        repo = HubRepo(repo_id, {path: HubFile.of(path, source) for path, source in files.items()}, gated)
        with self._lock:
            self._repos[repo_id] = repo
        return repo.commit

    def cut_transfer(self, repo_id: str, path: str, *, after_bytes: int, times: int = 1) -> None:
        """The next `times` GETs of the file close the connection after `after_bytes` of their body."""
        self._file(repo_id, path)
        with self._lock:
            self._cuts.setdefault((repo_id, path), []).extend([after_bytes] * times)

    def wrong_sha256(self, repo_id: str, path: str) -> str:
        """The file's metadata (ETag, X-Linked-Etag, the tree's and the model info's LFS oid) names the
        SHA-256 of other content; the body stays the same. Returns the SHA-256 it names."""
        hub_file = self._file(repo_id, path)
        hub_file.etag_sha256 = hashlib.sha256(b"not " + hub_file.sha256.encode()).hexdigest()
        return hub_file.etag_sha256

    def _file(self, repo_id: str, path: str) -> HubFile:
        return self._repos[repo_id].files[path]

    def _log(self, request: HubRequest) -> None:
        with self._lock:
            self._requests.append(request)

    def _next_cut(self, repo_id: str, path: str) -> int | None:
        with self._lock:
            cuts = self._cuts.get((repo_id, path))
            return cuts.pop(0) if cuts else None

    def _repo(self, repo_id: str, revision: str | None, authorized: bool) -> HubRepo:
        repo = self._repos.get(repo_id)
        if repo is None:  # the hub answers 401 to an anonymous request, 404 to one with a token
            raise HubError(404 if authorized else 401, "RepoNotFound", "Repository not found")
        if revision not in (None, "main", repo.commit):
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo


def isolate_hub_client(monkeypatch: pytest.MonkeyPatch, hub: FakeHub) -> None:
    """Makes huggingface_hub, for one test, talk to `hub` only: its default endpoint, which it reads
    from HF_ENDPOINT once at import, becomes the hub's, so a call without `endpoint=` cannot leave
    the machine; no token from the environment or the token file; no telemetry, whose first request
    of a process fetches `{ENDPOINT}/api/agent-harnesses`; not offline."""
    from huggingface_hub import constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/fake-hub/token")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so a body's end is its Content-Length, as on the hub
    server: ThreadingHTTPServer

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def log_message(self, format: str, *args) -> None:
        pass

    def _answer(self, send_body: bool) -> None:
        hub: FakeHub = self.server.hub  # type: ignore[attr-defined]
        hub._log(HubRequest(self.command, self.path, self.headers.get("Range")))
        url = urlsplit(self.path)
        try:
            if match := _RESOLVE.match(url.path):
                self._resolve(hub, unquote(match["repo"]), unquote(match["rev"]), unquote(match["path"]),
                              send_body)
            elif match := _TREE.match(url.path):
                self._tree(hub, unquote(match["repo"]), unquote(match["rev"]), unquote(match["path"] or ""),
                           parse_qs(url.query), send_body)
            elif match := _MODEL.match(url.path):
                revision = unquote(match["rev"]) if match["rev"] else None
                self._model_info(hub, unquote(match["repo"]), revision, parse_qs(url.query), send_body)
            else:
                raise HubError(404, None, f"Not found: {url.path}")
        except HubError as error:
            self._error(error, send_body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-body

    @property
    def _authorized(self) -> bool:
        return self.headers.get("Authorization", "").startswith("Bearer ")

    def _resolve(self, hub: FakeHub, repo_id: str, revision: str, path: str, send_body: bool) -> None:
        repo = hub._repo(repo_id, revision, self._authorized)
        if repo.gated and not self._authorized:
            raise HubError(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                           "to it and be authenticated to access it. Please log in.")
        hub_file = repo.files.get(path)
        if hub_file is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on \"{revision}\"",
                           {"X-Repo-Commit": repo.commit})
        partial = self.headers.get("Range") is not None and not hub.ignores_ranges
        start, end = self._range(hub_file.size) if partial else (0, hub_file.size)
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   "Content-Length": str(end - start), "ETag": f'"{hub_file.etag}"',
                   "X-Repo-Commit": repo.commit}
        if hub_file.lfs:
            headers |= {"X-Linked-Etag": f'"{hub_file.etag}"', "X-Linked-Size": str(hub_file.size)}
        if partial:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{hub_file.size}"
        self._head(HTTPStatus.PARTIAL_CONTENT if partial else HTTPStatus.OK, headers)
        if send_body:
            self._stream(hub_file.source, start, end, hub._next_cut(repo_id, path))

    def _range(self, size: int) -> tuple[int, int]:
        """The bytes [start, end) the Range header asks for, or the whole file."""
        header = self.headers.get("Range")
        if header is None:
            return 0, size
        match = _RANGE.match(header.strip())
        if match is None or not (match["start"] or match["end"]):
            start, end = 0, 0
        elif not match["start"]:  # bytes=-N: the last N bytes
            start, end = max(size - int(match["end"]), 0), size
        else:
            start, end = int(match["start"]), min(int(match["end"] or size - 1) + 1, size)
        if start >= end:
            raise HubError(416, None, f"Range not satisfiable: {header} of {size} bytes",
                           {"Content-Range": f"bytes */{size}"})
        return start, end

    def _stream(self, source: bytes | Path, start: int, end: int, cut_after: int | None) -> None:
        stop = end if cut_after is None else min(end, start + cut_after)
        for chunk in _chunks(source, start, stop):
            self.wfile.write(chunk)
        if stop < end:  # the cut: the socket closes with the body short of its Content-Length
            self.wfile.flush()
            self.close_connection = True

    def _model_info(self, hub: FakeHub, repo_id: str, revision: str | None, query: dict,
                    send_body: bool) -> None:
        repo = hub._repo(repo_id, revision, self._authorized)
        with_blobs = query.get("blobs", [""])[0].lower() == "true"
        siblings = [_sibling(f, with_blobs) for f in sorted(repo.files.values(), key=lambda f: f.path)]
        self._json({"_id": repo.commit[:24], "id": repo_id, "modelId": repo_id, "sha": repo.commit,
                    "private": False, "gated": "auto" if repo.gated else False, "disabled": False,
                    "tags": ["gguf"], "siblings": siblings}, send_body)

    def _tree(self, hub: FakeHub, repo_id: str, revision: str, folder: str, query: dict,
              send_body: bool) -> None:
        repo = hub._repo(repo_id, revision, self._authorized)
        folder = folder.strip("/")
        folders = repo.folders()
        if folder and folder not in folders:
            raise HubError(404, "EntryNotFound", f"{folder} does not exist on \"{revision}\"",
                           {"X-Repo-Commit": repo.commit})
        recursive = query.get("recursive", [""])[0].lower() == "true"

        def listed(path: str) -> bool:
            parent = str(Path(path).parent) if "/" in path else ""
            inside = not folder or path.startswith(folder + "/")
            return inside and (recursive or parent == folder)

        entries = [{"type": "directory", "oid": hashlib.sha1(p.encode()).hexdigest(), "size": 0, "path": p}
                   for p in sorted(folders) if listed(p)]
        entries += [_tree_file(f) for p, f in sorted(repo.files.items()) if listed(p)]
        self._json(entries, send_body)

    def _json(self, payload: object, send_body: bool, status: int = 200, headers: dict | None = None) -> None:
        body = json.dumps(payload).encode()
        self._head(status, {"Content-Type": "application/json; charset=utf-8",
                            "Content-Length": str(len(body)), **(headers or {})})
        if send_body:
            self.wfile.write(body)

    def _error(self, error: HubError, send_body: bool) -> None:
        headers = {"X-Error-Message": error.message, **error.headers}
        if error.code:
            headers["X-Error-Code"] = error.code
        self._json({"error": error.message}, send_body, error.status, headers)

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()


def _sibling(hub_file: HubFile, with_blobs: bool) -> dict:
    if not with_blobs:
        return {"rfilename": hub_file.path}
    sibling = {"rfilename": hub_file.path, "size": hub_file.size, "blobId": hub_file.git_oid}
    if hub_file.lfs:
        sibling["lfs"] = {"sha256": hub_file.etag_sha256, "size": hub_file.size,
                          "pointerSize": len(hub_file.stored)}
    return sibling


def _tree_file(hub_file: HubFile) -> dict:
    entry = {"type": "file", "oid": hub_file.git_oid, "size": hub_file.size, "path": hub_file.path}
    if hub_file.lfs:
        entry["lfs"] = {"oid": hub_file.etag_sha256, "size": hub_file.size,
                        "pointerSize": len(hub_file.stored)}
    return entry


def _size(source: bytes | Path) -> int:
    return len(source) if isinstance(source, bytes) else source.stat().st_size


def _chunks(source: bytes | Path, start: int, end: int) -> Iterator[bytes]:
    """The bytes [start, end) of the source, CHUNK_BYTES at a time."""
    if isinstance(source, bytes):
        view = memoryview(source)
        for offset in range(start, end, CHUNK_BYTES):
            yield bytes(view[offset:min(offset + CHUNK_BYTES, end)])
        return
    with source.open("rb") as file:
        file.seek(start)
        for offset in range(start, end, CHUNK_BYTES):
            yield file.read(min(CHUNK_BYTES, end - offset))
