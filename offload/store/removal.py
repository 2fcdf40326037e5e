"""`tierflow rm`: a model in the Hugging Face cache removed, with the packs built from it.

Only the Hugging Face cache is tierflow's to change (pull.py writes there): a model that ollama or LM
Studio holds is theirs to remove, and a blob an ollama manifest names is never deleted, even where a
Hugging Face snapshot links to it.
"""

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tierflow.errors import ModelFileError, TierflowError
from tierflow.offload.gguf.split_files import split_parts
from tierflow.offload.pack.pack_cache import pack_path, remove_pack
from tierflow.offload.store.model_names import find_stored_model
from tierflow.offload.store.model_stores import OllamaStore, StoredModel

OTHER_TOOLS = {"ollama": "`ollama rm {name}`", "lmstudio": "LM Studio (or `lms rm`)"}


@dataclass(frozen=True)
class Removed:
    name: str
    files: tuple[Path, ...]  # the model's files deleted (blobs, or files a snapshot held)
    packs: tuple[Path, ...]
    kept: tuple[Path, ...]  # files another store still names, left in place
    nbytes: int  # freed


def remove_model(name: str) -> Removed:
    """Removes the model a name means from the Hugging Face cache: its snapshot's links, each blob
    no other snapshot links to, the packs built from them, and the repository's folder once empty."""
    model = find_stored_model(name)
    if model.source != "huggingface":
        how = OTHER_TOOLS.get(model.source, model.source).format(name=model.name)
        raise ModelFileError(f"{model.name} is {model.source}'s ({model.path}), not a model tierflow pulled: "
                             f"remove it with {how}")
    return _remove_from_hf_cache(model, _ollama_blobs())


def _remove_from_hf_cache(model: StoredModel, protected: set[str]) -> Removed:
    links = [path for path in split_parts(model.path) or [model.path] if os.path.lexists(path)]
    repo = _repo_folder(model.path)
    files, packs, kept, nbytes = [], [], [], 0
    for link in links:
        target = Path(os.path.realpath(link))
        if target.exists():
            pack = pack_path(target)
            if pack.exists():
                packs.append(pack)
                remove_pack(pack)
        _unlink(link)
        if not target.exists() or target == link:
            continue
        if str(target) in protected:
            kept.append(target)
        elif not _linked_from(repo, target):
            nbytes += target.stat().st_size
            _unlink(target)
            files.append(target)
    for link in links:
        _remove_empty_folders(link.parent, repo / "snapshots")
    if not any((repo / "snapshots").iterdir()):
        shutil.rmtree(repo, ignore_errors=True)
    return Removed(model.name, tuple(files), tuple(packs), tuple(kept), nbytes)


def _repo_folder(path: Path) -> Path:
    """models--Org--Model, above snapshots/<commit>/... ."""
    for parent in path.parents:
        if parent.name == "snapshots":
            return parent.parent
    raise ModelFileError(f"{path} is not in a Hugging Face cache snapshot")


def _linked_from(repo: Path, blob: Path) -> bool:
    """Whether another snapshot of the repository still links to the blob."""
    return any(Path(os.path.realpath(link)) == blob for link in (repo / "snapshots").rglob("*")
               if link.is_symlink())


def _ollama_blobs() -> set[str]:
    """The real paths of the blobs ollama's manifests name."""
    store = OllamaStore.default()
    blobs = set()
    for name in store.names():
        try:
            blobs |= {os.path.realpath(model.path) for model in store.find(name)}
        except ModelFileError:  # a damaged manifest protects nothing, and removes nothing either
            continue
    return blobs


def _remove_empty_folders(folder: Path, top: Path) -> None:
    while folder != top and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError as error:
        raise TierflowError(f"cannot remove {path} ({error.strerror or error})") from None
