"""`tierflow pull`: a model's GGUF files from a local stand-in for the Hugging Face hub (HF_ENDPOINT) into
the Hugging Face cache, checked by SHA-256, resumed when cut, refused with a reason when it cannot be."""

import hashlib
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.support.cli import run_tierflow
from tests.support.fake_hub import FakeHub, isolate_hub_client
from tierflow import Engine
from tierflow.errors import InvalidArgumentError, ModelFileError
from tierflow.offload.store import pull as pull_module
from tierflow.offload.store.model_path import find_or_pull, resolve_model_path
from tierflow.offload.store.pull import ATTEMPTS, pull
from tierflow.progress import LoadPhase

REPO = "Org/Model-GGUF"
Q4 = b"Q4_K_M weights " * 50_000  # 750 KB
Q8 = b"Q8_0 weights " * 90_000


def gets(hub: FakeHub, path: str) -> list:
    return [request for request in hub.requests if request.method == "GET" and request.path.endswith(path)]


@pytest.fixture
def hub(home, monkeypatch) -> FakeHub:
    """A local hub holding REPO, reached through HF_ENDPOINT; the cache in the empty HOME."""
    with FakeHub() as hub:
        hub.add_repo(REPO, {"model-Q4_K_M.gguf": Q4, "model-Q8_0.gguf": Q8, "README.md": b"# a model",
                            "mmproj-model-f16.gguf": b"vision"})
        isolate_hub_client(monkeypatch, hub)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("TIERFLOW_OFFLINE")
        yield hub


def cache(home: Path) -> Path:
    return home / ".cache" / "huggingface" / "hub" / "models--Org--Model-GGUF"


def test_a_pull_without_a_quant_takes_q4_k_m_into_the_hugging_face_cache(hub, home):
    pulled = pull(REPO)
    sha256 = hashlib.sha256(Q4).hexdigest()
    commit = (cache(home) / "refs" / "main").read_text()
    assert pulled.path == cache(home) / "snapshots" / commit / "model-Q4_K_M.gguf"
    assert pulled.path.resolve() == cache(home) / "blobs" / sha256
    assert pulled.path.read_bytes() == Q4 and pulled.downloaded_bytes == len(Q4)
    assert resolve_model_path(REPO) == pulled.path


@pytest.mark.parametrize("name", [f"{REPO}:Q8_0", f"{REPO}:q8_0", f"hf.co/{REPO}:Q8_0",
                                  f"huggingface.co/{REPO}:Q8_0", f"{REPO}/model-Q8_0.gguf"])
def test_a_quant_tag_or_a_file_name_picks_the_file(hub, name):
    assert pull(name).path.read_bytes() == Q8


def test_a_file_already_whole_in_the_cache_is_not_downloaded_again(hub):
    pull(REPO)
    again = pull(REPO)
    assert again.downloaded_bytes == 0 and len(gets(hub, "model-Q4_K_M.gguf")) == 1


def test_every_part_of_a_split_model_comes_down(hub):
    parts = {f"Q4_K_M/big-Q4_K_M-{no:05d}-of-00003.gguf": bytes([no]) * 1000 for no in (1, 2, 3)}
    hub.add_repo("Org/Big-GGUF", parts)
    pulled = pull("Org/Big-GGUF")
    assert pulled.path.name == "big-Q4_K_M-00001-of-00003.gguf"
    assert [(pulled.path.parent / Path(name).name).read_bytes() for name in parts] == list(parts.values())


def test_progress_reports_downloading_bytes_up_to_the_total(hub):
    seen = []
    pull(REPO, progress=lambda phase, done, total: seen.append((phase, done, total)))
    assert {phase for phase, _, _ in seen} == {LoadPhase.DOWNLOADING}
    assert seen[-1][1:] == (len(Q4), len(Q4))
    assert [done for _, done, _ in seen] == sorted(done for _, done, _ in seen)


def test_a_transfer_cut_midway_resumes_with_a_range_request(hub):
    hub.cut_transfer(REPO, "model-Q4_K_M.gguf", after_bytes=300_000)
    assert pull(REPO).path.read_bytes() == Q4
    assert [request.range for request in gets(hub, "model-Q4_K_M.gguf")] == [None, "bytes=300000-"]


def test_a_pull_cut_for_good_leaves_no_file_a_load_could_take_and_the_next_pull_resumes(hub):
    hub.cut_transfer(REPO, "model-Q4_K_M.gguf", after_bytes=100_000, times=ATTEMPTS)
    with pytest.raises(ModelFileError, match="cut 5 times.*pull again to resume"):
        pull(REPO)
    with pytest.raises(ModelFileError, match="model not found"):
        resolve_model_path(REPO)
    assert pull(REPO).path.read_bytes() == Q4
    assert gets(hub, "model-Q4_K_M.gguf")[-1].range == f"bytes={ATTEMPTS * 100_000}-"


def test_a_wrong_sha256_is_refused_and_nothing_is_kept(hub, home):
    named = hub.wrong_sha256(REPO, "model-Q4_K_M.gguf")
    with pytest.raises(ModelFileError, match=f"SHA-256 {hashlib.sha256(Q4).hexdigest()}, not the {named}"
                                             ".*nothing was kept"):
        pull(REPO)
    assert not list((cache(home) / "blobs").iterdir())
    assert not (cache(home) / "snapshots").exists()


