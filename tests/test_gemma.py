"""Gemma 3 and Gemma 2: sandwich norms, GeGLU, scaled embeddings, sliding windows, soft caps.

llama.cpp is the oracle on models from the project's generator: exact on F32 weights with its KV
cache in F32, on prompts several windows long, within quantization noise on Q8_0, Q4_K and a
Q4_K_M mix whose rows K-quants cannot pack. The attention kernel's window, soft cap and scale
match the torch reference, and a token gets the same bits alone, in a batch or in a token tree.
"""

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.support.budgets import ram_beside_weights
from tests.support.make_model import ModelSpec, write_model
from tests.support.model_spec import architecture_metadata
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    PROMPTS,
    assert_greedy_agrees,
    assert_logits_agree,
    llama_cpp_model,
)
from tests.test_ops import HEADS, empty_cache, random_qkv, rope_rows
from tests.test_token_tree import PROMPT, TREE_PARENTS, TREE_TOKENS, path_to, sequential_logits
from tierflow import Engine
from tierflow.cpu_kernels.ops import attention
from tierflow.cpu_kernels.torch_ops import attention_reference
from tierflow.errors import ModelFileError, UnsupportedModelError
from tierflow.offload.gguf.reader import read_gguf
from tierflow.runtime.decoder.decoder import Decoder
from tierflow.runtime.generation.token_loop import TokenGenerator
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.runtime.models import architecture

# Six layers: five local (window 32), then one global. Prompts of 200 tokens cross the window
# many times over.
GEMMA3 = ModelSpec(arch="gemma3", num_layers=6, hidden_size=256, num_heads=4, num_kv_heads=2, head_size=64,
                   ffn_size=512, context_length=512, sliding_window=32, weight_type="F32",
                   embedding_type="F32")
GEMMA2 = replace(GEMMA3, arch="gemma2", num_layers=4)  # local, global, local, global
LONG_IDS = 200


def pair(tmp_path, spec: ModelSpec, f32_kv: bool = True):
    path = write_model(tmp_path / f"{spec.arch}.gguf", spec)
    kv = "f32" if f32_kv else "f16"  # the cache type llama.cpp holds
    return (Engine.load(path, threads=2, context_length=256, kv_cache_type=kv),
            llama_cpp_model(path, n_ctx=256, f32_kv=f32_kv))


def assert_matches_llama_cpp_exactly(engine, llama):
    with engine:
        ids = engine.tokenize(LONG_TEXT * 3)[:LONG_IDS]
        assert_logits_agree(engine, llama, ids, max_mean_diff=0.01, near_tie=EXACT_TIE)
        assert_greedy_agrees(engine, llama, PROMPTS[0], near_tie=EXACT_TIE, max_tokens=48)
    llama.close()


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    {}, dict(tied_embeddings=False), dict(final_logit_softcap=15.0),
    dict(rope_theta=1e6, rope_scaling="linear", rope_scaling_factor=4.0),
], ids=["tied", "untied", "final-softcap", "scaled-global-rope"])
def test_f32_gemma3_matches_llama_cpp_exactly(tmp_path, changes):
    assert_matches_llama_cpp_exactly(*pair(tmp_path, replace(GEMMA3, **changes)))


@pytest.mark.slow
@pytest.mark.parametrize("changes", [{}, dict(attn_logit_softcap=2.0, final_logit_softcap=15.0)],
                         ids=["default-softcaps", "strong-softcaps"])
def test_f32_gemma2_matches_llama_cpp_exactly(tmp_path, changes):
    assert_matches_llama_cpp_exactly(*pair(tmp_path, replace(GEMMA2, **changes)))


# The two sides round activations differently for quantized weights (tierflow's int8 groups,
# llama.cpp's Q8 blocks): over six layers that moves Q4_K logits by 0.25 on average and the gap
# between two candidates by up to ~1.4 (0.13 and 0.5 for Q8_0), so closer calls are coin flips.
@pytest.mark.parametrize("weight_type,near_tie", [("Q8_0", 1.0), ("Q4_K", 1.6)])
def test_quantized_gemma3_matches_llama_cpp_within_quantization_noise(tmp_path, weight_type, near_tie):
    engine, llama = pair(tmp_path, replace(GEMMA3, weight_type=weight_type, embedding_type=weight_type),
                         f32_kv=False)
    with engine:
        diff = assert_logits_agree(engine, llama, engine.tokenize(LONG_TEXT * 3)[:LONG_IDS],
                                   max_mean_diff=0.3, near_tie=near_tie)
    llama.close()
    print(f"gemma3 {weight_type}: mean |logit difference| vs llama.cpp {diff:.4f}")


