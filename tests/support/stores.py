"""Model stores on a temporary disk, as ollama, huggingface_hub and LM Studio lay them out: what the
model-name, pull and removal tests resolve, list and remove."""

import json
import os
from pathlib import Path

DIGEST = "ab" * 32
OTHER_DIGEST = "cd" * 32


def put(path: Path, source: Path | None = None) -> Path:
    """A file at path: a symlink to source, or a few distinct bytes (resolution never reads them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if source is None:
        path.write_bytes(b"GGUF" + str(path).encode())
    else:
        path.symlink_to(source)
    return path


def add_ollama(root: Path, manifest_parts: str, blob_source: Path | None = None,
               digest: str = DIGEST) -> Path:
    """A manifest at manifests/<manifest_parts> whose model layer is blob sha256-<digest>; returns the
    blob."""
    manifest = {"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "ef" * 32, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1}]}
    path = root / "manifests" / manifest_parts
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    blob = root / "blobs" / f"sha256-{digest}"
    if not blob.exists():
        put(blob, blob_source)
    return blob


def add_hf(hub: Path, repo: str, files: dict[str, Path | None], revision: str = "main0rev") -> Path:
    """A cached repository: files in snapshots/<revision>/, each a relative symlink into blobs/, and
    refs/main naming the revision; returns the snapshot folder."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / revision
    for name, source in files.items():
        blob = put(folder / "blobs" / f"{revision}-{name.replace('/', '_')}", source)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    return snapshot


def ollama_root(home: Path) -> Path:
    return home / ".ollama" / "models"


def hf_hub(home: Path) -> Path:
    return home / ".cache" / "huggingface" / "hub"
