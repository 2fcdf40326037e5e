"""Presets: named models with their settings in a TOML file, usable wherever a model name is, each key
checked when the file is read."""

import json

import pytest

from tests.support.cli import run_tierflow
from tierflow.errors import InvalidArgumentError
from tierflow.offload.store.presets import Preset, find_preset, presets_file, read_presets

CODER = """
[coder]
model = "{model}"
description = "small and careful"
context_length = 512
cpu_memory = "1GiB"
system = "Answer in one word."
[coder.sampling]
temperature = 0.0
top_k = 1
"""


@pytest.fixture
def presets(home, model_path):
    path = home / ".config" / "tierflow" / "presets.toml"
    path.parent.mkdir(parents=True)
    path.write_text(CODER.format(model=model_path))
    return path


def test_presets_are_read_from_the_config_folder(presets, model_path):
    assert presets_file() == presets
    assert read_presets()["coder"] == Preset(
        "coder", str(model_path), {"context_length": 512, "cpu_memory": "1GiB"},
        {"temperature": 0.0, "top_k": 1}, "Answer in one word.", "small and careful")


def test_tierflow_presets_names_another_file(home, tmp_path, monkeypatch, model_path):
    other = tmp_path / "mine.toml"
    other.write_text(f'[tiny]\nmodel = "{model_path}"\n')
    monkeypatch.setenv("TIERFLOW_PRESETS", str(other))
    assert list(read_presets()) == ["tiny"]


def test_no_presets_file_is_no_preset(home):
    assert read_presets() == {} and find_preset("coder") is None


def test_an_existing_path_is_never_a_preset(presets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "coder").write_text("a file")
    assert find_preset("coder") is None


@pytest.mark.parametrize("text, message", [
    ('[coder]\nmodel = "m"\ncontext = 512\n', r"preset \[coder\] .*unknown key 'context'; a preset takes"),
    ('[coder]\ncontext_length = 512\n', r"preset \[coder\] .*names no model"),
    ('[coder]\nmodel = "m"\ncontext_length = "big"\n', "context_length must be an integer, not 'big'"),
    ('[coder]\nmodel = "m"\n[coder.sampling]\ntemprature = 0.2\n', "unknown sampling key 'temprature'"),
    ('[coder]\nmodel = "m"\n[coder.sampling]\ntemperature = true\n', "sampling.temperature must be"),
    ('coder = "m"\n', "must be a table"),
    ('[coder\nmodel = "m"\n', "is not valid TOML"),
])
def test_a_bad_presets_file_names_the_file_the_preset_and_the_key(home, presets, text, message):
    presets.write_text(text)
    with pytest.raises(InvalidArgumentError, match=message) as caught:
        read_presets()
    assert str(presets) in str(caught.value)


def test_list_shows_the_presets_beside_the_stored_models(presets, model_path):
    done = run_tierflow("list", "--json")
    listed = json.loads(done.stdout)
    assert {"name": "coder", "source": "preset", "path": str(model_path)}.items() <= listed[-1].items()


def test_show_tells_a_presets_model_and_settings(presets):
    done = run_tierflow("show", "coder")
    assert done.returncode == 0
    for shown in ("llama", "Q4_1", "135M", "completion", "coder", "context_length 512", "temperature 0",
                  "Answer in one word."):
        assert shown in done.stdout


def test_a_preset_that_runs_another_preset_is_refused(home, presets):
    presets.write_text('[a]\nmodel = "b"\n[b]\nmodel = "m"\n')
    with pytest.raises(InvalidArgumentError, match=r"preset \[a\] .*runs preset 'b'"):
        read_presets()


def test_engine_load_of_a_preset_takes_its_model_settings_sampling_and_system_prompt(presets, model_path):
    from tierflow import Engine

    with Engine.load("coder") as engine:
        assert engine.path == model_path and engine.context_length == 512
        assert engine.sampling_defaults | {"temperature": 0.0, "top_k": 1} == engine.sampling_defaults
        prompt = engine.detokenize(engine.tokenize_chat([{"role": "user", "content": "Hi"}]))
        assert "Answer in one word." in prompt


def test_options_given_to_engine_load_win_over_the_presets(presets):
    from tierflow import Engine

    with Engine.load("coder", context_length=256) as engine:
        assert engine.context_length == 256


def test_tierflow_run_takes_a_preset_as_its_model(presets):
    done = run_tierflow("run", "--chat", "Hi", "-n", "3", "-m", "coder", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokens"]