@pytest.mark.slow
def test_a_q4_k_m_file_with_rows_k_quants_cannot_pack_loads_and_runs(tmp_path):
    """Gemma 3 270M's shape (hidden 640, one KV head of 256): its 640-wide rows fall back from
    Q4_K to Q5_0 and from Q6_K to Q8_0, beside Q4_K and Q6_K, as in real Q4_K_M files."""
    spec = replace(GEMMA3, num_layers=2, hidden_size=640, num_heads=4, num_kv_heads=1, head_size=256,
                   ffn_size=2048, weight_type="Q4_K_M", embedding_type="Q4_K_M")
    engine, llama = pair(tmp_path, spec, f32_kv=False)
    with read_gguf(engine.path) as model:
        types = {info.type_name for info in model.tensors.values() if len(info.shape) == 2}
    assert types == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    with engine:
        assert len(engine.generate(PROMPTS[2], max_tokens=8, temperature=0).tokens) == 8
        assert_logits_agree(engine, llama, engine.tokenize(LONG_TEXT * 3)[:LONG_IDS], max_mean_diff=0.3,
                            near_tie=1.0)
    llama.close()


def test_layers_are_local_in_llama_cpp_patterns():
    """Gemma 3: five local layers, then one global; Gemma 2: every other layer local."""
    vocab = 49152
    gemma3 = architecture("gemma3").read_config(_metadata(replace(GEMMA3, num_layers=12), vocab), vocab, True)
    assert gemma3.layer_windows == (32,) * 5 + (0,) + (32,) * 5 + (0,)
    gemma2 = architecture("gemma2").read_config(_metadata(GEMMA2, vocab), vocab, True)
    assert gemma2.layer_windows == (32, 0, 32, 0)


def _metadata(spec: ModelSpec, vocab: int) -> dict:
    return {key: typed.value for key, typed in architecture_metadata(spec, vocab)}


# --- the attention kernel's window, soft cap and scale --------------------------------------------

SCORES = [dict(window=5), dict(window=20), dict(softcap=1.5), dict(scale=0.7),
          dict(window=7, softcap=2.0, scale=0.3)]


def run(qkv, cache, cos, sin, start, parents=None, tree_start=None, **scores) -> torch.Tensor:
    keys, values = cache
    out = attention(qkv.clone().numpy(), keys.numpy(), values.numpy(), cos.contiguous().numpy(),
                    sin.contiguous().numpy(), HEADS, start, True, parents, tree_start, **scores)
    return torch.from_numpy(out)


