"""Reading a model's architecture from GGUF metadata, and refusing what tierflow cannot run."""

from dataclasses import replace

import numpy as np
import pytest

from tests.support.gguf_bytes import (
    UINT32,
    TensorSpec,
    Typed,
    build_gguf,
    build_tiny_gguf,
    tiny_kvs,
    tiny_tensors,
)
from tests.support.gguf_writing import rewrite_metadata
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine
from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.runtime.models import ARCHITECTURES, architecture
from tierflow.runtime.models.config import ModelConfig

LLAMA = {
    "general.architecture": "llama",
    "llama.block_count": 2,
    "llama.embedding_length": 64,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.context_length": 256,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
}


def config(**changes) -> ModelConfig:
    metadata = {k: v for k, v in (LLAMA | changes).items() if v is not None}
    return architecture(metadata["general.architecture"]).read_config(metadata, vocab_size=100, tied=True)


def test_config_reads_the_llama_hyper_parameters():
    c = config()
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert c.rope_style == "normal" and c.rope_scaling.kind == "none"


def test_moe_layers_are_those_after_the_leading_dense_ones_unless_each_layer_is_named():
    moe = replace(config(), num_layers=4, num_experts=4, experts_used=2, expert_ffn_size=64)
    assert replace(moe, leading_dense_layers=1).moe_layers == (1, 2, 3)
    assert replace(moe, expert_layers=(False, True, False, True)).moe_layers == (1, 3)


def test_expert_layers_in_a_model_without_experts_are_refused():
    with pytest.raises(ModelFileError, match="expert layers are named but the model has no experts"):
        replace(config(), expert_layers=(True, False))


def test_qwen2_rotates_halves():
    qwen = {k.replace("llama.", "qwen2."): v for k, v in LLAMA.items()}
    qwen["general.architecture"] = "qwen2"
    assert architecture("qwen2").read_config(qwen, 100, True).rope_style == "neox"


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length",
                                 "llama.context_length", "llama.attention.head_count"])
def test_missing_required_metadata_is_named(key):
    with pytest.raises(ModelFileError, match=key):
        config(**{key: None})


def test_unsupported_architecture_is_named_with_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="rwkv6") as refused:
        config(**{"general.architecture": "rwkv6"})
    assert all(name in str(refused.value) for name in ARCHITECTURES)  # the list runtime/models/ holds


def test_heads_not_divisible_by_kv_heads_is_rejected():
    with pytest.raises(ModelFileError, match="head count"):
        config(**{"llama.attention.head_count_kv": 3})


def test_text_where_a_number_belongs_is_rejected():
    with pytest.raises(ModelFileError, match="block_count"):
        config(**{"llama.block_count": "two"})


def test_unknown_rope_scaling_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        config(**{"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0})


def test_engine_names_missing_metadata_in_a_real_file(tmp_path):
    path = tmp_path / "incomplete.gguf"
    path.write_bytes(build_tiny_gguf())  # valid GGUF, but no hidden size, heads, ...
    with pytest.raises(ModelFileError, match="missing required metadata"):
        Engine.load(path)


def test_engine_names_a_missing_tensor(tmp_path):
    kvs = [kv for kv in tiny_kvs() if kv[0] != "llama.block_count"] + list(LLAMA.items())[1:]
    path = tmp_path / "no-layers.gguf"
    path.write_bytes(build_gguf(kvs, tiny_tensors()))
    with pytest.raises(ModelFileError, match="tensor"):
        Engine.load(path)


# The lattice codebooks of the smallest "dynamic" quants, and types no model weight uses.
UNSUPPORTED_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "Q8_K", "I32"]


@pytest.mark.parametrize("type_name", UNSUPPORTED_TYPES)
def test_engine_names_an_unsupported_tensor_type(tmp_path, type_name):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    e, vocab = 256, 8
    metadata = LLAMA | {"llama.embedding_length": e, "llama.feed_forward_length": e,
                        "llama.block_count": 1}

    def f32(name, *shape):
        return TensorSpec(name, shape, GGMLQuantizationType.F32, bytes(4 * int(np.prod(shape))))

    ggml_type = GGMLQuantizationType[type_name]
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    kv = e // 2  # 2 of 4 heads
    tensors = [f32("token_embd.weight", e, vocab), f32("output_norm.weight", e),
               f32("blk.0.attn_norm.weight", e), f32("blk.0.ffn_norm.weight", e),
               TensorSpec("blk.0.attn_q.weight", (e, e), ggml_type, bytes(e // block_size * block_bytes * e)),
               f32("blk.0.attn_k.weight", e, kv), f32("blk.0.attn_v.weight", e, kv),
               f32("blk.0.attn_output.weight", e, e), f32("blk.0.ffn_gate.weight", e, e),
               f32("blk.0.ffn_up.weight", e, e), f32("blk.0.ffn_down.weight", e, e)]
    path = tmp_path / "unsupported.gguf"
    path.write_bytes(build_gguf(list(metadata.items()), tensors))
    with pytest.raises(UnsupportedModelError,
                       match=rf"tensor 'blk.0.attn_q.weight' has type {type_name}, which tierflow does "
                             r"not support \(supported types: .*Q2_K"):
        Engine.load(path)


def test_a_block_count_below_the_files_layers_is_refused_naming_both(tmp_path):
    """llama.cpp refuses such a file (it finds tensors it was not told of); read, it would silently
    run a model without its last layers."""
    model = write_model(tmp_path / "three.gguf", ModelSpec(num_layers=3))
    fewer = rewrite_metadata(model, tmp_path / "fewer.gguf", {"llama.block_count": Typed(UINT32, 2)})
    with pytest.raises(ModelFileError, match=r"fewer.gguf: llama.block_count is 2 but the file holds "
                                             r"tensors of layer 2 \('blk.2.[a-z_.]+'\)"):
        Engine.load(fewer)
