"""The fake hub (tests/support/fake_hub.py) as the real huggingface_hub sees it: downloads land in
the HF cache layout, listings read back, cut transfers resume, and the hub's failures raise the
library's own exceptions. No request leaves 127.0.0.1."""

import hashlib
import os
import subprocess
import sys
import types

import httpx2
import pytest
from huggingface_hub import HfApi, file_download, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.support.fake_hub import FakeHub, HubRequest, isolate_hub_client

REPO = "Org/Model-GGUF"
CHUNK = 10 << 20  # huggingface_hub's DOWNLOAD_CHUNK_SIZE: what a cut transfer keeps is whole chunks
MODEL = bytes(range(256)) * (12 << 12)  # 12 MiB, so that a cut past 10 MiB keeps one chunk
README = b"# Model\n"


@pytest.fixture
def hub(monkeypatch):
    with FakeHub() as hub:
        hub.add_repo(REPO, {"model-Q4_K_M.gguf": MODEL, "README.md": README, "sub/model-Q8_0.gguf": b"q8"})
        isolate_hub_client(monkeypatch, hub)
        yield hub


def download(hub, tmp_path, filename="model-Q4_K_M.gguf", repo=REPO, **kwargs):
    return hf_hub_download(repo, filename, endpoint=hub.url, cache_dir=tmp_path, **kwargs)


def test_a_gguf_downloads_into_the_cache_layout_named_by_its_sha256(hub, tmp_path):
    path = download(hub, tmp_path)
    sha256 = hashlib.sha256(MODEL).hexdigest()
    commit = (tmp_path / "models--Org--Model-GGUF" / "refs" / "main").read_text()
    assert path == str(tmp_path / "models--Org--Model-GGUF" / "snapshots" / commit / "model-Q4_K_M.gguf")
    assert (tmp_path / "models--Org--Model-GGUF" / "blobs" / sha256).read_bytes() == MODEL
    assert len(commit) == 40


def test_a_download_asks_head_then_one_get_without_range(hub, tmp_path):
    download(hub, tmp_path)
    url = f"/{REPO}/resolve/main/model-Q4_K_M.gguf"
    assert hub.requests == [HubRequest("HEAD", url, None), HubRequest("GET", url, None)]


def test_a_small_text_file_is_named_by_its_git_blob_id(hub, tmp_path):
    download(hub, tmp_path, "README.md")
    git_oid = hashlib.sha1(b"blob %d\0" % len(README) + README).hexdigest()
    assert (tmp_path / "models--Org--Model-GGUF" / "blobs" / git_oid).read_bytes() == README


def test_a_file_given_as_a_path_downloads_whole(hub, tmp_path):
    source = tmp_path / "source.gguf"
    source.write_bytes(MODEL[: 3 << 20])
    hub.add_repo("Org/FromDisk", {"model.gguf": source})
    path = download(hub, tmp_path / "cache", "model.gguf", repo="Org/FromDisk")
    assert open(path, "rb").read() == MODEL[: 3 << 20]


def test_a_range_request_answers_206_with_the_bytes_and_their_content_range(hub):
    url = f"{hub.url}/{REPO}/resolve/main/model-Q4_K_M.gguf"
    response = httpx2.get(url, headers={"Range": "bytes=100-199"})
    assert (response.status_code, response.headers["Content-Range"]) == (206, f"bytes 100-199/{len(MODEL)}")
    assert response.content == MODEL[100:200]
    assert httpx2.get(url, headers={"Range": f"bytes={len(MODEL)}-"}).status_code == 416


def test_list_repo_files_lists_the_repo_with_subfolders(hub):
    files = HfApi(endpoint=hub.url).list_repo_files(REPO)
    assert sorted(files) == ["README.md", "model-Q4_K_M.gguf", "sub/model-Q8_0.gguf"]