@pytest.mark.parametrize("scores", SCORES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("tokens,start", [(1, 40), (6, 37), (30, 0)], ids=lambda v: str(v))
def test_windowed_capped_scaled_attention_matches_the_torch_reference(scores, tokens, start):
    qkv = random_qkv(start + tokens) * 2  # scores of a few units, which a cap of 1.5 bends
    cos, sin = rope_rows(start + tokens, 0, 16)
    ours, theirs = empty_cache(), empty_cache()
    if start:
        run(qkv[:start], ours, cos[:start], sin[:start], 0, **scores)
        attention_reference(qkv[:start].clone(), *theirs, cos[:start], sin[:start], HEADS, 0, True, **scores)
    new = slice(start, start + tokens)
    out = run(qkv[new], ours, cos[new], sin[new], start, **scores)
    expected = attention_reference(qkv[new].clone(), *theirs, cos[new], sin[new], HEADS, start, True,
                                   **scores)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_window_hides_exactly_the_positions_before_it():
    """Values that differ only at positions 0 .. 33 - window do not reach the token at 33."""
    qkv, (cos, sin) = random_qkv(34), rope_rows(34, 0, 16)
    outputs = []
    for seed in (1, 2):
        changed = qkv.clone()
        changed[: 34 - 8, -2 * 16:] = random_qkv(34 - 8, seed)[:, -2 * 16:]  # the values of both KV heads
        outputs.append(run(changed, empty_cache(), cos, sin, 0, window=8)[-1])
    assert torch.equal(outputs[0], outputs[1])
    widened = [run(qkv, empty_cache(), cos, sin, 0, window=window)[-1] for window in (8, 9)]
    assert not torch.equal(*widened)


def test_a_windowed_capped_batch_equals_token_by_token_bit_for_bit():
    qkv, (cos, sin) = random_qkv(40), rope_rows(40, 0, 16)
    scores = dict(window=7, softcap=2.0, scale=0.3)
    batch = run(qkv, empty_cache(), cos, sin, 0, **scores)
    cache = empty_cache()
    steps = [run(qkv[i: i + 1], cache, cos[i: i + 1], sin[i: i + 1], i, **scores) for i in range(40)]
    assert torch.equal(batch, torch.cat(steps))


def test_a_tree_token_with_a_window_gets_the_bits_of_its_path_decoded_alone():
    """Tree from slot 20, window 3: a depth-1 token sees two prompt positions, a depth-3 one
    only its three nearest ancestors, not the root."""
    parents = np.array([-1, 0, 1, 2, 0, 4], np.int32)
    depths = np.array([0, 1, 2, 3, 1, 2])
    qkv, (cos, sin) = random_qkv(26), rope_rows(24, 0, 16)
    cos, sin = torch.cat([cos[:20], cos[20 + depths]]), torch.cat([sin[:20], sin[20 + depths]])
    tree_cache = empty_cache()
    run(qkv[:20], tree_cache, cos[:20], sin[:20], 0, window=3)
    tree = run(qkv[20:], tree_cache, cos[20:], sin[20:], 20, parents, 20, window=3)
    for node in range(len(parents)):
        path = [20 + i for i in range(len(parents)) if i == node or _is_ancestor(parents, i, node)]
        rows = list(range(20)) + path
        alone = run(qkv[rows], empty_cache(), cos[rows], sin[rows], 0, window=3)
        assert torch.equal(tree[node], alone[-1]), f"node {node}"


def _is_ancestor(parents: np.ndarray, candidate: int, node: int) -> bool:
    while node >= 0:
        node = parents[node]
        if node == candidate:
            return True
    return False


@pytest.mark.parametrize("scores,problem", [(dict(window=-1), "window must be >= 0"),
                                            (dict(softcap=-1.0), "softcap a finite number >= 0")])
def test_attention_refuses_a_negative_window_or_soft_cap(scores, problem):
    qkv, (cos, sin) = random_qkv(2), rope_rows(2, 0, 16)
    with pytest.raises(ValueError, match=problem):
        run(qkv, empty_cache(), cos, sin, 0, **scores)


# --- the engine on a windowed model: trees, drafts, streaming -------------------------------------

SMALL = replace(GEMMA3, hidden_size=64, head_size=16, ffn_size=128, sliding_window=3, weight_type="Q8_0",
                embedding_type="Q8_0")


@pytest.fixture(scope="module")
def small_gemma3(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf", SMALL)


def greedy(path, **load) -> list[int]:
    with Engine.load(path, threads=2, context_length=128, **load) as engine:
        return engine.generate(PROMPTS[0], max_tokens=12, temperature=0).tokens


def test_every_tree_node_of_a_windowed_model_matches_decoding_its_path_bit_for_bit(small_gemma3):
    with Engine.load(small_gemma3, threads=2, context_length=128) as engine:
        generator = TokenGenerator(Decoder(engine.config, engine.arch.block, engine.weights, 128),
                                   KVCache(engine.config, 128))
        prompt_ids = engine.tokenize(PROMPT)
        generator.prefill(prompt_ids, threading.Event(), reuse_prefix=False)
        tree_rows = generator.verify_tree(TREE_TOKENS, TREE_PARENTS)
        for node in range(len(TREE_TOKENS)):
            rows = sequential_logits(generator, prompt_ids, [TREE_TOKENS[i] for i in path_to(node)])
            assert np.array_equal(tree_rows[node], rows[-1]), f"node {node}"


def test_gemma3_with_a_draft_gives_its_own_tokens(small_gemma3):
    assert greedy(small_gemma3, draft=small_gemma3, draft_tokens=4) == greedy(small_gemma3)


@pytest.mark.slow
def test_streamed_gemma3_gives_the_resident_tokens(small_gemma3):
    with Engine.load(small_gemma3, threads=2, context_length=128) as engine:
        layers = [engine.weights.packed.globals.nbytes] + [x.nbytes for x in engine.weights.packed.layers]
    # the globals and half the layers' bytes, beside the cache and activations
    budget = layers[0] + sum(layers[1:4]) + ram_beside_weights(small_gemma3, 128)
    with Engine.load(small_gemma3, threads=2, context_length=128, cpu_memory=budget) as engine:
        assert engine.plan.streamed_layers
    assert greedy(small_gemma3, cpu_memory=budget) == greedy(small_gemma3)


# --- bad files ------------------------------------------------------------------------------------


def test_a_missing_post_norm_is_a_model_file_error_naming_it(small_gemma3, tmp_path):
    data = bytearray(small_gemma3.read_bytes())
    name = b"blk.2.post_ffw_norm.weight"
    at = data.index(name)
    data[at:at + len(name)] = b"blk.2.post_ffx_norm.weight"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="missing tensor 'blk.2.post_ffw_norm.weight'"):
        Engine.load(broken)


def test_a_negative_soft_cap_is_a_model_file_error_naming_it(tmp_path):
    path = write_model(tmp_path / "gemma2.gguf", replace(GEMMA2, num_layers=2, final_logit_softcap=15.0))
    data = bytearray(path.read_bytes())
    key = b"gemma2.final_logit_softcapping"
    at = data.index(key) + len(key) + 4  # the value's type (float32), then the value
    data[at:at + 4] = np.float32(-15.0).tobytes()
    broken = tmp_path / "negative-cap.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="final_logit_softcap must be a number >= 0, got -15.0"):
        Engine.load(broken)


def test_a_gemma2_local_rope_base_with_rope_scaling_is_refused_by_name():
    vocab = 49152
    metadata = _metadata(replace(GEMMA2, rope_scaling="linear", rope_scaling_factor=2.0), vocab)
    metadata["gemma2.rope.freq_base_swa"] = 10000.0
    with pytest.raises(UnsupportedModelError, match="rope.freq_base_swa together with rope scaling"):
        architecture("gemma2").read_config(metadata, vocab, True)
