"""Qwen3 (dense): per-head q/k norms before neox rotary, a head size of its own, no Q/K/V biases.

llama.cpp is the oracle on models from the project's generator: exact on F32 weights with its KV
cache in F32, within quantization noise on Q8_0 and Q4_K. The same model then runs streamed, with
a draft, and with its layers on the GPU tier (test_gpu_layers.py, with the kernels that run there).
"""

import pytest

from tests.support.budgets import ram_beside_weights
from tests.support.make_model import ModelSpec, write_model
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    PROMPTS,
    assert_greedy_agrees,
    assert_logits_agree,
    llama_cpp_model,
)
from tierflow import Engine
from tierflow.errors import ModelFileError
from tierflow.offload.gguf.reader import read_gguf

# A head size (96) that is not hidden / heads (64): the output projection is [4 * 96, 256].
SPEC = ModelSpec(arch="qwen3", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_size=96,
                 ffn_size=512, context_length=512, weight_type="F32", embedding_type="F32")


def pair(tmp_path, f32_kv: bool, **changes):
    path = write_model(tmp_path / "qwen3.gguf", ModelSpec(**(SPEC.__dict__ | changes)))
    kv = "f32" if f32_kv else "f16"  # the cache type llama.cpp holds
    return (Engine.load(path, threads=2, context_length=256, kv_cache_type=kv),
            llama_cpp_model(path, n_ctx=256, f32_kv=f32_kv))


@pytest.mark.parametrize("changes", [{}, dict(head_size=None), dict(num_kv_heads=1),
                                     dict(tied_embeddings=False)],
                         ids=["head-96", "head-64", "mqa", "untied"])
def test_f32_qwen3_matches_llama_cpp_exactly(tmp_path, changes):
    engine, llama = pair(tmp_path, f32_kv=True, **changes)
    with engine:
        assert_logits_agree(engine, llama, engine.tokenize(LONG_TEXT)[:200], max_mean_diff=0.01,
                            near_tie=EXACT_TIE)
        assert_greedy_agrees(engine, llama, PROMPTS[0], near_tie=EXACT_TIE, max_tokens=32)
    llama.close()


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K"])
def test_quantized_qwen3_matches_llama_cpp_within_quantization_noise(tmp_path, weight_type):
    # a K-quant's rows are multiples of 256: heads of 128, two of them per output-projection row
    engine, llama = pair(tmp_path, f32_kv=False, weight_type=weight_type, embedding_type=weight_type,
                         head_size=128)
    with engine:
        diff = assert_logits_agree(engine, llama, engine.tokenize(LONG_TEXT)[:64], max_mean_diff=0.3,
                                   near_tie=1.0)
    llama.close()
    print(f"qwen3 {weight_type}: mean |logit difference| vs llama.cpp {diff:.4f}")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("qwen3") / "qwen3.gguf",
                       ModelSpec(**(SPEC.__dict__ | dict(num_layers=6, weight_type="Q8_0",
                                                         embedding_type="Q8_0"))))


def greedy(path, **load) -> list[int]:
    with Engine.load(path, threads=2, context_length=128, **load) as engine:
        return engine.generate(PROMPTS[0], max_tokens=12, temperature=0).tokens


@pytest.mark.slow
def test_streamed_qwen3_gives_the_resident_tokens(qwen3):
    with Engine.load(qwen3, threads=2, context_length=128) as engine:
        layers = [engine.weights.packed.globals.nbytes] + [x.nbytes for x in engine.weights.packed.layers]
    budget = layers[0] + sum(layers[1:4]) + ram_beside_weights(qwen3, 128)  # the globals, half the layers
    with Engine.load(qwen3, threads=2, context_length=128, cpu_memory=budget) as engine:
        assert engine.plan.streamed_layers
    assert greedy(qwen3, cpu_memory=budget) == greedy(qwen3)


def test_qwen3_with_a_draft_gives_its_own_tokens(qwen3):
    assert greedy(qwen3, draft=qwen3, draft_tokens=4) == greedy(qwen3)


def _without(path, tmp_path, tensor: str):
    """A copy of the file whose tensor `tensor` is renamed out of the way (same bytes otherwise)."""
    data = bytearray(path.read_bytes())
    at = data.index(tensor.encode())
    data[at:at + len(tensor)] = tensor.replace("attn", "attx").encode()
    copy = tmp_path / "broken.gguf"
    copy.write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize("tensor", ["blk.1.attn_q_norm.weight", "blk.0.attn_k_norm.weight"])
def test_a_missing_qk_norm_is_a_model_file_error_naming_it(qwen3, tmp_path, tensor):
    with pytest.raises(ModelFileError, match=f"missing tensor '{tensor}'"):
        Engine.load(_without(qwen3, tmp_path, tensor))


def test_a_head_size_that_does_not_fit_the_projections_is_named_with_the_shapes(qwen3, tmp_path):
    data = bytearray(qwen3.read_bytes())
    for key in (b"qwen3.attention.key_length", b"qwen3.attention.value_length"):
        at = data.index(key) + len(key) + 4  # the value's type (uint32), then the value
        data[at:at + 4] = (128).to_bytes(4, "little")
    broken = tmp_path / "head-128.gguf"
    broken.write_bytes(bytes(data))
    with read_gguf(broken) as model:
        assert model.metadata["qwen3.attention.key_length"] == 128
    shapes = r"'blk.0.attn_q.weight' has shape \[256, 384\], the metadata implies \[256, 512\]"
    with pytest.raises(ModelFileError, match=shapes):
        Engine.load(broken)
