"""MoEfied models (make_moe_from_dense.py): the bundled SmolLM2 as a Mixtral-style llama MoE and
Qwen2.5-Coder-0.5B as a qwen2moe with a shared expert. llama.cpp and tierflow run them alike, with
every expert used they are the dense model, SmolLM2's routing is spread over the experts, and bad
input is a clear error."""

from pathlib import Path

import numpy as np
import pytest

from tests.support.gguf_bytes import UINT32, Typed
from tests.support.gguf_writing import rewrite_metadata
from tests.support.make_model import ModelSpec, write_f32_copy, write_model
from tests.support.make_moe_from_dense import CALIBRATION_TEXT, main, write_moe_from_dense
from tests.support.oracle import (
    EXACT_TIE,
    LONG_TEXT,
    NEAR_TIE,
    assert_greedy_agrees,
    assert_logits_agree,
    llama_cpp_logits,
    llama_cpp_model,
    top2_margin,
)
from tierflow import Engine
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.offload.gguf.reader import read_gguf

pytestmark = pytest.mark.slow  # MoEfying a real model takes tens of seconds

NUM_EXPERTS, EXPERTS_USED, EXPERT_WIDTH = 8, 2, 1536 // 8
# The 0.5B Qwen's FFN is 4864 wide; the default shared expert holds the 512 left once 8 experts
# take 17 Q8_0 blocks each, as many as leave it at least 1/16 of the neurons.
QWEN_EXPERTS, QWEN_USED, QWEN_EXPERT_WIDTH, QWEN_SHARED_WIDTH = 8, 2, 544, 512


def dequantized(model, name: str) -> np.ndarray:
    info = model.tensors[name]
    return dequantize(model.tensor_data(name), info.ggml_type, info.shape)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory, model_path):
    """The default conversion: 8 experts, top-2, calibrated on moe_calibration.txt (~16 s)."""
    return write_moe_from_dense(model_path, tmp_path_factory.mktemp("moe") / "smollm2-8e2.gguf",
                                NUM_EXPERTS, EXPERTS_USED)


@pytest.fixture(scope="module")
def qwen_moe_path(tmp_path_factory, qwen_05b_path):
    """Qwen2.5-Coder-0.5B as qwen2moe: 8 experts, top-2, the default shared expert (~40 s)."""
    return write_moe_from_dense(qwen_05b_path, tmp_path_factory.mktemp("moe") / "qwen-8e2.gguf",
                                QWEN_EXPERTS, QWEN_USED, threads=2)