def test_a_disk_without_room_is_refused_before_the_download_starts(hub, monkeypatch):
    monkeypatch.setattr(pull_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(ModelFileError, match="needs 732.4 KiB more and the disk of .* has 1000 B free"):
        pull(REPO)
    assert not gets(hub, ".gguf")


@pytest.mark.parametrize("name, message", [
    ("Org/Nothing-GGUF", "Org/Nothing-GGUF is not a model repository on http://127.0.0.1:.* HF_TOKEN"),
    (f"{REPO}:Q5_K_M", f"{REPO} has no Q5_K_M file; it has Q4_K_M, Q8_0: name one"),
    (f"{REPO}/other.gguf", "has no file other.gguf; its GGUF files: model-Q4_K_M.gguf, model-Q8_0.gguf"),
])
def test_a_repository_or_quant_that_does_not_exist_names_what_there_is(hub, name, message):
    with pytest.raises(ModelFileError, match=message):
        pull(name)


def test_a_repository_without_q4_k_m_or_one_model_asks_for_a_quant(hub):
    hub.add_repo("Org/Two", {"two-Q8_0.gguf": Q8, "two-F16.gguf": Q8})
    with pytest.raises(ModelFileError, match="no Q4_K_M .the default. file; it has F16, Q8_0"):
        pull("Org/Two")


def test_a_gated_repository_without_a_token_says_so(hub):
    hub.add_repo("Org/Gated", {"gated-Q4_K_M.gguf": Q4}, gated=True)
    with pytest.raises(ModelFileError, match="Org/Gated is gated: accept its terms .* set HF_TOKEN"):
        pull("Org/Gated")


def test_a_gated_repository_comes_down_with_hf_token(hub, monkeypatch):
    hub.add_repo("Org/Gated", {"gated-Q4_K_M.gguf": Q4}, gated=True)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    assert pull("Org/Gated").path.read_bytes() == Q4


def test_a_name_that_is_no_repository_is_refused(hub):
    with pytest.raises(InvalidArgumentError, match="not a Hugging Face model name"):
        pull("llama3:8b")


def test_offline_refuses_to_pull_and_a_load_says_it_did_not(hub, monkeypatch):
    monkeypatch.setenv("TIERFLOW_OFFLINE", "1")
    with pytest.raises(ModelFileError, match="offline .TIERFLOW_OFFLINE is set"):
        pull(REPO)
    with pytest.raises(ModelFileError, match="model not found.*offline, so it is not pulled"):
        find_or_pull(REPO)
    assert not hub.requests


def test_an_unreachable_hub_is_named(home, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("TIERFLOW_OFFLINE")
    with pytest.raises(ModelFileError, match="cannot reach http://127.0.0.1:9"):
        pull(REPO)


@pytest.fixture
def smol_hub(hub, model_path) -> FakeHub:
    hub.add_repo("Org/Smol-GGUF", {"smol-Q4_1.gguf": model_path})
    return hub


def test_a_pulled_model_runs_with_the_hub_stopped(smol_hub):
    pull("Org/Smol-GGUF")
    smol_hub.__exit__()
    with Engine.load("Org/Smol-GGUF", context_length=256) as engine:
        assert engine.generate("The capital of France is", max_tokens=3, temperature=0).text


def test_engine_load_pulls_a_hugging_face_name_not_on_the_disk_reporting_the_download(smol_hub, model_path):
    phases = []
    with Engine.load("Org/Smol-GGUF", context_length=256,
                     progress=lambda phase, done, total: phases.append(phase)) as engine:
        assert engine.path.read_bytes()[:4] == b"GGUF"
    assert phases[0] is LoadPhase.DOWNLOADING and phases[-1] is LoadPhase.LOADING


def test_tierflow_pull_says_what_it_pulled_and_where(hub, home):
    done = run_tierflow("pull", f"{REPO}:Q8_0")
    assert done.returncode == 0
    assert f"{REPO}/model-Q8_0.gguf" in done.stdout and "downloaded" in done.stdout


def test_tierflow_run_pulls_first_and_offline_refuses(smol_hub):
    refused = run_tierflow("run", "Hi", "-n", "2", "--offline", "-m", "Org/Smol-GGUF")
    assert refused.returncode == 2 and "offline, so it is not pulled" in refused.stderr
    done = run_tierflow("run", "Hi", "-n", "2", "--ctx", "256", "-m", "Org/Smol-GGUF")
    assert done.returncode == 0, done.stderr


def test_huggingface_hub_finds_a_pulled_file_without_downloading_it_again(hub, home):
    from huggingface_hub import hf_hub_download

    pulled = pull(REPO)
    shared = hf_hub_download(REPO, "model-Q4_K_M.gguf", endpoint=hub.url,
                             cache_dir=home / ".cache" / "huggingface" / "hub")
    assert Path(shared) == pulled.path and len(gets(hub, "model-Q4_K_M.gguf")) == 1


@pytest.mark.slow
def test_tierflow_serve_pulls_its_models_before_it_starts(smol_hub, home):
    from tests.support.live_server import serve_command

    with serve_command("-m", "Org/Smol-GGUF", "--ctx", "256") as url:
        served = httpx.get(f"{url}/v1/models").json()["data"]
    assert [model["id"] for model in served] == ["Org/Smol-GGUF"]
    assert resolve_model_path("Org/Smol-GGUF").read_bytes()[:4] == b"GGUF"


def test_a_server_that_ignores_the_range_gets_the_file_begun_again_and_checked(hub):
    hub.cut_transfer(REPO, "model-Q4_K_M.gguf", after_bytes=300_000)
    hub.ignores_ranges = True
    assert pull(REPO).path.read_bytes() == Q4
    assert [request.range for request in gets(hub, "model-Q4_K_M.gguf")] == [None, "bytes=300000-"]
