"""Jamba: Mamba-1 layers among attention layers, experts in some layers and dense FFNs in the others,
told apart by the layers' routers. (Its logits against llama.cpp: tests/test_families.py and
tests/test_oracle.py.)"""

from dataclasses import replace

import numpy as np
import pytest

from tests.support.budgets import moe_bytes
from tests.support.gguf_bytes import ARRAY, INT32, Typed
from tests.support.gguf_writing import rewrite_metadata
from tests.support.make_model import write_model
from tests.support.model_spec import family_spec
from tierflow import Engine
from tierflow.errors import ModelFileError
from tierflow.runtime.api.model_info import describe_model
from tierflow.runtime.memory.kinds import FullCache, RecurrentState

CONTEXT = 128
PROMPT = "The history of the printing press begins in"
TOKENS = 24


@pytest.fixture(scope="module")
def jamba_path(tmp_path_factory):
    """The generic suite's spec: pattern "MM*M" (Mamba, Mamba, attention, Mamba), experts in layers 1
    and 2, in Q8_0 so that the experts are worth streaming."""
    spec = replace(family_spec("jamba"), weight_type="Q8_0", embedding_type="Q8_0")
    return write_model(tmp_path_factory.mktemp("jamba") / "jamba.gguf", spec)


def load(path, **kwargs) -> Engine:
    return Engine.load(path, threads=1, context_length=CONTEXT, **kwargs)


def test_the_layers_with_a_router_are_the_moe_layers_and_the_others_dense(jamba_path):
    with load(jamba_path) as engine:
        assert engine.config.moe_layers == (1, 2)
        assert [len(experts) for experts in engine.weights.packed.experts] == [0, 4, 4, 0]


def test_each_layer_keeps_the_memory_of_its_mixer(jamba_path):
    with load(jamba_path) as engine:
        kinds = [type(kind) for kind in engine.config.memory]
    assert kinds == [RecurrentState, RecurrentState, FullCache, RecurrentState]


def test_info_names_the_dense_layers_among_the_moe_ones(jamba_path):
    experts = dict(describe_model(jamba_path).rows())["experts"]
    assert experts.startswith("4 per layer (layers 0, 3 dense), 2 used per token")


def test_experts_streamed_from_disk_give_the_resident_tokens_and_logits(jamba_path):
    with load(jamba_path) as engine:
        tokens = engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens
        logits = engine.logits(engine.tokenize(PROMPT) + tokens)
    with load(jamba_path, cpu_memory=moe_bytes(jamba_path, CONTEXT).in_ram(6, layers_on_gpu=False)) as engine:
        assert engine.weights.bytes_by_tier()["disk"] > 0
        assert engine.generate(PROMPT, max_tokens=TOKENS, temperature=0).tokens == tokens
        assert np.array_equal(engine.logits(engine.tokenize(PROMPT) + tokens), logits)
        assert engine.expert_stats.misses > 0


def test_a_layer_without_an_ffn_is_refused_naming_the_layer(jamba_path, tmp_path):
    broken = rewrite_metadata(jamba_path, tmp_path / "no_ffn.gguf",
                              {"jamba.feed_forward_length": Typed(ARRAY, [128, 128, 0, 128], INT32)})
    with pytest.raises(ModelFileError, match=r"layer 2 has no FFN \(jamba.feed_forward_length 0\)"):
        load(broken)


def test_an_attention_layer_without_attention_tensors_is_refused_naming_what_the_metadata_makes_it(
        jamba_path, tmp_path):
    broken = rewrite_metadata(jamba_path, tmp_path / "moved.gguf",
                              {"jamba.attention.head_count_kv": Typed(ARRAY, [2, 0, 2, 0], INT32)})
    with pytest.raises(ModelFileError, match=r"missing tensor 'blk.0.attn_q.weight' .*layer 0 is an "
                                             r"attention layer by the metadata's per-layer "
                                             r"attention.head_count_kv, with a dense FFN"):
        load(broken)
