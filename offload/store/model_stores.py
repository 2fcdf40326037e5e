"""Where other tools keep GGUF files: ollama's manifests and blobs, the Hugging Face cache, LM Studio's
folders.

Each store answers from the file system alone (nothing is downloaded) which names it holds (`names`)
and which files a name means (`find`). A name a store cannot hold is simply not found there; a
store's own damage (a manifest that is not JSON, a blob that is gone) is a ModelFileError.
"""

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tierflow.errors import ModelFileError
from tierflow.offload.gguf.split_files import first_part, is_later_part

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
MAX_MANIFEST_BYTES = 1 << 20  # real manifests are a few hundred bytes
MAX_REVISION_BYTES = 256  # refs/main holds a 40-character commit hash
HF_HOSTS = ("hf.co/", "huggingface.co/")
# One component of a name: no separators, and never "." or ".." (names become paths).
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class StoredModel:
    name: str  # as the user would type it
    source: str  # "ollama", "huggingface" or "lmstudio"
    path: Path  # the GGUF file; for a split model, its first part


def _valid_parts(parts: list[str]) -> bool:
    return all(_PART.fullmatch(part) for part in parts)


class OllamaStore:
    """ollama's store: manifests/<registry>/<namespace>/<model>/<tag> name a blob in blobs/."""

    source = "ollama"

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def default(cls) -> "OllamaStore":
        return cls(Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models"))

    @property
    def places(self) -> list[Path]:
        return [self.root]

    def names(self) -> list[str]:
        manifests = self.root / "manifests"
        return sorted(_ollama_name(*tag.relative_to(manifests).parts)
                      for tag in manifests.glob("*/*/*/*") if tag.is_file())

    def find(self, name: str) -> list[StoredModel]:
        parts = _ollama_parts(name)
        if parts is None:
            return []
        manifest = self.root.joinpath("manifests", *parts)
        if not manifest.is_file():
            return []
        digest = _model_digest(manifest)
        blob = self.root / "blobs" / f"sha256-{digest}"
        if not os.path.lexists(blob):
            raise ModelFileError(f"ollama model {name}: its manifest {manifest} points at blob "
                                 f"sha256:{digest}, which is missing ({blob})")
        return [StoredModel(_ollama_name(*parts), self.source, blob)]


def _ollama_parts(name: str) -> list[str] | None:
    """[registry, namespace, model, tag] for `[registry/][namespace/]model[:tag]`, or None."""
    path, _, tag = name.partition(":")
    parts = path.split("/")
    if ":" in tag or not 1 <= len(parts) <= 3:
        return None
    parts = [OLLAMA_REGISTRY, OLLAMA_NAMESPACE][:3 - len(parts)] + parts + [tag or "latest"]
    return parts if _valid_parts(parts) else None


def _ollama_name(registry: str, namespace: str, model: str, tag: str) -> str:
    if registry != OLLAMA_REGISTRY:
        return f"{registry}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"


def _read_manifest(manifest: Path) -> object:
    """The manifest's JSON document; a deeply nested one is refused, not a RecursionError."""
    try:
        if manifest.stat().st_size > MAX_MANIFEST_BYTES:
            raise ModelFileError(f"ollama manifest {manifest} is larger than {MAX_MANIFEST_BYTES} bytes")
        return json.loads(manifest.read_bytes())
    except OSError as error:
        raise ModelFileError(f"cannot read ollama manifest {manifest}: {error.strerror or error}") from None
    except (ValueError, RecursionError) as error:
        raise ModelFileError(f"ollama manifest {manifest} is not valid JSON ({error})") from None


def _model_digest(manifest: Path) -> str:
    """The hex digest of the manifest's model layer."""
    document = _read_manifest(manifest)
    layers = document.get("layers") if isinstance(document, dict) else None
    digests = [layer.get("digest") for layer in layers if isinstance(layer, dict)
               and layer.get("mediaType") == OLLAMA_MODEL_LAYER] if isinstance(layers, list) else []
    if not digests:
        raise ModelFileError(f"ollama manifest {manifest} has no model layer ({OLLAMA_MODEL_LAYER})")
    found = _DIGEST.fullmatch(digests[0]) if isinstance(digests[0], str) else None
    if found is None:
        raise ModelFileError(f"ollama manifest {manifest}: the model layer's digest {digests[0]!r} is not "
                             "sha256:<64 hex digits>")
    return found.group(1)


@dataclass(frozen=True)
class RepoName:
    """`Org/Model`, `Org/Model:QUANT` or `Org/Model/file.gguf` (optionally after hf.co/)."""

    org: str
    model: str
    quant: str | None = None
    file: str | None = None  # relative to the repository

    @classmethod
    def parse(cls, name: str) -> "RepoName | None":
        for host in HF_HOSTS:
            name = name.removeprefix(host)
        path, _, quant = name.partition(":")
        parts = path.split("/")
        if len(parts) < 2 or not _valid_parts(parts) or ":" in quant or (quant and len(parts) > 2):
            return None
        return cls(parts[0], parts[1], quant or None, "/".join(parts[2:]) or None)


def models_in(folder: Path) -> list[Path]:
    """The GGUF models in a repository folder: vision projectors left out, a split model once (its first
    part, whether or not that part is there)."""
    files = {first_part(path) for path in folder.rglob("*.gguf") if "mmproj" not in path.name.lower()}
    return sorted(path for path in files if not is_later_part(path))


def matches_quant(file_name: str, quant: str) -> bool:
    """The quant tag appears in the file name as a whole token (Q4_K matches Q4_K.gguf, not Q4_K_M)."""
    token = rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])"
    return re.search(token, file_name, re.IGNORECASE) is not None


