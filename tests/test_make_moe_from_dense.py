"""The MoEfied SmolLM2 (make_moe_from_dense.py): llama.cpp and tierflow run it alike, with every
expert used it is the dense model, its routing is spread over the experts, and bad input is a
clear error."""

import numpy as np
import pytest

from tests.support.make_model import ModelSpec, write_f32_copy, write_model
from tests.support.make_moe_from_dense import CALIBRATION_TEXT, main, write_moe_from_dense
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    NEAR_TIE,
    assert_greedy_agrees,
    assert_logits_agree,
    llama_cpp_model,
    top2_margin,
)
from tierflow import Engine
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.offload.gguf.reader import read_gguf

NUM_EXPERTS, EXPERTS_USED, EXPERT_WIDTH = 8, 2, 1536 // 8


def dequantized(model, name: str) -> np.ndarray:
    info = model.tensors[name]
    return dequantize(model.tensor_data(name), info.ggml_type, info.shape)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory, model_path):
    """The default conversion: 8 experts, top-2, calibrated on moe_calibration.txt (~16 s)."""
    return write_moe_from_dense(model_path, tmp_path_factory.mktemp("moe") / "smollm2-8e2.gguf",
                                NUM_EXPERTS, EXPERTS_USED)


def raw_rows(model, name: str) -> np.ndarray:
    """A tensor's raw bytes as rows [rows, row bytes] (numpy order, expert stacks flattened)."""
    info = model.tensors[name]
    return model.tensor_data(name).reshape(-1, info.nbytes // np.prod(info.shape[1:]))


def test_experts_hold_each_source_neuron_once_and_the_rest_is_copied_verbatim(moe_path, model_path):
    """Gate and up rows are the source's bytes, the same neuron at the same place in both; down's
    columns are the source's, times k, within Q8_0 rounding (half a step: 1/254 of a block's
    largest value)."""
    with read_gguf(model_path) as dense, read_gguf(moe_path) as moe:
        for name in dense.tensors:
            if not name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")):
                assert np.array_equal(moe.tensor_data(name), dense.tensor_data(name)), name
        for layer in range(dense.metadata["llama.block_count"]):
            prefix = f"blk.{layer}."
            gate = raw_rows(dense, prefix + "ffn_gate.weight")  # [F, row bytes]
            neuron_of = {row.tobytes(): i for i, row in enumerate(gate)}
            gate_stack = raw_rows(moe, prefix + "ffn_gate_exps.weight")  # [E * F/E, row bytes]
            neurons = np.array([neuron_of[row.tobytes()] for row in gate_stack])
            assert sorted(neurons) == list(range(NUM_EXPERTS * EXPERT_WIDTH))
            up = raw_rows(dense, prefix + "ffn_up.weight")[neurons]
            assert np.array_equal(raw_rows(moe, prefix + "ffn_up_exps.weight"), up)
            down = dequantized(dense, prefix + "ffn_down.weight")[:, neurons]  # [H, F], as the experts
            experts = dequantized(moe, prefix + "ffn_down_exps.weight")  # [E, H, F/E]
            moe_down = np.concatenate(list(experts), axis=1) / EXPERTS_USED
            assert np.abs(moe_down - down).max() <= np.abs(down).max() / 254 * 1.01


def test_tierflow_and_llama_cpp_load_it_with_its_expert_counts(moe_path):
    with Engine.load(moe_path, threads=1, context_length=128) as engine:
        config = engine.config
        assert (config.num_experts, config.experts_used, config.expert_ffn_size) == (
            NUM_EXPERTS, EXPERTS_USED, EXPERT_WIDTH)
        ids = engine.tokenize(LONG_TEXT)[:16]
        assert np.isfinite(engine.logits(ids)).all()
    llama = llama_cpp_model(moe_path, n_ctx=128)
    try:
        assert llama.metadata["llama.expert_count"] == str(NUM_EXPERTS)
        assert llama.metadata["llama.expert_used_count"] == str(EXPERTS_USED)
        assert llama.metadata["llama.feed_forward_length"] == str(EXPERT_WIDTH)
        llama.eval(ids)
        assert np.isfinite(llama.scores[: len(ids)]).all()
    finally:
        llama.close()


def test_tierflow_computes_llama_cpps_logits_and_greedy_tokens_on_its_f32_copy(moe_path, tmp_path):
    """On the quantized file llama.cpp rounds activations to 8 bits; that flips top-2 choices, and
    a top-2 of 8 MoEfied model is so far from a language model that a flip moves the logits by
    several units (mean |difference| 3 to 10 measured). In float32 (weights and KV cache) both
    compute the same model exactly: the router's logit gaps (ROUTER_LOGIT_STD) stay far above
    float32 rounding, so no choice flips and the logits agree to ~1e-4."""
    path = write_f32_copy(moe_path, tmp_path / "moe-f32.gguf")
    llama = llama_cpp_model(path, n_ctx=256, f32_kv=True)
    try:
        with Engine.load(path, threads=1, context_length=256, kv_cache_type="f32") as engine:
            ids = engine.tokenize(LONG_TEXT)[:64]
            assert_logits_agree(engine, llama, ids, max_mean_diff=0.01, near_tie=EXACT_TIE)
            assert_greedy_agrees(engine, llama, "The history of the printing press begins in",
                                 near_tie=EXACT_TIE, max_tokens=16)
    finally:
        llama.close()


def test_with_every_expert_used_it_computes_the_dense_model(model_path, f32_model_path, tmp_path):
    """The construction's specification: the experts partition the FFN's neurons, the chosen
    weights are ~1/E and down is scaled by E, so top-E of E is the dense FFN. What it adds is
    rounding (the Q8_0 down stacks, 8-bit activations rounded per expert instead of per FFN), so
    it and the chosen weights' spread around 1/E (which position 0's massive activations magnify)
    are bounded by the model's own quantization noise measured in the same run on the same
    kernels (the Q4_1 model against its F32 copy), not by a figure from one CPU. Measured: mean
    |logit difference| 0.23 on one x86 machine, 0.36 against a noise of 0.19 on another (an AMX
    one), where one position reaches 1.08 (5.6 times the noise); no decided argmax changes."""
    text = CALIBRATION_TEXT.read_text()[:2000]  # the routers' ranking does not matter here
    path = write_moe_from_dense(model_path, tmp_path / "moe-8e8.gguf", NUM_EXPERTS, NUM_EXPERTS, text)
    logits = {}
    for name, model in (("dense", model_path), ("moe", path), ("exact", f32_model_path)):
        with Engine.load(model, threads=1, context_length=128) as engine:
            ids = engine.tokenize(LONG_TEXT)[:64]
            logits[name] = engine.logits(ids)
    dense, moe = logits["dense"], logits["moe"]
    noise = np.abs(dense - logits["exact"]).mean()
    assert np.abs(moe - dense).mean() < 2.5 * noise
    assert np.abs(moe - dense)[1:].mean(axis=-1).max() < 8 * noise
    decided = top2_margin(dense) > NEAR_TIE
    assert np.array_equal(moe.argmax(-1)[decided], dense.argmax(-1)[decided])


def test_routing_over_the_calibration_text_uses_every_expert_and_favours_none(moe_path):
    """Measured: in every layer each expert is among the top-2 of at least 11% of the tokens and
    none of more than 56% (a uniform router: 25% each)."""
    with Engine.load(moe_path, threads=1, context_length=2048) as engine:
        ids = engine.tokenize(CALIBRATION_TEXT.read_text())
        with engine.record_routing() as recorder:
            engine.logits(ids)
    trace = recorder.trace()  # [T, layers, k]
    for i in range(trace.shape[1]):
        share = np.bincount(trace[:, i].ravel(), minlength=NUM_EXPERTS) / len(ids)  # of the tokens
        assert share.min() > 0.02 and share.max() < 0.75, f"layer {i}: {share.round(2)}"


@pytest.fixture(scope="module")
def not_dense_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sources")
    return {"qwen2": write_model(folder / "qwen2.gguf", ModelSpec(arch="qwen2")),
            "moe": write_model(folder / "moe.gguf", ModelSpec(num_experts=4))}


@pytest.mark.parametrize("source, options, problem", [
    ("qwen2", {}, "needs a dense 'llama' model, not 'qwen2'"),
    ("moe", {}, "already a mixture-of-experts model"),
    ("bundled", {"num_experts": 7}, "must split the FFN width 1536"),
    ("bundled", {"num_experts": 96}, "experts of a multiple of 32 neurons"),
    ("bundled", {"num_experts": 1}, "num_experts must be between 2 and 512"),
    ("bundled", {"experts_used": 0}, "experts_used must be between 1 and num_experts 8"),
    ("bundled", {"experts_used": 9}, "experts_used must be between 1 and num_experts 8"),
    ("bundled", {"balance": 1.5}, "balance must be between 0 and 1"),
])
def test_bad_input_is_a_value_error_naming_the_problem(not_dense_llama, model_path, tmp_path, source,
                                                       options, problem):
    dest = tmp_path / "out.gguf"
    with pytest.raises(ValueError, match=problem):
        write_moe_from_dense(not_dense_llama.get(source, model_path), dest, **options)
    assert not dest.exists()


def test_the_command_line_reports_a_bad_option_without_a_traceback(tmp_path):
    with pytest.raises(SystemExit, match="make_moe_from_dense: num_experts 7 must split"):
        main([str(tmp_path / "out.gguf"), "--experts", "7"])
