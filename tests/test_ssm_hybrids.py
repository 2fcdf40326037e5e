"""The hybrids of Mamba-2 and attention (granitehybrid, nemotron_h and nemotron_h_moe, falcon-h1): the
memory each kind of layer keeps, and layer patterns tierflow refuses. (Their logits against llama.cpp:
tests/test_families.py and tests/test_oracle.py.)"""

import pytest

from tests.support.gguf_bytes import ARRAY, INT32, UINT32, Typed
from tests.support.gguf_writing import rewrite_metadata
from tests.support.make_model import write_model
from tests.support.model_spec import family_spec
from tierflow import Engine
from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.runtime.memory.kinds import FullCache, NoMemory, RecurrentState
from tierflow.runtime.memory.kv_cache import KVCache


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: write_model(tmp_path_factory.mktemp(name) / "model.gguf", family_spec(name))
            for name in ("granitehybrid", "nemotron_h", "nemotron_h_moe", "falcon-h1")}


def load(path):
    return Engine.load(path, threads=1, context_length=256)


def with_counts(models, arch: str, tmp_path, counts: dict[str, list[int]]):
    """A copy of the arch's model whose per-layer counts ({arch}.{key}) are the given lists."""
    changes = {f"{arch}.{key}": Typed(ARRAY, values, INT32) for key, values in counts.items()}
    return rewrite_metadata(models[arch], tmp_path / "changed.gguf", changes)


def test_each_nemotron_h_layer_keeps_the_memory_of_its_kind(models):
    # the spec's pattern "M-*M-M": Mamba-2, FFN, attention, Mamba-2, FFN, Mamba-2
    with load(models["nemotron_h"]) as engine:
        kinds = [type(kind) for kind in engine.config.memory]
    assert kinds == [RecurrentState, NoMemory, FullCache, RecurrentState, NoMemory, RecurrentState]


def test_a_nemotron_h_moe_model_has_experts_in_its_ffn_layers_only(models):
    with load(models["nemotron_h_moe"]) as engine:
        assert engine.config.moe_layers == (1, 4)  # "M-*M-M"


def test_a_nemotron_h_moe_file_with_multi_token_prediction_blocks_is_refused_naming_the_key(tmp_path, models):
    changed = rewrite_metadata(models["nemotron_h_moe"], tmp_path / "mtp.gguf",
                               {"nemotron_h_moe.nextn_predict_layers": Typed(UINT32, 1)})
    with pytest.raises(UnsupportedModelError, match="nemotron_h_moe.nextn_predict_layers is set"):
        load(changed)


def test_each_falcon_h1_layer_keeps_the_whole_contexts_rows_and_a_recurrent_state(models):
    with load(models["falcon-h1"]) as engine:
        cache = KVCache(engine.config, context_length=64)
    assert cache.capacities == [64] * engine.config.num_layers
    assert all("recurrent" in cache.layer_pass(layer) for layer in range(engine.config.num_layers))


def test_a_nemotron_h_layer_with_both_attention_heads_and_an_ffn_is_refused_naming_the_layer(
        tmp_path, models):
    broken = with_counts(models, "nemotron_h", tmp_path, {"attention.head_count_kv": [0, 2, 2, 0, 0, 0],
                                                          "feed_forward_length": [0, 128, 0, 0, 128, 0]})
    with pytest.raises(ModelFileError, match=r"layer 1 has both attention heads .*head_count_kv 2\) "
                                             r"and an FFN .*feed_forward_length 128\)"):
        load(broken)


def test_a_layer_pattern_that_does_not_give_every_layer_a_count_is_refused_naming_the_key(tmp_path, models):
    broken = with_counts(models, "granitehybrid", tmp_path, {"attention.head_count_kv": [0, 2, 0]})
    with pytest.raises(ModelFileError, match=r"'granitehybrid.attention.head_count_kv' must be one count "
                                             r">= 0 per layer \(4\), got an array of 3"):
        load(broken)


def test_a_layer_whose_tensors_are_not_the_kind_its_pattern_names_is_refused_naming_what_it_should_be(
        tmp_path, models):
    broken = with_counts(models, "granitehybrid", tmp_path, {"attention.head_count_kv": [2, 2, 0, 0]})
    with pytest.raises(ModelFileError, match=r"missing tensor 'blk.0.attn_q.weight' .*layer 0 is an "
                                             r"attention layer by the metadata"):
        load(broken)


def test_attention_layers_with_different_kv_head_counts_are_refused(tmp_path, models):
    broken = with_counts(models, "granitehybrid", tmp_path, {"attention.head_count_kv": [0, 2, 4, 0]})
    with pytest.raises(UnsupportedModelError, match=r"'granitehybrid.attention.head_count_kv' differs "
                                                    r"between layers \(\[2, 4\]\)"):
        load(broken)
