"""`POST /v1/embeddings` on a real server: the official `openai` client for the happy paths (checked
against engine.embed in process), raw HTTP for the encodings and every refusal."""

import base64

import httpx
import numpy as np
import pytest
from openai import OpenAI

from tests.support.live_server import assert_error, running_server, slot_held
from tests.support.make_model import ModelSpec, write_model
from tests.support.oracle import PROMPTS
from tierflow import Engine

TEXTS = [*PROMPTS, "Hello"]


@pytest.fixture(scope="module")
def client(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def limited_url(engine):
    """Small limits: two inputs, 40 characters of text, 600 bytes of body, no queue."""
    with running_server(engine, max_embedding_inputs=2, max_prompt_chars=40, max_body_bytes=600,
                        max_queued=0) as base:
        yield base


def embed(url: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": "any", **fields})


def vectors(response: httpx.Response) -> np.ndarray:
    data = response.json()["data"]
    return np.array([item["embedding"] for item in data], np.float32)


# -- the openai client --------------------------------------------------------------------------

def test_embeddings_equal_in_process_embed(client, engine):
    reply = client.embeddings.create(model="any", input=TEXTS)
    assert [item.index for item in reply.data] == list(range(len(TEXTS)))
    np.testing.assert_array_equal(np.array([item.embedding for item in reply.data], np.float32),
                                  engine.embed(TEXTS))


def test_one_text_gives_one_vector_of_the_models_width(client, engine):
    reply = client.embeddings.create(model="any", input="Hello")
    assert reply.object == "list" and reply.model == engine.path.stem
    assert len(reply.data) == 1 and reply.data[0].object == "embedding"
    assert len(reply.data[0].embedding) == engine.config.hidden_size


def test_embeddings_are_deterministic(client):
    first, again = (client.embeddings.create(model="any", input=TEXTS) for _ in range(2))
    assert [item.embedding for item in first.data] == [item.embedding for item in again.data]


def test_usage_counts_the_input_tokens(client, engine):
    reply = client.embeddings.create(model="any", input=TEXTS)
    num_tokens = sum(len(ids) for ids in engine.embedding_tokens(TEXTS))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == num_tokens


def test_token_id_inputs_embed_like_their_text(client, engine):
    ids = engine.embedding_tokens(TEXTS[:2])
    by_ids = client.embeddings.create(model="any", input=ids)
    by_text = client.embeddings.create(model="any", input=TEXTS[:2])
    assert [item.embedding for item in by_ids.data] == [item.embedding for item in by_text.data]
    single = client.embeddings.create(model="any", input=ids[0])
    assert single.data[0].embedding == by_text.data[0].embedding


def test_dimensions_equal_to_the_models_width_are_accepted(client, engine):
    reply = client.embeddings.create(model="any", input="Hello", dimensions=engine.config.hidden_size)
    assert len(reply.data[0].embedding) == engine.config.hidden_size


# -- encodings ------------------------------------------------------------------------------------

def test_base64_decodes_to_the_float_encoding(url):
    floats = vectors(embed(url, input=TEXTS, encoding_format="float"))
    encoded = embed(url, input=TEXTS, encoding_format="base64").json()["data"]
    decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), "<f4") for item in encoded])
    np.testing.assert_array_equal(decoded, floats)


def test_float_is_the_default_encoding(url, engine):
    np.testing.assert_array_equal(vectors(embed(url, input="Hello")), engine.embed("Hello"))


# -- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["Hello", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["Hello", 5]}, "input"),
    ({"input": [[1, "x"]]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "Hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "Hello", "dimensions": 64}, "dimensions"),
    ({"input": "Hello", "user": 7}, "user"),
])
def test_invalid_embeddings_request_is_400(url, fields, param):
    assert assert_error(embed(url, **fields), 400)["param"] == param


def test_input_over_the_context_is_400(url, engine):
    response = embed(url, input=[[42, 43], [42] * (engine.context_length + 1)])
    assert "input 1" in assert_error(response, 400, "context_length_exceeded")["message"]


def test_more_inputs_than_the_server_takes_is_400(limited_url):
    assert_error(embed(limited_url, input=["a", "b", "c"]), 400, "too_many_inputs")


def test_more_text_than_the_server_takes_is_400(limited_url):
    assert_error(embed(limited_url, input=["x" * 30, "y" * 30]), 400, "prompt_too_long")


def test_embeddings_body_over_the_limit_is_413(limited_url):
    assert_error(embed(limited_url, input=[[1] * 400]), 413)


def test_embeddings_beyond_the_queue_are_503(limited_url):
    with slot_held(limited_url):
        busy = embed(limited_url, input="Hello")
    assert_error(busy, 503, "server_busy")


def test_a_model_whose_pooling_gives_no_vector_per_input_is_400(tmp_path):
    path = write_model(tmp_path / "per-token.gguf", ModelSpec(pooling_type=0))  # llama.cpp's "none"
    with Engine.load(path, threads=2, context_length=256) as engine, running_server(engine) as base:
        assert_error(embed(base, input="Hello"), 400, "model_not_supported")
