"""Several models on one `tierflow serve`, by name, as a user runs it: the bundled model and its F32
copy, each asked for by the request's `model` through OpenAI's and ollama's clients; loaded on
demand, listed, unloaded by keep_alive and for room, and `tierflow ps` showing what is loaded."""

import threading

import httpx
import ollama
import pytest
from openai import NotFoundError, OpenAI
from typer.testing import CliRunner

from tests.support.live_server import serve_command, slot_held
from tierflow.cli.app import app

HI = [{"role": "user", "content": "Hi"}]
SMALL = {"temperature": 0, "num_predict": 3}


@pytest.fixture(scope="module")
def two_models(model_path, f32_model_path):
    """q41 (the bundled file) loads at start; f32 on demand."""
    with serve_command("-m", f"q41={model_path}", "-m", f"f32={f32_model_path}", "--ctx", "512",
                       "--threads", "1", "--parallel", "1") as base:
        yield base


def loaded(base: str) -> list[str]:
    return sorted(model.model for model in ollama.Client(host=base).ps().models)


@pytest.mark.slow
def test_every_served_model_is_listed_by_name(two_models):
    assert [m.id for m in OpenAI(base_url=f"{two_models}/v1", api_key="x").models.list()] == ["q41", "f32"]
    assert [m.model for m in ollama.Client(host=two_models).list().models] == ["q41", "f32"]


@pytest.mark.slow
def test_a_model_loads_on_its_first_request_and_stays(two_models, f32_model_path):
    from tierflow import Engine

    client = ollama.Client(host=two_models)
    reply = client.chat(model="f32", messages=HI, options=SMALL)
    with Engine.load(f32_model_path, context_length=512, threads=1) as engine:
        assert reply.message.content == engine.chat(HI, temperature=0, max_tokens=3).text
    assert loaded(two_models) == ["f32", "q41"]
    assert client.chat(model="f32", messages=HI, options=SMALL).load_duration == 0  # no second load


def test_requests_pick_their_model_by_name(two_models, engine):
    client = OpenAI(base_url=f"{two_models}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="q41", messages=HI, temperature=0, max_tokens=3)
    assert reply.model == "q41" and reply.choices[0].message.content == engine.chat(
        HI, temperature=0, max_tokens=3).text


def test_an_unknown_model_is_a_404_naming_the_served_ones(two_models):
    with pytest.raises(NotFoundError) as refused:
        OpenAI(base_url=f"{two_models}/v1", api_key="x", max_retries=0).chat.completions.create(
            model="llama3", messages=HI)
    assert "q41, f32" in str(refused.value)
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=two_models).chat(model="llama3", messages=HI)
    assert refused.value.status_code == 404 and "q41, f32" in refused.value.error


def test_keep_alive_zero_unloads_the_model_after_its_answer(two_models):
    client = ollama.Client(host=two_models)
    client.chat(model="f32", messages=HI, options=SMALL, keep_alive=0)
    assert loaded(two_models) == ["q41"]


def test_tierflow_ps_shows_the_loaded_models(two_models):
    result = CliRunner().invoke(app, ["ps", "--url", two_models])
    assert result.exit_code == 0 and "q41" in result.output and "RAM" in result.output


def test_health_answers_while_a_model_loads(two_models):
    ollama.Client(host=two_models).generate(model="f32", keep_alive=0)  # unloaded, whatever ran before
    loading = threading.Thread(target=ollama.Client(host=two_models).generate, kwargs={"model": "f32"})
    loading.start()
    answers = []
    while loading.is_alive():
        answers.append(httpx.get(f"{two_models}/health", timeout=10).status_code)
    loading.join()
    assert answers and set(answers) == {200} and "f32" in loaded(two_models)


@pytest.mark.slow
def test_an_idle_model_unloads_when_its_keep_alive_passes(model_path, f32_model_path):
    with serve_command("-m", f"q41={model_path}", "-m", f"f32={f32_model_path}", "--ctx", "256",
                       "--threads", "1", "--keep-alive", "1s") as base:
        ollama.Client(host=base).chat(model="f32", messages=HI, options=SMALL)
        for _ in range(100):
            if "f32" not in loaded(base):
                break
            threading.Event().wait(0.1)
        assert loaded(base) == []


@pytest.mark.slow
def test_past_max_models_the_least_recently_used_idle_model_unloads(model_path, f32_model_path):
    with serve_command("-m", f"q41={model_path}", "-m", f"f32={f32_model_path}", "--ctx", "256",
                       "--threads", "1", "--max-models", "1") as base:
        ollama.Client(host=base).chat(model="f32", messages=HI, options=SMALL)
        assert loaded(base) == ["f32"]


@pytest.mark.slow
def test_a_model_that_cannot_load_beside_busy_ones_is_a_503(model_path, f32_model_path):
    with serve_command("-m", f"q41={model_path}", "-m", f"f32={f32_model_path}", "--ctx", "1024",
                       "--threads", "1", "--max-models", "1", "--parallel", "1") as base:
        with slot_held(base):  # q41 is generating
            reply = httpx.post(f"{base}/v1/chat/completions", json={"model": "f32", "messages": HI})
        assert reply.status_code == 503 and "busy" in reply.json()["error"]["message"]


def test_two_models_named_alike_are_refused(model_path):
    result = CliRunner().invoke(app, ["serve", "-m", f"a={model_path}", "-m", f"a={model_path}"])
    assert result.exit_code != 0 and "two models are served as 'a'" in result.output


def test_a_model_given_alone_is_named_by_its_file_or_its_store_name(model_path):
    from tierflow.cli.serve_command import served_models

    assert served_models([str(model_path), f"small={model_path}"]) == {model_path.stem: str(model_path),
                                                                        "small": str(model_path)}
    assert served_models([None]) == {model_path.stem: str(model_path)}
    assert list(served_models(["qwen2.5:0.5b", "Org/Repo:Q4_K_M"])) == ["qwen2.5:0.5b", "Org/Repo:Q4_K_M"]


def test_a_keep_alive_that_is_no_duration_is_refused_before_anything_loads(model_path):
    result = CliRunner().invoke(app, ["serve", "-m", str(model_path), "--keep-alive", "soon"])
    assert result.exit_code == 2 and "--keep-alive: not a duration: 'soon'" in result.output


def test_max_models_below_one_is_refused(model_path):
    result = CliRunner().invoke(app, ["serve", "-m", str(model_path), "--max-models", "0"])
    assert result.exit_code == 2 and "--max-models must be at least 1" in result.output