def select_models(folder: Path, repo: RepoName) -> list[Path]:
    """The files of a repository folder that a name means."""
    if repo.file is not None:
        path = folder / repo.file
        return [first_part(path)] if os.path.lexists(path) else []
    models = models_in(folder)
    return [path for path in models if matches_quant(path.name, repo.quant)] if repo.quant else models


class RepoStore:
    """Folders of GGUF files by repository: the Hugging Face cache (`models--Org--Model/snapshots/<rev>/`,
    files linked into `blobs/`) or LM Studio's `Org/Model/` folders."""

    def __init__(self, source: str, roots: list[Path], list_repos: Callable) -> None:
        self.source, self.roots, self.list_repos = source, roots, list_repos

    @property
    def places(self) -> list[Path]:
        return self.roots

    def folders(self) -> dict[tuple[str, str], Path]:
        """Every repository's folder, by (org, model)."""
        found = {}
        for root in self.roots:
            for org_model, folder in self.list_repos(root):
                found.setdefault(org_model, folder)
        return found

    def names(self) -> list[str]:
        names = []
        for (org, model), folder in sorted(self.folders().items()):
            models = models_in(folder)
            names += [f"{org}/{model}"] if len(models) == 1 else [
                f"{org}/{model}/{path.relative_to(folder)}" for path in models]
        return names

    def find(self, name: str) -> list[StoredModel]:
        repo = RepoName.parse(name)
        folder = self.folders().get((repo.org, repo.model)) if repo else None
        if folder is None:
            return []
        if repo.file is None and not models_in(folder):
            refuse_safetensors(folder)
        return [StoredModel(f"{repo.org}/{repo.model}/{path.relative_to(folder)}", self.source, path)
                for path in select_models(folder, repo)]


def refuse_safetensors(path: Path) -> None:
    """A safetensors file or a folder of them is a model tierflow could run once it is converted."""
    if path.suffix.lower() == ".safetensors" or path.is_dir() and any(path.glob("*.safetensors")):
        raise ModelFileError(f"{path} holds safetensors weights, not GGUF: convert it to GGUF with "
                             "llama.cpp's convert_hf_to_gguf.py")


def _hf_repos(hub: Path) -> Iterator[tuple[tuple[str, str], Path]]:
    for repo in hub.glob("models--*--*"):
        org, _, model = repo.name.removeprefix("models--").partition("--")
        snapshot = _hf_snapshot(repo)
        if snapshot is not None:
            yield (org, model), snapshot


def _hf_snapshot(repo: Path) -> Path | None:
    """The revision refs/main names, else the newest snapshot."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        with open(ref, "rb") as file:
            revision = file.read(MAX_REVISION_BYTES).decode(errors="replace").strip()
        snapshot = repo / "snapshots" / revision
        if _PART.fullmatch(revision) and snapshot.is_dir():  # a revision, never a path elsewhere
            return snapshot
    snapshots = [path for path in (repo / "snapshots").glob("*") if path.is_dir()]
    return max(snapshots, key=lambda path: path.stat().st_mtime, default=None)


def _lmstudio_repos(root: Path) -> Iterator[tuple[tuple[str, str], Path]]:
    for folder in root.glob("*/*"):
        if folder.is_dir():
            yield (folder.parent.name, folder.name), folder


def hf_hub() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def default_stores() -> list:
    """This user's stores, where the environment (HOME, OLLAMA_MODELS, HF_HOME, HF_HUB_CACHE) puts them."""
    lmstudio = [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]
    return [OllamaStore.default(), RepoStore("huggingface", [hf_hub()], _hf_repos),
            RepoStore("lmstudio", lmstudio, _lmstudio_repos)]
