"""`tierflow rm`: a model in the Hugging Face cache removed with its packs; ollama's and LM Studio's models,
and any blob an ollama manifest names, never touched."""

import os

import pytest

from tests.support.cli import run_tierflow
from tests.support.stores import add_hf, add_ollama, hf_hub, ollama_root, put
from tierflow.errors import ModelFileError
from tierflow.offload.pack.pack_cache import pack_path
from tierflow.offload.store.removal import remove_model


def test_removing_a_cached_model_deletes_its_link_its_blob_and_the_empty_repository(home):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model-Q4_K_M.gguf": None})
    blob = (snapshot / "model-Q4_K_M.gguf").resolve()
    removed = remove_model("Org/Model-GGUF")
    assert removed.files == (blob,) and removed.nbytes > 0
    assert not os.path.lexists(snapshot / "model-Q4_K_M.gguf") and not blob.exists()
    assert not (hf_hub(home) / "models--Org--Model-GGUF").exists()


def test_removing_one_quant_keeps_the_repositorys_other_files(home):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model-Q4_K_M.gguf": None, "model-Q8_0.gguf": None})
    remove_model("Org/Model-GGUF:Q4_K_M")
    assert not os.path.lexists(snapshot / "model-Q4_K_M.gguf")
    assert (snapshot / "model-Q8_0.gguf").resolve().is_file()


def test_removing_a_split_model_deletes_every_part(home):
    files = {f"Q4_K_M/model-Q4_K_M-{no:05d}-of-00002.gguf": None for no in (1, 2)}
    snapshot = add_hf(hf_hub(home), "Org/Big-GGUF", files | {"model-Q8_0.gguf": None})
    removed = remove_model("Org/Big-GGUF:Q4_K_M")
    assert len(removed.files) == 2
    assert not (snapshot / "Q4_K_M").exists()


def test_removing_a_model_removes_the_pack_built_from_it(home):
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model.gguf": None})
    pack = put(pack_path((snapshot / "model.gguf").resolve()))
    removed = remove_model("Org/Model-GGUF")
    assert removed.packs == (pack,) and not pack.exists()


def test_a_blob_another_snapshot_still_links_is_kept(home):
    hub = hf_hub(home)
    old = add_hf(hub, "Org/Model-GGUF", {"model.gguf": None}, revision="old")
    blob = (old / "model.gguf").resolve()
    new = hub / "models--Org--Model-GGUF" / "snapshots" / "new"
    new.mkdir(parents=True)
    (new / "model.gguf").symlink_to(os.path.relpath(blob, new))
    (hub / "models--Org--Model-GGUF" / "refs" / "main").write_text("new")
    remove_model("Org/Model-GGUF")
    assert blob.is_file()


def test_a_blob_an_ollama_manifest_names_is_never_deleted(home):
    blob = add_ollama(ollama_root(home), "registry.ollama.ai/library/llama3/8b")
    snapshot = add_hf(hf_hub(home), "Org/Model-GGUF", {"model.gguf": blob})
    removed = remove_model("Org/Model-GGUF")
    assert removed.kept == (blob,) and removed.files == ()
    assert blob.is_file() and not os.path.lexists(snapshot / "model.gguf")


@pytest.mark.parametrize("name, how", [("llama3:8b", "ollama rm llama3:8b"), ("Org/Studio", "LM Studio")])
def test_another_tools_model_is_refused_with_that_tools_way_to_remove_it(home, name, how):
    blob = add_ollama(ollama_root(home), "registry.ollama.ai/library/llama3/8b")
    put(home / ".lmstudio" / "models" / "Org" / "Studio" / "model.gguf")
    with pytest.raises(ModelFileError, match=f"not a model tierflow pulled: remove it with .*{how}"):
        remove_model(name)
    assert blob.is_file()


def test_an_unknown_name_is_not_found(home):
    with pytest.raises(ModelFileError, match="model not found: Org/Nothing"):
        remove_model("Org/Nothing")


def test_rm_says_what_it_freed(home):
    add_hf(hf_hub(home), "Org/Model-GGUF", {"model.gguf": None})
    done = run_tierflow("rm", "Org/Model-GGUF")
    assert done.returncode == 0 and "removed Org/Model-GGUF/model.gguf" in done.stdout
