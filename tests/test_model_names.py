"""Models by name: fake ollama, Hugging Face and LM Studio stores in a temporary HOME, resolved as `-m` and
`Engine.load` resolve them, and listed by `tierflow list`."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.support.cli import run_tierflow
from tests.support.gguf_split import split_gguf
from tests.support.stores import DIGEST, OTHER_DIGEST, add_hf, add_ollama, hf_hub, ollama_root, put
from tierflow.cli.app import app
from tierflow.errors import ModelFileError
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.store.model_path import resolve_model_path

# ollama


def test_an_ollama_name_resolves_to_its_model_blob(home):
    blob = add_ollama(ollama_root(home), "registry.ollama.ai/library/llama3/8b")
    assert resolve_model_path("llama3:8b") == blob


def test_an_ollama_name_without_a_tag_means_latest(home):
    blob = add_ollama(ollama_root(home), "registry.ollama.ai/library/qwen3/latest")
    assert resolve_model_path("qwen3") == blob


@pytest.mark.parametrize("name, manifest", [
    ("library/llama3:8b", "registry.ollama.ai/library/llama3/8b"),
    ("someone/tiny:q4", "registry.ollama.ai/someone/tiny/q4"),
    ("example.com/team/model:v1", "example.com/team/model/v1"),
    ("hf.co/Org/Model-GGUF:Q4_K_M", "hf.co/Org/Model-GGUF/Q4_K_M"),
])
def test_an_ollama_name_with_a_namespace_or_registry_resolves(home, name, manifest):
    blob = add_ollama(ollama_root(home), manifest)
    assert resolve_model_path(name) == blob


def test_ollama_models_variable_moves_the_ollama_store(home, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "elsewhere"))
    blob = add_ollama(tmp_path / "elsewhere", "registry.ollama.ai/library/phi3/mini")
    assert resolve_model_path("phi3:mini") == blob


def test_an_ollama_manifest_pointing_at_a_missing_blob_names_the_digest_and_the_path(home):
    blob = add_ollama(ollama_root(home), "registry.ollama.ai/library/llama3/8b")
    blob.unlink()
    with pytest.raises(ModelFileError, match=f"sha256:{DIGEST}.*missing.*{blob}"):
        resolve_model_path("llama3:8b")


@pytest.mark.parametrize("text", ['{"layers": [', "[" * 100_000])
def test_an_ollama_manifest_that_is_not_json_is_named(home, text):
    manifest = ollama_root(home) / "manifests/registry.ollama.ai/library/llama3/8b"
    put(manifest).write_text(text)
    with pytest.raises(ModelFileError, match=f"{manifest} is not valid JSON"):
        resolve_model_path("llama3:8b")


@pytest.mark.parametrize("text", ['{"layers": [{"mediaType": "application/vnd.ollama.image.license"}]}',
                                  '["layers"]', '{"layers": {"digest": "sha256:00"}}'])
def test_an_ollama_manifest_without_a_model_layer_is_named(home, text):
    manifest = ollama_root(home) / "manifests/registry.ollama.ai/library/llama3/8b"
    put(manifest).write_text(text)
    with pytest.raises(ModelFileError, match="no model layer"):
        resolve_model_path("llama3:8b")


def test_an_ollama_digest_that_is_not_sha256_hex_is_named(home):
    manifest = ollama_root(home) / "manifests/registry.ollama.ai/library/llama3/8b"
    put(manifest).write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:../../../etc/passwd"}]}))
    with pytest.raises(ModelFileError, match="is not sha256:<64 hex digits>"):
        resolve_model_path("llama3:8b")


# Hugging Face cache and LM Studio


def test_a_hugging_face_repo_resolves_to_its_one_gguf_file_not_its_vision_projector(home):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model-Q4_K_M.gguf": None, "mmproj-f16.gguf": None})
    assert resolve_model_path("Org/Model-GGUF") == snapshot / "model-Q4_K_M.gguf"


@pytest.mark.parametrize("name", ["Org/Model-GGUF:Q4_K_M", "Org/Model-GGUF:q4_k_m",
                                  "hf.co/Org/Model-GGUF:Q4_K_M"])
def test_a_quant_tag_picks_the_file_case_insensitively(home, name):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model-Q4_K_M.gguf": None, "model-Q8_0.gguf": None})
    assert resolve_model_path(name) == snapshot / "model-Q4_K_M.gguf"


def test_a_quant_tag_matches_a_whole_token_only(home):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model-Q4_K_M.gguf": None, "model-Q4_K.gguf": None})
    assert resolve_model_path("Org/Model-GGUF:Q4_K") == snapshot / "model-Q4_K.gguf"


def test_a_file_of_a_repo_resolves_by_its_name(home):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model-Q4_K_M.gguf": None, "model-Q8_0.gguf": None})
    assert resolve_model_path("Org/Model-GGUF/model-Q8_0.gguf") == snapshot / "model-Q8_0.gguf"


def test_the_revision_refs_main_names_is_chosen_over_a_newer_snapshot(home):
    current = add_hf(hf_hub(home), "Org/Model-GGUF", {"current.gguf": None}, revision="aaa")
    newer = add_hf(hf_hub(home), "Org/Model-GGUF", {"newer.gguf": None}, revision="bbb")
    (newer.parent.parent / "refs" / "main").write_text("aaa\n")
    assert resolve_model_path("Org/Model-GGUF") == current / "current.gguf"


def test_a_refs_main_that_is_a_path_is_not_followed(home, tmp_path):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model.gguf": None})
    put(tmp_path / "elsewhere" / "other.gguf")
    outside = os.path.relpath(tmp_path / "elsewhere", snapshot.parent)
    (snapshot.parent.parent / "refs" / "main").write_text(outside)
    assert resolve_model_path("Org/Model-GGUF") == snapshot / "model.gguf"


@pytest.mark.parametrize("variable, value, hub", [("HF_HOME", "hf", "hf/hub"),
                                                  ("HF_HUB_CACHE", "cache", "cache")])
def test_hugging_face_variables_move_the_cache(home, tmp_path, monkeypatch, variable, value, hub):
    monkeypatch.setenv(variable, str(tmp_path / value))
    snapshot = add_hf(tmp_path / hub, "Org/Model-GGUF", {"model.gguf": None})
    assert resolve_model_path("Org/Model-GGUF") == snapshot / "model.gguf"


@pytest.mark.parametrize("root", [".lmstudio/models", ".cache/lm-studio/models"])
def test_an_lm_studio_model_resolves(home, root):
    path = put(home / root / "Org" / "Model-GGUF" / "model-Q4_K_M.gguf")
    assert resolve_model_path("Org/Model-GGUF:Q4_K_M") == path


def test_several_gguf_files_and_no_quant_is_an_error_listing_them(home):
    add_hf(hf_hub(home), "Org/Model-GGUF", {"model-Q4_K_M.gguf": None, "model-Q8_0.gguf": None})
    with pytest.raises(ModelFileError, match="matches 2 models.*model-Q4_K_M.gguf.*model-Q8_0.gguf"):
        resolve_model_path("Org/Model-GGUF")


def test_a_name_held_by_two_stores_is_an_error_listing_both(home):
    add_hf(hf_hub(home), "Org/Model-GGUF", {"model.gguf": None})
    put(home / ".lmstudio/models/Org/Model-GGUF/model.gguf")
    with pytest.raises(ModelFileError, match=r"matches 2 models.*huggingface.*lmstudio"):
        resolve_model_path("Org/Model-GGUF")


def test_the_same_file_in_two_stores_is_one_model(home, model_path):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model.gguf": model_path})
    put(home / ".lmstudio/models/Org/Model-GGUF/model.gguf", model_path)
    assert resolve_model_path("Org/Model-GGUF") == snapshot / "model.gguf"


def test_an_unknown_name_lists_close_matches_and_the_places_looked(home):
    add_ollama(ollama_root(home), "registry.ollama.ai/library/llama3/8b")
    with pytest.raises(ModelFileError) as raised:
        resolve_model_path("llama3:7b")
    message = str(raised.value)
    assert "close matches: llama3:8b" in message and str(ollama_root(home)) in message
    assert str(hf_hub(home)) in message and ".lmstudio" in message and "\n" not in message


def test_a_symlink_loop_in_the_hugging_face_cache_is_named(home):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model.gguf": None})
    blob = (snapshot / "model.gguf").resolve()
    blob.unlink()
    blob.symlink_to(snapshot / "model.gguf")
    with pytest.raises(ModelFileError, match="symlink loop"):
        resolve_model_path("Org/Model-GGUF")


def test_a_symlink_loop_given_as_a_path_is_named(tmp_path):
    (tmp_path / "a.gguf").symlink_to(tmp_path / "b.gguf")
    (tmp_path / "b.gguf").symlink_to(tmp_path / "a.gguf")
    with pytest.raises(ModelFileError, match=f"{tmp_path / 'a.gguf'} is a symlink loop"):
        resolve_model_path(tmp_path / "a.gguf")


def test_a_hugging_face_file_whose_blob_is_gone_is_named(home):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model.gguf": None})
    (snapshot / "model.gguf").resolve().unlink()
    with pytest.raises(ModelFileError, match="model.gguf is a symlink to .*blobs.*which is missing"):
        resolve_model_path("Org/Model-GGUF")


@pytest.mark.parametrize("given", ["model.safetensors", "folder"])
def test_safetensors_given_as_the_model_is_told_to_convert(tmp_path, given):
    put(tmp_path / "folder" / "model.safetensors")
    put(tmp_path / "model.safetensors")
    with pytest.raises(ModelFileError, match="safetensors.*convert_hf_to_gguf.py"):
        resolve_model_path(tmp_path / given)


def test_a_repo_of_safetensors_only_is_told_to_convert(home):
    add_hf(hf_hub(home), "Org/Model", {"model.safetensors": None, "config.json": None})
    with pytest.raises(ModelFileError, match="safetensors.*convert_hf_to_gguf.py"):
        resolve_model_path("Org/Model")


def test_a_missing_path_is_still_not_found(home):
    with pytest.raises(ModelFileError, match="model file not found: .*nothing.gguf"):
        resolve_model_path("nothing.gguf")


# split models


def split_repo(home: Path, parts: list[int]) -> Path:
    files = {f"Q4_K_M/model-Q4_K_M-{no:05d}-of-00003.gguf": None for no in parts}
    return add_hf(hf_hub(home), "Org/Big-GGUF", files | {"model-Q8_0.gguf": None})


def test_a_split_model_is_one_model_named_by_its_first_part(home):
    snapshot = split_repo(home, [1, 2, 3])
    first = snapshot / "Q4_K_M/model-Q4_K_M-00001-of-00003.gguf"
    assert resolve_model_path("Org/Big-GGUF:Q4_K_M") == first


def test_a_later_part_given_as_a_path_means_the_first_part(home):
    snapshot = split_repo(home, [1, 2, 3])
    later = snapshot / "Q4_K_M/model-Q4_K_M-00003-of-00003.gguf"
    assert resolve_model_path(later) == snapshot / "Q4_K_M/model-Q4_K_M-00001-of-00003.gguf"


def test_a_split_model_with_a_missing_part_names_it(home):
    snapshot = split_repo(home, [1, 3])
    missing = snapshot / "Q4_K_M/model-Q4_K_M-00002-of-00003.gguf"
    with pytest.raises(ModelFileError, match=f"{missing} is missing"):
        resolve_model_path("Org/Big-GGUF:Q4_K_M")


def test_a_split_model_loads_whole_and_generates_as_the_single_file_does(tmp_path, model_path, engine):
    from tierflow import Engine

    parts = split_gguf(model_path, tmp_path / "smollm2", 3)
    prompt = "The capital of France is"
    with Engine.load(parts[0], threads=2, context_length=1024) as split_engine:
        tokens = split_engine.generate(prompt, max_tokens=8, temperature=0).tokens
    assert tokens == engine.generate(prompt, max_tokens=8, temperature=0).tokens


@pytest.mark.slow
def test_a_split_model_converts_to_one_file_without_split_keys(tmp_path, model_path):
    from tierflow.offload.gguf.convert import convert_model
    from tierflow.offload.gguf.reader import read_gguf

    parts = split_gguf(model_path, tmp_path / "smollm2", 2)
    convert_model(parts[0], tmp_path / "whole.gguf", 4, "rtn")
    with read_gguf(tmp_path / "whole.gguf") as whole, read_gguf(model_path) as source:
        assert not any(key.startswith("split.") for key in whole.metadata)
        assert list(whole.tensors) == list(source.tensors)


def test_a_changed_later_part_changes_the_identity_a_pack_is_kept_by(tmp_path, model_path):
    from tierflow.offload.pack.writer import source_identity

    parts = split_gguf(model_path, tmp_path / "smollm2", 2)
    before = source_identity(parts[0])
    os.utime(parts[1], ns=(0, parts[1].stat().st_mtime_ns + 10**9))
    assert source_identity(parts[0]) != before


def test_a_split_part_that_is_not_the_part_its_name_says_is_named(tmp_path, model_path):
    parts = split_gguf(model_path, tmp_path / "smollm2", 3)
    parts[1].rename(tmp_path / "swap")
    parts[2].rename(parts[1])
    (tmp_path / "swap").rename(parts[2])
    with pytest.raises(ModelFileError, match="00002-of-00003.gguf: split.no is 2 .* named as part 2 of 3"):
        open_model_file(parts[0])


# loading and listing


def test_engine_load_runs_a_model_named_by_ollama(home, model_path):
    from tierflow import Engine

    add_ollama(ollama_root(home), "registry.ollama.ai/library/smollm2/135m", model_path)
    with Engine.load("smollm2:135m", threads=2, context_length=256) as engine:
        result = engine.generate("The capital of France is", max_tokens=2, temperature=0)
    assert result.stats.generated_tokens == 2


def full_stores(home: Path, model_path: Path) -> None:
    add_ollama(ollama_root(home), "registry.ollama.ai/library/smollm2/135m", model_path)
    add_hf(hf_hub(home), "Org/Model-GGUF", {"model-Q4_1.gguf": model_path})
    put(home / ".lmstudio/models/Org/Other-GGUF/other-Q4_1.gguf", model_path)


def test_list_json_shows_every_store_model_with_its_header(home, model_path):
    full_stores(home, model_path)
    done = CliRunner().invoke(app, ["list", "--json"])
    assert done.exit_code == 0, done.output
    listed = {(entry["name"], entry["source"]): entry for entry in json.loads(done.stdout)}
    assert set(listed) == {("smollm2:135m", "ollama"), ("Org/Model-GGUF", "huggingface"),
                           ("Org/Other-GGUF", "lmstudio")}
    for entry in listed.values():
        assert entry["architecture"] == "llama" and entry["weight_type"] == "Q4_1" and entry["error"] is None
        assert entry["size_bytes"] == model_path.stat().st_size


def test_list_shows_a_model_it_cannot_read_with_its_error(home, model_path):
    full_stores(home, model_path)
    put(ollama_root(home) / "manifests/registry.ollama.ai/library/broken/latest").write_text("not json")
    add_hf(hf_hub(home), "Org/Junk-GGUF", {"junk.gguf": None})
    done = CliRunner().invoke(app, ["list", "--json"])
    assert done.exit_code == 0, done.output
    errors = {entry["name"]: entry["error"] for entry in json.loads(done.stdout)}
    assert "not valid JSON" in errors["broken:latest"] and "junk.gguf" in errors["Org/Junk-GGUF"]
    assert errors["smollm2:135m"] is None


def test_list_counts_every_part_of_a_split_model(home, model_path):
    snapshot = hf_hub(home) / "models--Org--Big-GGUF/snapshots/main0rev"
    snapshot.mkdir(parents=True)
    (hf_hub(home) / "models--Org--Big-GGUF/refs").mkdir()
    (hf_hub(home) / "models--Org--Big-GGUF/refs/main").write_text("main0rev")
    parts = split_gguf(model_path, snapshot / "smollm2", 2)
    done = CliRunner().invoke(app, ["list", "--json"])
    [entry] = json.loads(done.stdout)
    assert entry["name"] == "Org/Big-GGUF" and entry["path"] == str(parts[0]) and entry["error"] is None
    assert entry["size_bytes"] == sum(part.stat().st_size for part in parts)


def test_list_prints_a_table_of_the_models(home, model_path):
    full_stores(home, model_path)
    done = CliRunner().invoke(app, ["list"])
    assert done.exit_code == 0, done.output
    assert "smollm2:135m" in done.stdout and "Org/Other-GGUF" in done.stdout and "Q4_1" in done.stdout


def bad_stores(home: Path) -> None:
    """One store of each bad kind, each under a name of its own."""
    root = ollama_root(home)
    add_ollama(root, "registry.ollama.ai/library/gone/latest", digest=OTHER_DIGEST).unlink()
    put(root / "manifests/registry.ollama.ai/library/notjson/latest").write_text("{")
    loop = add_hf(hf_hub(home), "Org/Loop-GGUF", {"loop.gguf": None}) / "loop.gguf"
    loop.resolve().unlink()
    loop.resolve().symlink_to(loop)
    add_hf(hf_hub(home), "Org/Two-GGUF", {"a-Q4_0.gguf": None, "b-Q8_0.gguf": None})
    add_hf(hf_hub(home), "Org/Weights", {"model.safetensors": None})


@pytest.mark.parametrize("name, message", [
    ("gone", f"sha256:{OTHER_DIGEST}"), ("notjson", "not valid JSON"), ("Org/Loop-GGUF", "symlink loop"),
    ("Org/Two-GGUF", "matches 2 models"), ("Org/Weights", "convert_hf_to_gguf.py"),
    ("Org/Nothing", "model not found"),
])
def test_a_bad_model_name_is_one_line_on_stderr_and_exit_code_2(home, name, message):
    bad_stores(home)
    done = run_tierflow("run", "hi", "-m", name)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
