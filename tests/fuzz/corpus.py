"""Named cases: the attacker's findings against an older tierflow (each now refused with a
TierflowError, each a test in test_fuzz.py), and the fuzzer's own findings that still fail (the
quick run includes them, so it fails until they are fixed)."""

import numpy as np

from tests.fuzz.cases import Case
from tests.fuzz.mutations import CopyArrayItem, DropTensor, SetBlockScale, SetElement, SetValue
from tests.support.gguf_bytes import ARRAY, STRING, UINT32, Typed

TOKENS = "tokenizer.ggml.tokens"
FLOAT16_INF, FLOAT16_MAX = 0x7C00, 0x7BFF

REGRESSIONS = {
    "duplicated_token": Case("llama-q8", (CopyArrayItem(TOKENS, 500, 501),)),
    "sentencepiece_model_on_bpe_vocabulary": Case(
        "llama-q8", (SetValue("tokenizer.ggml.model", Typed(STRING, "llama")),)),
    "no_vocab_tokenizer": Case("llama-q8", (SetValue("tokenizer.ggml.model", Typed(STRING, "no_vocab")),)),
    "billion_layers": Case("llama-q8", (SetValue("llama.block_count", Typed(UINT32, 10**9)),)),
    "string_rope_freq_base": Case("llama-q8", (SetValue("llama.rope.freq_base", Typed(STRING, "abc")),)),
    "array_head_count_kv": Case("llama-q8", (SetValue("llama.attention.head_count_kv",
                                                      Typed(ARRAY, np.array([2, 2], np.uint32), UINT32)),)),
    "block_count_past_the_tensors": Case("llama-q8", (SetValue("llama.block_count", Typed(UINT32, 2**24)),)),
    # A block count below the file's layers loaded, and ran without the last ones.
    "block_count_below_the_layers": Case("llama-q8", (SetValue("llama.block_count", Typed(UINT32, 1)),)),
    "key_length_that_does_not_fit": Case("llama-q8", (SetValue("llama.attention.key_length",
                                                               Typed(UINT32, 48)),)),
    "missing_shared_expert": Case("qwen2moe", (DropTensor("blk.0.ffn_up_shexp.weight"),)),
    "infinite_quant_scale": Case("llama-q8", (SetBlockScale("blk.0.attn_q.weight", 0, FLOAT16_INF),)),
    # A NaN weight loaded and answered "" greedy, garbage sampled.
    "nan_norm_weight": Case("llama-q8", (SetElement("output_norm.weight", 3, float("nan")),)),
    # Nested arrays passed tierflow's reader, then failed inside llama.cpp naming no key.
    "nested_array_metadata": Case("llama-q8", (SetValue("general.tags", Typed(
        ARRAY, [Typed(ARRAY, np.array([1, 2], np.uint32), UINT32)], ARRAY)),)),
    # The fuzzer's first finding: Q4_0 packed as scale and min (-8 * scale) in float16, so the
    # largest float16 scale made a min outside float16 (the packer's ValueError escaped the load).
    # Q4_0 now packs as the file's nibbles and scales: the file loads.
    "largest_float16_scale_in_q4_0": Case("llama-q4-yarn",
                                          (SetBlockScale("blk.0.attn_k.weight", 1, FLOAT16_MAX),)),
}

# The fuzzer's findings that tierflow still gets wrong, each reduced to its smallest form: the
# quick run includes them, so it fails until they are fixed.
KNOWN_FAILURES: dict[str, Case] = {}

NAMED_CASES = {**REGRESSIONS, **KNOWN_FAILURES}