def test_model_info_with_files_metadata_gives_sizes_and_lfs_sha256(hub):
    info = HfApi(endpoint=hub.url).model_info(REPO, files_metadata=True)
    gguf = next(s for s in info.siblings if s.rfilename == "model-Q4_K_M.gguf")
    assert (gguf.size, gguf.lfs.size) == (len(MODEL), len(MODEL))
    assert gguf.lfs.sha256 == hashlib.sha256(MODEL).hexdigest()
    assert len(info.sha) == 40


def test_snapshot_download_fetches_the_allowed_files_at_the_commit(hub, tmp_path):
    folder = snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path, allow_patterns=["*.md", "sub/*"])
    assert {p.name for p in (tmp_path / folder).rglob("*") if p.is_file()} == {"README.md", "model-Q8_0.gguf"}


def test_a_cut_transfer_resumes_in_the_same_call_from_the_last_whole_chunk(hub, tmp_path):
    hub.cut_transfer(REPO, "model-Q4_K_M.gguf", after_bytes=CHUNK + 12345)
    path = download(hub, tmp_path)
    gets = [r.range for r in hub.requests if r.method == "GET"]
    assert gets == [None, f"bytes={CHUNK}-"]  # the 12345 bytes past the chunk were dropped and fetched again
    assert open(path, "rb").read() == MODEL


def test_a_call_out_of_retries_leaves_no_partial_file_and_the_next_starts_over(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda seconds: None))
    hub.cut_transfer(REPO, "model-Q4_K_M.gguf", after_bytes=0, times=6)  # the first try and 5 retries
    with pytest.raises(httpx2.RemoteProtocolError):
        download(hub, tmp_path)
    assert list((tmp_path / "models--Org--Model-GGUF" / "blobs").iterdir()) == []
    assert open(download(hub, tmp_path), "rb").read() == MODEL
    assert [r.range for r in hub.requests if r.method == "GET"] == [None] * 7


def test_the_library_keeps_a_file_whose_sha256_the_metadata_misnames(hub, tmp_path):
    named = hub.wrong_sha256(REPO, "model-Q4_K_M.gguf")
    path = download(hub, tmp_path)
    assert open(path, "rb").read() == MODEL
    assert (tmp_path / "models--Org--Model-GGUF" / "blobs" / named).exists()


def test_an_unknown_repo_raises_repository_not_found(hub, tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        download(hub, tmp_path, repo="Org/Missing")
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url).list_repo_files("Org/Missing")


def test_a_gated_repo_without_a_token_raises_gated_repo_error(hub, tmp_path):
    hub.add_repo("Org/Gated", {"model.gguf": b"gated"}, gated=True)
    with pytest.raises(GatedRepoError):
        download(hub, tmp_path, "model.gguf", repo="Org/Gated")


def test_a_gated_repo_serves_a_request_with_a_token(hub, tmp_path):
    hub.add_repo("Org/Gated", {"model.gguf": b"gated"}, gated=True)
    path = download(hub, tmp_path, "model.gguf", repo="Org/Gated", token="hf_test")
    assert open(path, "rb").read() == b"gated"


def test_an_unknown_file_raises_entry_not_found(hub, tmp_path):
    with pytest.raises(RemoteEntryNotFoundError):
        download(hub, tmp_path, "model-Q2_K.gguf")


def test_an_unknown_revision_raises_revision_not_found(hub, tmp_path):
    with pytest.raises(RevisionNotFoundError):
        download(hub, tmp_path, revision="v9")


def test_hf_endpoint_is_read_once_when_huggingface_hub_is_imported(hub, tmp_path):
    script = (f"from huggingface_hub import hf_hub_download as get\n"
              f"print(open(get({REPO!r}, 'README.md', cache_dir={str(tmp_path)!r}), 'rb').read())")
    env = {name: value for name, value in os.environ.items() if not name.startswith(("HF_", "HUGGING"))}
    env |= {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(tmp_path / "hf-home")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == repr(README), result.stderr