def raw_rows(model, name: str) -> np.ndarray:
    """A tensor's raw bytes as rows [rows, row bytes] (numpy order, expert stacks flattened)."""
    info = model.tensors[name]
    return model.tensor_data(name).reshape(-1, info.nbytes // np.prod(info.shape[1:]))


def down_columns(model, name: str) -> np.ndarray:
    """A down tensor's columns [H, neurons]: an expert stack's experts side by side."""
    down = dequantized(model, name)
    return np.concatenate(list(down.reshape(-1, *down.shape[-2:])), axis=1)


# Each source: its MoE file and itself (fixture names), and each kind of expert's down scale,
# the inverse of its weight: llama renormalises the top-k weights (~1/k); qwen2moe weighs the
# routed experts by their softmax over all E (~1/E) and the shared one by sigmoid(~0) = 1/2.
SOURCES = {"llama": ("moe_path", "model_path", {"exps": EXPERTS_USED}),
           "qwen2": ("qwen_moe_path", "qwen_05b_path", {"exps": QWEN_EXPERTS, "shexp": 2})}


@pytest.mark.parametrize("arch", SOURCES)
def test_experts_hold_each_source_neuron_once_and_the_rest_is_copied_verbatim(request, arch):
    """Gate and up rows are the source's bytes, the same neuron at the same place in both, and
    each neuron is in one expert (routed or shared); down's columns are the source's, times the
    down scale, within Q8_0 rounding (half a step: 1/254 of a block's largest value)."""
    moe_name, dense_name, down_scales = SOURCES[arch]
    with read_gguf(request.getfixturevalue(dense_name)) as dense, \
            read_gguf(request.getfixturevalue(moe_name)) as moe:
        for name in dense.tensors:
            if not name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")):
                assert np.array_equal(moe.tensor_data(name), dense.tensor_data(name)), name
        for layer in range(dense.metadata[f"{arch}.block_count"]):
            prefix, held = f"blk.{layer}.", []
            gate = raw_rows(dense, prefix + "ffn_gate.weight")  # [F, row bytes]
            neuron_of = {row.tobytes(): i for i, row in enumerate(gate)}
            for kind, scale in down_scales.items():
                rows = raw_rows(moe, f"{prefix}ffn_gate_{kind}.weight")  # [neurons, row bytes]
                neurons = np.array([neuron_of[row.tobytes()] for row in rows])
                up = raw_rows(dense, prefix + "ffn_up.weight")[neurons]
                assert np.array_equal(raw_rows(moe, f"{prefix}ffn_up_{kind}.weight"), up)
                down = dequantized(dense, prefix + "ffn_down.weight")[:, neurons]  # [H, neurons]
                moe_down = down_columns(moe, f"{prefix}ffn_down_{kind}.weight") / scale
                assert np.abs(moe_down - down).max() <= np.abs(down).max() / 254 * 1.01
                held.extend(neurons)
            assert sorted(held) == list(range(len(gate)))


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
    assert_f32_copy_agrees_with_llama_cpp(moe_path, tmp_path)


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


def test_a_qwen2_source_becomes_a_qwen2moe_with_the_experts_asked_and_a_shared_one(qwen_moe_path):
    llama = llama_cpp_model(qwen_moe_path, n_ctx=64)
    try:
        keys = ("expert_count", "expert_used_count", "expert_feed_forward_length",
                "expert_shared_feed_forward_length")
        assert llama.metadata["general.architecture"] == "qwen2moe"
        assert [llama.metadata[f"qwen2moe.{key}"] for key in keys] == [
            str(QWEN_EXPERTS), str(QWEN_USED), str(QWEN_EXPERT_WIDTH), str(QWEN_SHARED_WIDTH)]
    finally:
        llama.close()
    with Engine.load(qwen_moe_path, threads=1, context_length=64) as engine:
        config = engine.config
        assert (config.arch, config.num_experts, config.experts_used, config.expert_ffn_size,
                config.shared_expert_ffn_size) == (
            "qwen2moe", QWEN_EXPERTS, QWEN_USED, QWEN_EXPERT_WIDTH, QWEN_SHARED_WIDTH)


@pytest.fixture(scope="module")
def every_expert_logits(qwen_moe_path, qwen_05b_path, tmp_path_factory) -> dict[str, np.ndarray]:
    """Logits of LONG_TEXT's first 64 tokens from tierflow and llama.cpp, on the dense 0.5B Qwen and
    on a copy of its MoE that uses every expert (expert_used_count E): "dense tierflow", "dense
    llama.cpp", "moe tierflow", "moe llama.cpp"."""
    every = rewrite_metadata(qwen_moe_path, tmp_path_factory.mktemp("moe") / "qwen-8e8.gguf",
                             {"qwen2moe.expert_used_count": Typed(UINT32, QWEN_EXPERTS)})
    logits = {}
    for name, path in (("dense", qwen_05b_path), ("moe", every)):
        with Engine.load(path, threads=2, context_length=128) as engine:
            ids = engine.tokenize(LONG_TEXT)[:64]
            logits[f"{name} tierflow"] = engine.logits(ids)
        llama = llama_cpp_model(path, n_ctx=128)
        try:
            logits[f"{name} llama.cpp"] = llama_cpp_logits(llama, ids)
        finally:
            llama.close()
    return logits


def assert_alike(logits: np.ndarray, reference: np.ndarray, noise: float) -> None:
    """Within twice `noise` on average, and the same top token wherever both see a clear lead."""
    assert np.abs(logits - reference).mean() < 2 * noise
    decided = np.minimum(top2_margin(logits), top2_margin(reference)) > NEAR_TIE
    assert np.array_equal(logits.argmax(-1)[decided], reference.argmax(-1)[decided])


def test_with_every_expert_used_a_qwen2moe_computes_the_dense_model(every_expert_logits):
    """Every routed expert's weight is its softmax, ~1/E, and its down is scaled by E; the shared
    expert's gate is sigmoid(~0) = 1/2 and its down is scaled by 2: top-E of E is the dense FFN.
    What it adds (the Q8_0 rounding of down, the weights' spread around 1/E) is bounded by the
    noise of two correct computations of the dense model, tierflow's and llama.cpp's. Measured:
    0.075 against that noise of 0.070."""
    logits = every_expert_logits
    noise = np.abs(logits["dense tierflow"] - logits["dense llama.cpp"]).mean()
    assert_alike(logits["moe tierflow"], logits["dense tierflow"], noise)


def test_tierflow_computes_llama_cpps_logits_on_a_qwen2moe_with_every_expert_used(every_expert_logits):
    """On the quantized file at top-2 each side's 8-bit activations flip routing choices where the
    k-th and (k+1)-th experts nearly tie, which the fitted routers leave many of: the mean |logit
    difference| on a stretch of 64 tokens was 0.8 to 1.9 times llama.cpp's own (its batch against
    token by token), too scattered to bound (the generated qwen2's F32 test checks top-k). With
    every expert used nothing is chosen, and the two agree as on the dense file. Measured: 0.054
    against the dense file's 0.070."""
    logits = every_expert_logits
    noise = np.abs(logits["dense tierflow"] - logits["dense llama.cpp"]).mean()
    assert_alike(logits["moe tierflow"], logits["moe llama.cpp"], noise)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A generated qwen2 with float32 weights, whose head is its embedding (tied)."""
    spec = ModelSpec(arch="qwen2", ffn_size=512, weight_type="F32", embedding_type="F32")
    return write_model(tmp_path_factory.mktemp("qwen2") / "qwen2-f32.gguf", spec)


def test_tierflow_computes_llama_cpps_logits_and_greedy_tokens_on_a_float32_qwen2moe(tiny_qwen2, tmp_path):
    """In float32 (weights and KV cache) both compute the same qwen2moe exactly: the routed
    experts' softmax weights, the shared expert's constant gate and the downs' scales mean the
    same to both, and a tied source's head is there as llama.cpp's qwen2moe requires it
    (output.weight). Measured: a mean |logit difference| of 3e-6."""
    moe = write_moe_from_dense(tiny_qwen2, tmp_path / "moe.gguf", 4, 2)
    assert_f32_copy_agrees_with_llama_cpp(moe, tmp_path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, qwen_05b_path):
    folder = tmp_path_factory.mktemp("sources")
    return {"qwen3": write_model(folder / "qwen3.gguf", ModelSpec(arch="qwen3")),
            "moe": write_model(folder / "moe.gguf", ModelSpec(num_experts=4)),
            "qwen2": qwen_05b_path}


@pytest.mark.parametrize("source, options, problem", [
    ("qwen3", {}, "needs a dense 'llama' or 'qwen2' model, not 'qwen3'"),
    ("moe", {}, "already a mixture-of-experts model"),
    ("bundled", {"num_experts": 7}, "must split the FFN width 1536"),
    ("bundled", {"num_experts": 96}, "experts of a multiple of 32 neurons"),
    ("bundled", {"num_experts": 1}, "num_experts must be between 2 and 512"),
    ("bundled", {"experts_used": 0}, "experts_used must be between 1 and num_experts 8"),
    ("bundled", {"experts_used": 9}, "experts_used must be between 1 and num_experts 8"),
    ("bundled", {"balance": 1.5}, "balance must be between 0 and 1"),
    ("bundled", {"shared_width": 256}, "a llama MoE has no shared expert"),
    ("qwen2", {"num_experts": 7, "shared_width": 512},
     "num_experts 7 must split the FFN width 4864 less the shared expert's 512 neurons, 4352,"),
    ("qwen2", {"shared_width": 500}, "shared expert .* of a multiple of 32 neurons .* got 500"),
    ("qwen2", {"shared_width": 0}, "needs a shared expert"),
])
def test_bad_input_is_a_value_error_naming_the_problem(sources, model_path, tmp_path, source, options,
                                                       problem):
    dest = tmp_path / "out.gguf"
    with pytest.raises(ValueError, match=problem):
        write_moe_from_dense(sources.get(source, model_path), dest, **options)
    assert not dest.exists()


@pytest.mark.parametrize("options, problem", [
    (["--experts", "7"], "num_experts 7 must split the FFN width 1536"),
    (["--source", "{qwen2}", "--experts", "7", "--shared-width", "512"],
     "num_experts 7 must split the FFN width 4864 less the shared expert's 512"),
])
def test_the_command_line_reports_a_bad_option_without_a_traceback(qwen_05b_path, tmp_path, options, problem):
    argv = [str(tmp_path / "out.gguf"), *(option.format(qwen2=qwen_05b_path) for option in options)]
    with pytest.raises(SystemExit, match=f"make_moe_from_dense: {problem}"):
        main(argv)


def assert_f32_copy_agrees_with_llama_cpp(moe: Path, tmp_path: Path) -> None:
    """tierflow's logits and greedy tokens are llama.cpp's on the file's float32 copy, whose KV cache
    is float32 too: both compute the same model exactly there."""
    path = write_f32_copy(moe, tmp_path / "moe-f32.gguf")
    llama = llama_cpp_model(path, n_ctx=256, f32_kv=True)
    try:
        with Engine.load(path, threads=1, context_length=256, kv_cache_type="f32") as engine:
            ids = engine.tokenize(LONG_TEXT)[:64]
            assert_logits_agree(engine, llama, ids, max_mean_diff=0.01, near_tie=EXACT_TIE)
            assert_greedy_agrees(engine, llama, "The history of the printing press begins in",
                                 near_tie=EXACT_TIE, max_tokens=16)
    finally:
        llama.close()
