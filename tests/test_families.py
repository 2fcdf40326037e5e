"""Every family, one suite: its generator spec (tests/support/family_specs.py, beside what
llama.cpp requires of its files) written as a GGUF with F32 weights, then tierflow against llama.cpp
with its KV cache in F32, the oracle's exact regime. A family's own test file checks what only it
has; this one checks that each runs at all as llama.cpp runs it, on a prompt longer than any
window."""

import pytest

from tests.support.family_specs import FAMILIES
from tests.support.make_model import write_model
from tests.support.model_spec import family_spec
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    PROMPTS,
    assert_greedy_agrees,
    assert_logits_agree,
    llama_cpp_model,
)
from tierflow import Engine
from tierflow.runtime.models import ARCHITECTURES

CONTEXT = 256


def test_every_family_has_a_generator_spec():
    assert set(FAMILIES) == set(ARCHITECTURES)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    path = write_model(tmp_path_factory.mktemp("family") / f"{name}.gguf", family_spec(name))
    llama = llama_cpp_model(path, n_ctx=CONTEXT, f32_kv=True)
    with Engine.load(path, threads=2, context_length=CONTEXT, kv_cache_type="f32") as engine:
        yield engine, llama
    llama.close()


def test_a_familys_logits_are_llama_cpps(family):
    engine, llama = family
    ids = engine.tokenize(LONG_TEXT)[:64]
    assert_logits_agree(engine, llama, ids, max_mean_diff=0.01, near_tie=EXACT_TIE)


@pytest.mark.slow
def test_a_familys_greedy_tokens_are_llama_cpps(family):
    engine, llama = family
    assert_greedy_agrees(engine, llama, PROMPTS[0], near_tie=EXACT_TIE, max_tokens=16)
