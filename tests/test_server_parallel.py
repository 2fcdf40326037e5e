"""Parallel clients of a real server, each with the official openai client: each gets its own
answer, the one the engine gives it alone."""

import pytest
from openai import OpenAI

from tests.support.live_server import running_server
from tests.support.together import run_together
from tierflow import Engine

QUESTIONS = ["Name a color.", "What is 2 + 2?", "Say hello in French.", "Name a planet."]
TOKENS = 16


@pytest.fixture(scope="module")
def parallel_url(model_path):
    with Engine.load(model_path, parallel=3, context_length=1024) as engine:
        with running_server(engine) as url:
            yield url


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def ask_together(url: str, stream: bool) -> list[str]:
    """Each question's answer, all sent at once from their own clients."""
    def ask(i: int) -> str:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        response = client.chat.completions.create(model="m", messages=chat(QUESTIONS[i]), max_tokens=TOKENS,
                                                  temperature=0, stream=stream)
        if stream:
            return "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)
        return response.choices[0].message.content

    return run_together(ask, len(QUESTIONS))


@pytest.fixture(scope="module")
def alone(engine):
    return [engine.chat(chat(question), max_tokens=TOKENS, temperature=0).text for question in QUESTIONS]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_parallel_clients_each_get_the_answer_the_engine_gives_alone(parallel_url, alone, stream):
    assert ask_together(parallel_url, stream) == alone
