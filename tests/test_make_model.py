"""The model generator: llama.cpp runs its files, they hold what the spec says, and F32 copies
hold their source's weights exactly."""

import math

import gguf
import llama_cpp
import numpy as np
import pytest

from tests.support.gguf_bytes import build_tiny_gguf
from tests.support.make_model import (
    ModelSpec,
    file_bytes,
    main,
    spec_for_size,
    write_f32_copy,
    write_model,
)
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.offload.gguf.reader import read_gguf
from tierflow.offload.store.model_path import bundled_model_path

TOKENS = [1, 17, 504, 2127, 9090, 30000, 48000, 12]
VOCAB_SIZE = 49152
WIDE = {"hidden_size": 256, "ffn_size": 512}  # row lengths that K-quant blocks divide
MOE_SPECS = [  # 4 experts, top 2, one of each MoE arch llama.cpp runs
    ModelSpec(arch="llama", num_experts=4, experts_used=2),
    ModelSpec(arch="qwen2moe", num_experts=4, experts_used=2, expert_ffn_size=64,
              shared_expert_ffn_size=96),
    ModelSpec(arch="olmoe", num_experts=4, experts_used=2, num_kv_heads=4),
]


def spec_id(spec: ModelSpec) -> str:
    experts = f"-{spec.num_experts}e{spec.experts_used}" if spec.num_experts else ""
    return f"{spec.arch}{experts}-{spec.weight_type}-{spec.embedding_type}"


def llama_logits(path, tokens=TOKENS, **options) -> np.ndarray:
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False,
                          **options)
    llm.eval(tokens)
    return np.array(llm.scores[:len(tokens)])  # [T, vocab]


def fields(path) -> dict:
    """Metadata with arrays as lists, so that dicts compare."""
    with read_gguf(path) as model:
        return {key: value.tolist() if isinstance(value, np.ndarray) else value
                for key, value in model.metadata.items()}


def tensors(path) -> dict:
    """name -> (GGUF shape, i.e. row length first; type name), in file order."""
    with read_gguf(path) as model:
        return {name: (t.shape, t.type_name) for name, t in model.tensors.items()}


def tensor_values(path, name, max_rows=None) -> np.ndarray:
    """The first `max_rows` rows of a tensor, dequantized by gguf.quants: [rows, row_length]."""
    with read_gguf(path) as model:
        tensor = model.tensors[name]
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.ggml_type]
        rows = min(math.prod(tensor.shape[1:]), max_rows or math.inf)
        row_bytes = tensor.shape[0] // block_size * type_size
        data = np.array(model.tensor_data(name)[:rows * row_bytes]).reshape(rows, row_bytes)
    return gguf.quants.dequantize(data, tensor.ggml_type)


@pytest.fixture(scope="module")
def sized_model(tmp_path_factory):
    spec = spec_for_size(50 * 10**6)
    return spec, write_model(tmp_path_factory.mktemp("sized") / "m.gguf", spec)


@pytest.mark.parametrize("spec", [
    ModelSpec(arch="llama"),
    ModelSpec(arch="qwen2"),
    ModelSpec(arch="llama", weight_type="Q4_K", embedding_type="Q6_K", **WIDE),
    ModelSpec(arch="qwen2", weight_type="Q5_K", embedding_type="Q4_K", **WIDE),
    ModelSpec(arch="llama", weight_type="Q6_K", embedding_type="Q8_0", tied_embeddings=False,
              **WIDE),
    ModelSpec(arch="qwen2", weight_type="Q4_0", embedding_type="F16"),
    ModelSpec(arch="llama", weight_type="Q5_1", embedding_type="BF16", rope_scaling="yarn",
              rope_scaling_factor=4.0),
    ModelSpec(arch="llama", weight_type="F32", llama3_rope_freqs=True, rope_scaling="linear",
              rope_scaling_factor=2.0),
    *MOE_SPECS,
    ModelSpec(arch="llama", num_experts=4, experts_used=1, weight_type="Q4_0",
              embedding_type="F16", hidden_size=128, ffn_size=192),
    ModelSpec(arch="qwen2moe", num_experts=4, experts_used=3, weight_type="F16",
              embedding_type="Q8_0", hidden_size=128),
], ids=spec_id)
def test_llama_cpp_gives_finite_spread_logits(tmp_path, spec):
    logits = llama_logits(write_model(tmp_path / "m.gguf", spec))
    assert logits.shape == (len(TOKENS), VOCAB_SIZE)
    assert np.isfinite(logits).all()
    assert logits.std(axis=1).min() > 2.0
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert np.median(top2[:, 1] - top2[:, 0]) > 0.05 * logits.std()


@pytest.mark.parametrize("spec", [ModelSpec(arch="llama"), ModelSpec(arch="qwen2"), *MOE_SPECS],
                         ids=lambda s: spec_id(s).removesuffix("-Q8_0-Q8_0"))
def test_argmax_depends_on_the_layers_not_just_the_input_token(tmp_path, spec):
    # With tied embeddings a token's own embedding could dominate its logits; the residual
    # gain keeps the layers' output in charge.
    tokens = list(range(100, 24100, 1000))
    argmax = llama_logits(write_model(tmp_path / "m.gguf", spec), tokens).argmax(1)
    assert np.mean(argmax == tokens) < 0.2
    assert len(set(argmax)) > len(tokens) // 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_architecture_metadata_follows_the_spec(tmp_path, arch):
    spec = ModelSpec(arch=arch, num_layers=3, hidden_size=128, ffn_size=320, num_heads=8,
                     num_kv_heads=2, context_length=512, rope_theta=5e5)
    got = fields(write_model(tmp_path / "m.gguf", spec))
    assert got["general.architecture"] == arch
    assert got["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    expected = {"block_count": 3, "context_length": 512, "embedding_length": 128,
                "feed_forward_length": 320, "attention.head_count": 8,
                "attention.head_count_kv": 2, "rope.freq_base": 5e5,
                "rope.dimension_count": 16, "vocab_size": VOCAB_SIZE}
    assert {key: got[f"{arch}.{key}"] for key in expected} == expected
    assert got[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert not any(".rope.scaling." in key for key in got)


@pytest.mark.parametrize("scaling, keys", [
    ("linear", {"type": "linear", "factor": 4.0}),
    ("yarn", {"type": "yarn", "factor": 4.0, "original_context_length": 64}),
])
def test_rope_scaling_writes_its_keys(tmp_path, scaling, keys):
    spec = ModelSpec(rope_scaling=scaling, rope_scaling_factor=4.0)
    got = fields(write_model(tmp_path / "m.gguf", spec))
    written = {key.removeprefix("llama.rope.scaling."): value for key, value in got.items()
               if key.startswith("llama.rope.scaling.")}
    assert written == keys


def test_tokenizer_metadata_is_copied_from_smollm2(tmp_path):
    source = fields(bundled_model_path())
    got = fields(write_model(tmp_path / "m.gguf", ModelSpec()))
    tokenizer_keys = {key for key in source if key.startswith("tokenizer.")}
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
            "tokenizer.ggml.bos_token_id"} <= tokenizer_keys
    assert {key: got[key] for key in tokenizer_keys} == {key: source[key] for key in tokenizer_keys}


def test_tensors_have_llama_cpp_names_shapes_and_types(tmp_path):
    spec = ModelSpec(num_layers=2, hidden_size=64, ffn_size=96, num_heads=4, num_kv_heads=1,
                     weight_type="Q4_1", embedding_type="F16")
    per_layer = {"attn_norm.weight": ((64,), "F32"), "attn_q.weight": ((64, 64), "Q4_1"),
                 "attn_k.weight": ((64, 16), "Q4_1"), "attn_v.weight": ((64, 16), "Q4_1"),
                 "attn_output.weight": ((64, 64), "Q4_1"), "ffn_norm.weight": ((64,), "F32"),
                 "ffn_gate.weight": ((64, 96), "Q4_1"), "ffn_up.weight": ((64, 96), "Q4_1"),
                 "ffn_down.weight": ((96, 64), "Q4_1")}
    expected = {"token_embd.weight": ((64, VOCAB_SIZE), "F16"),
                "output_norm.weight": ((64,), "F32")}
    expected |= {f"blk.{i}.{name}": info for i in range(2) for name, info in per_layer.items()}
    assert tensors(write_model(tmp_path / "m.gguf", spec)) == expected


@pytest.mark.parametrize("arch, has_biases", [("llama", False), ("qwen2", True)])
def test_only_qwen2_has_qkv_biases(tmp_path, arch, has_biases):
    got = tensors(write_model(tmp_path / "m.gguf", ModelSpec(arch=arch, num_kv_heads=1)))
    biases = {name: info for name, info in got.items() if name.endswith(".bias")}
    expected = {f"blk.{i}.attn_{p}.bias": ((size,), "F32") for i in range(2)
                for p, size in (("q", 64), ("k", 16), ("v", 16))}
    assert biases == (expected if has_biases else {})


@pytest.mark.parametrize("tied", [True, False])
def test_output_weight_exists_only_when_untied(tmp_path, tied):
    got = tensors(write_model(tmp_path / "m.gguf", ModelSpec(tied_embeddings=tied)))
    assert ("output.weight" in got) != tied
    if not tied:
        assert got["output.weight"] == ((64, VOCAB_SIZE), "Q8_0")


def test_llama3_rope_freqs_holds_factors_from_1_to_8(tmp_path):
    path = write_model(tmp_path / "m.gguf", ModelSpec(llama3_rope_freqs=True))
    (factors,) = tensor_values(path, "rope_freqs.weight")
    assert factors.shape == (8,)  # head_dim / 2
    assert factors[0] == 1.0 and factors[-1] == 8.0
    assert np.all(np.diff(factors) >= 0)


def test_weights_are_deterministic_per_seed(tmp_path):
    first = write_model(tmp_path / "a.gguf", ModelSpec(seed=3)).read_bytes()
    again = write_model(tmp_path / "b.gguf", ModelSpec(seed=3)).read_bytes()
    other = write_model(tmp_path / "c.gguf", ModelSpec(seed=4)).read_bytes()
    assert first == again
    assert len(first) == len(other) and first != other


@pytest.mark.parametrize("weight_type", ["F32", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"])
def test_dequantized_weights_have_std_near_one_over_sqrt_fan_in(tmp_path, weight_type):
    path = write_model(tmp_path / "m.gguf", ModelSpec(weight_type=weight_type, **WIDE))
    values = tensor_values(path, "blk.0.ffn_up.weight")
    assert values.std() == pytest.approx(1 / math.sqrt(256), rel=0.15)
    assert abs(values.mean()) < 0.1 * values.std()


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                                         "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "TQ1_0",
                                         "TQ2_0"])
def test_large_tensors_get_random_blocks_with_the_same_spread(tmp_path, weight_type):
    # The 49152-row embedding is past the quantize limit: its blocks are drawn directly.
    spec = ModelSpec(embedding_type=weight_type, **WIDE)
    values = tensor_values(write_model(tmp_path / "m.gguf", spec), "token_embd.weight", 4096)
    assert np.isfinite(values).all()
    assert values.std() == pytest.approx(8 / math.sqrt(256), rel=0.1)  # logits get std ~8
    assert abs(values.mean()) < 0.02 * values.std()


def test_spec_for_size_gives_a_file_of_about_the_asked_size(sized_model):
    spec, path = sized_model
    assert spec.arch == "llama" and spec.num_layers >= 16
    assert path.stat().st_size == pytest.approx(50 * 10**6, rel=0.02)


def test_file_bytes_is_the_written_size(sized_model):
    spec, path = sized_model
    assert file_bytes(spec) == path.stat().st_size


@pytest.mark.parametrize("num_bytes", [10**9, 2 * 10**9, 4 * 10**9])
def test_spec_for_size_estimates_gigabyte_models_closely(num_bytes):
    spec = spec_for_size(num_bytes, weight_type="Q4_K", embedding_type="Q6_K")
    assert file_bytes(spec) == pytest.approx(num_bytes, rel=0.02)
    assert spec.num_layers >= 16 and spec.weight_type == "Q4_K"


def test_spec_for_size_refuses_shape_overrides():
    with pytest.raises(ValueError, match="num_layers"):
        spec_for_size(10**8, num_layers=4)


@pytest.mark.parametrize("fields_", [
    {"arch": "gpt2"},
    {"weight_type": "Q4_K"},           # hidden 64 is not a multiple of 256
    {"embedding_type": "Q3_K"},
    {"num_heads": 3},
    {"num_kv_heads": 3},
    {"rope_scaling": "ntk"},
    {"rope_scaling_factor": 2.0},      # a factor without a scaling type
    {"arch": "qwen2", "llama3_rope_freqs": True},
    {"num_layers": 0},
])
def test_invalid_specs_are_rejected(fields_):
    with pytest.raises(ValueError):
        ModelSpec(**fields_)


def test_cli_writes_the_asked_model(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    main([str(out), "--arch", "qwen2", "--layers", "3", "--hidden", "128", "--untied"])
    assert capsys.readouterr().out.startswith(f"{out} {out.stat().st_size} bytes")
    got = fields(out)
    assert (got["general.architecture"], got["qwen2.block_count"]) == ("qwen2", 3)
    assert "output.weight" in tensors(out)


def test_cli_size_option_picks_the_shape(tmp_path, capsys):
    out = tmp_path / "sized.gguf"
    main([str(out), "--size", "20MB", "--weight-type", "Q4_0"])
    assert out.stat().st_size == pytest.approx(20 * 10**6, rel=0.02)
    assert tensors(out)["blk.0.attn_q.weight"][1] == "Q4_0"


def test_cli_f32_copy_of_writes_an_all_f32_copy(tmp_path, capsys):
    source = write_model(tmp_path / "m.gguf", ModelSpec(weight_type="Q4_0"))
    out = tmp_path / "f32.gguf"
    main([str(out), "--f32-copy-of", str(source)])
    assert capsys.readouterr().out.startswith(f"{out} {out.stat().st_size} bytes")
    got, expected = tensors(out), tensors(source)
    assert got == {name: (shape, "F32") for name, (shape, _) in expected.items()}


@pytest.mark.parametrize("argv", [["--layers", "3"], ["--size", "20MB"]])
def test_cli_f32_copy_of_refuses_spec_options(tmp_path, argv):
    with pytest.raises(SystemExit, match="f32-copy-of takes no other option"):
        main([str(tmp_path / "f32.gguf"), "--f32-copy-of", str(bundled_model_path()), *argv])


# ---------------------------------------------------------------------------------------------
# Mixture of experts


def attention_tensors(spec: ModelSpec) -> dict:
    """One layer's attention tensors (GGUF shapes), biases and q/k norms as the arch has them."""
    h, kv = spec.hidden_size, spec.kv_size
    got = {"attn_norm.weight": ((h,), "F32"), "attn_q.weight": ((h, h), "Q8_0"),
           "attn_k.weight": ((h, kv), "Q8_0"), "attn_v.weight": ((h, kv), "Q8_0"),
           "attn_output.weight": ((h, h), "Q8_0"), "ffn_norm.weight": ((h,), "F32")}
    if spec.arch == "qwen2moe":
        got |= {f"attn_{p}.bias": ((size,), "F32") for p, size in (("q", h), ("k", kv), ("v", kv))}
    if spec.arch == "olmoe":
        got |= {"attn_q_norm.weight": ((h,), "F32"), "attn_k_norm.weight": ((kv,), "F32")}
    return got


@pytest.mark.parametrize("spec", [
    ModelSpec(arch="llama", num_experts=4, experts_used=2, ffn_size=96),
    ModelSpec(arch="qwen2moe", num_experts=4, experts_used=1, expert_ffn_size=32,
              shared_expert_ffn_size=160),
    ModelSpec(arch="olmoe", num_experts=4, experts_used=2, num_kv_heads=4, ffn_size=96),
], ids=lambda s: s.arch)
def test_moe_tensors_have_llama_cpp_names_shapes_and_types(tmp_path, spec):
    h, e, f = spec.hidden_size, spec.num_experts, spec.expert_ffn_width
    per_layer = attention_tensors(spec) | {
        "ffn_gate_inp.weight": ((h, e), "F32"),  # the router, never quantized
        "ffn_gate_exps.weight": ((h, f, e), "Q8_0"), "ffn_up_exps.weight": ((h, f, e), "Q8_0"),
        "ffn_down_exps.weight": ((f, h, e), "Q8_0")}
    if spec.arch == "qwen2moe":
        s = spec.shared_expert_ffn_width
        per_layer |= {"ffn_gate_inp_shexp.weight": ((h,), "F32"),
                      "ffn_gate_shexp.weight": ((h, s), "Q8_0"),
                      "ffn_up_shexp.weight": ((h, s), "Q8_0"),
                      "ffn_down_shexp.weight": ((s, h), "Q8_0")}
    expected = {"token_embd.weight": ((h, VOCAB_SIZE), "Q8_0"), "output_norm.weight": ((h,), "F32")}
    expected |= {f"blk.{i}.{name}": info for i in range(2) for name, info in per_layer.items()}
    if spec.arch != "llama":  # llama.cpp requires output.weight for qwen2moe and olmoe
        expected["output.weight"] = ((h, VOCAB_SIZE), "Q8_0")
    assert tensors(write_model(tmp_path / "m.gguf", spec)) == expected


@pytest.mark.parametrize("spec, keys", [
    (ModelSpec(arch="llama", num_experts=8, experts_used=2, ffn_size=96),
     {"expert_count": 8, "expert_used_count": 2, "feed_forward_length": 96}),
    (ModelSpec(arch="qwen2moe", num_experts=6, experts_used=4, ffn_size=256,
               expert_ffn_size=64, shared_expert_ffn_size=192),
     {"expert_count": 6, "expert_used_count": 4, "feed_forward_length": 256,
      "expert_feed_forward_length": 64, "expert_shared_feed_forward_length": 192}),
    (ModelSpec(arch="qwen2moe", num_experts=4, ffn_size=96),  # widths default to ffn_size
     {"expert_count": 4, "expert_used_count": 2, "feed_forward_length": 96,
      "expert_feed_forward_length": 96, "expert_shared_feed_forward_length": 96}),
    (ModelSpec(arch="olmoe", num_experts=4, experts_used=1, num_kv_heads=4, ffn_size=96),
     {"expert_count": 4, "expert_used_count": 1, "feed_forward_length": 96}),
], ids=["llama", "qwen2moe", "qwen2moe-default-widths", "olmoe"])
def test_moe_metadata_has_the_expert_keys_llama_cpp_reads(tmp_path, spec, keys):
    got = fields(write_model(tmp_path / "m.gguf", spec))
    written = {key.removeprefix(f"{spec.arch}."): value for key, value in got.items()
               if "expert" in key or key.endswith(".feed_forward_length")}
    assert got["general.architecture"] == spec.arch
    assert written == keys


def test_dense_models_have_no_expert_keys(tmp_path):
    got = fields(write_model(tmp_path / "m.gguf", ModelSpec()))
    assert not [key for key in got if "expert" in key]


def router_scores(path, token_ids, layer_idx=0) -> np.ndarray:
    """The layer's router logits for the tokens' own embeddings, RMS-normed and scaled by
    ffn_norm as llama.cpp feeds the router (attention left out): [T, E]."""
    with read_gguf(path) as model:
        def weight(name):
            info = model.tensors[name]
            return dequantize(model.tensor_data(name), info.ggml_type, info.shape)
        embd = model.tensors["token_embd.weight"]
        rows = np.array(model.tensor_data(embd.name)).reshape(embd.shape[1], -1)[token_ids]
        x = dequantize(rows.ravel(), embd.ggml_type, (embd.shape[0], len(token_ids)))  # [T, h]
        x = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-5)
        x *= weight(f"blk.{layer_idx}.ffn_norm.weight")
        return x @ weight(f"blk.{layer_idx}.ffn_gate_inp.weight").T


SPREAD_TOKENS = list(range(7, 48000, 1600))  # 30 tokens


@pytest.mark.parametrize("spec", MOE_SPECS, ids=lambda s: s.arch)
def test_router_spreads_tokens_over_the_experts(tmp_path, spec):
    scores = router_scores(write_model(tmp_path / "m.gguf", spec), SPREAD_TOKENS)
    chosen = np.argsort(-scores, axis=1)[:, :spec.experts_used]  # [T, k]
    picks = np.bincount(chosen.ravel(), minlength=spec.num_experts)
    assert (picks > 0).all()  # every expert is someone's choice
    assert picks.max() < 0.8 * len(SPREAD_TOKENS)  # and none is everyone's
    assert len({tuple(sorted(row)) for row in chosen}) >= 4  # tokens differ in their sets


@pytest.mark.parametrize("spec", MOE_SPECS, ids=lambda s: s.arch)
def test_router_scores_have_std_about_two_and_clear_margins(tmp_path, spec):
    # Margins between the k-th and (k+1)-th score, so that slightly different hidden states
    # (llama.cpp rounds activations to 8 bits for Q8_0 weights) rarely flip a choice.
    scores = router_scores(write_model(tmp_path / "m.gguf", spec), SPREAD_TOKENS)
    assert scores.std() == pytest.approx(2.0, rel=0.3)
    ranked = np.sort(scores, axis=1)[:, ::-1]
    margins = ranked[:, spec.experts_used - 1] - ranked[:, spec.experts_used]
    assert np.median(margins) > 0.3 and np.mean(margins < 0.1) < 0.25


def test_moe_expert_weights_have_std_near_gain_over_sqrt_fan_in(tmp_path):
    spec = ModelSpec(num_experts=4, hidden_size=128, ffn_size=256)
    path = write_model(tmp_path / "m.gguf", spec)
    up, down = (tensor_values(path, f"blk.0.ffn_{name}_exps.weight") for name in ("up", "down"))
    assert up.shape == (4 * 256, 128) and down.shape == (4 * 128, 256)
    assert up.std() == pytest.approx(1 / math.sqrt(128), rel=0.1)
    assert down.std() == pytest.approx(5 / math.sqrt(256), rel=0.1)  # routed experts' gain


@pytest.mark.parametrize("overrides", [
    {"num_experts": 8, "experts_used": 2},
    {"num_experts": 8, "experts_used": 2, "weight_type": "Q4_K", "embedding_type": "Q6_K"},
    {"arch": "qwen2moe", "num_experts": 8, "experts_used": 2},
    {"arch": "olmoe", "num_experts": 8, "experts_used": 2},
], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_spec_for_size_sizes_moe_models_within_3_percent(overrides):
    spec = spec_for_size(2 * 10**9, **overrides)
    assert file_bytes(spec) == pytest.approx(2 * 10**9, rel=0.03)
    assert spec.arch == overrides.get("arch", "llama") and spec.num_layers >= 16
    assert (spec.num_experts, spec.experts_used) == (8, 2)


@pytest.mark.parametrize("spec", MOE_SPECS, ids=lambda s: s.arch)
def test_file_bytes_is_the_written_size_of_moe_models(tmp_path, spec):
    assert file_bytes(spec) == write_model(tmp_path / "m.gguf", spec).stat().st_size


def test_spec_for_size_refuses_expert_widths():
    with pytest.raises(ValueError, match="expert_ffn_size"):
        spec_for_size(10**8, num_experts=4, expert_ffn_size=256)


@pytest.mark.parametrize("fields_, message", [
    ({"num_experts": 1}, r"num_experts must be between 2 and 512 \(or 0: dense\)"),
    ({"num_experts": -2}, "num_experts must be between 2"),
    ({"num_experts": 513}, "num_experts must be between 2"),
    ({"arch": "qwen2moe", "num_experts": 1}, r"between 2 and 512, got 1"),
    ({"num_experts": 4, "experts_used": 0}, "experts_used"),
    ({"num_experts": 4, "experts_used": 5}, "experts_used"),
    ({"arch": "qwen2moe"}, "at least 2"),
    ({"arch": "olmoe"}, "at least 2"),
    ({"arch": "qwen2", "num_experts": 4}, "no experts"),
    ({"arch": "qwen2moe", "num_experts": 4, "tied_embeddings": True}, "output.weight"),
    ({"arch": "olmoe", "num_experts": 4}, "num_kv_heads"),  # k norm is hidden_size wide
    ({"num_experts": 4, "expert_ffn_size": 64}, "feed_forward_length"),
    ({"num_experts": 4, "shared_expert_ffn_size": 64}, "no shared expert"),
    ({"expert_ffn_size": 64}, "need num_experts"),
    ({"arch": "qwen2moe", "num_experts": 4, "expert_ffn_size": 48}, "do not divide"),
    ({"arch": "qwen2moe", "num_experts": 4, "shared_expert_ffn_size": 0}, "positive"),
    ({"arch": "qwen2moe", "num_experts": 4, "weight_type": "Q4_K", "hidden_size": 256,
      "ffn_size": 256, "expert_ffn_size": 128}, "do not divide"),
])
def test_invalid_moe_specs_are_rejected(fields_, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec(**fields_)


def test_cli_writes_a_moe_model(tmp_path, capsys):
    out = tmp_path / "moe.gguf"
    main([str(out), "--arch", "qwen2moe", "--experts", "4", "--experts-used", "1",
          "--expert-ffn", "64", "--shared-expert-ffn", "96"])
    got = fields(out)
    assert (got["qwen2moe.expert_count"], got["qwen2moe.expert_used_count"]) == (4, 1)
    assert (got["qwen2moe.expert_feed_forward_length"],
            got["qwen2moe.expert_shared_feed_forward_length"]) == (64, 96)
    assert tensors(out)["blk.0.ffn_up_exps.weight"] == ((64, 64, 4), "Q8_0")


def test_cli_size_option_takes_experts(tmp_path, capsys):
    out = tmp_path / "sized.gguf"
    main([str(out), "--size", "20MB", "--experts", "4", "--experts-used", "2"])
    assert out.stat().st_size == pytest.approx(20 * 10**6, rel=0.03)
    assert fields(out)["llama.expert_count"] == 4


# ---------------------------------------------------------------------------------------------
# F32 copies


@pytest.fixture(scope="module", params=["smollm2", "random-kquant", "random-moe"])
def f32_copy(request, tmp_path_factory):
    """(source, its F32 copy): the bundled Q4_1/Q8_0 model, a generated one with K-quant,
    BF16 and F32 tensors, and a generated MoE one with 3-D expert stacks."""
    folder = tmp_path_factory.mktemp("f32")
    if request.param == "smollm2":
        source = bundled_model_path()
    elif request.param == "random-moe":
        source = write_model(folder / "source.gguf", MOE_SPECS[1])
    else:
        spec = ModelSpec(arch="qwen2", weight_type="Q4_K", embedding_type="BF16",
                         tied_embeddings=False, **WIDE)
        source = write_model(folder / "source.gguf", spec)
    copy = write_f32_copy(source, folder / "f32.gguf")
    yield source, copy
    copy.unlink()  # the SmolLM2 copy is 540 MB


def test_f32_copy_keeps_the_metadata_but_file_type(f32_copy):
    source, copy = f32_copy
    got, expected = fields(copy), fields(source)
    assert expected["general.file_type"] != 0 and got.pop("general.file_type") == 0
    assert list(got) == [key for key in expected if key != "general.file_type"]
    assert got == {key: value for key, value in expected.items() if key != "general.file_type"}


def test_f32_copy_has_the_source_tensors_in_f32(f32_copy):
    source, copy = f32_copy
    got, expected = tensors(copy), tensors(source)
    assert list(got) == list(expected)
    assert got == {name: (shape, "F32") for name, (shape, _) in expected.items()}


def test_f32_copy_values_are_the_dequantized_source(f32_copy):
    source, copy = f32_copy
    with read_gguf(source) as original, read_gguf(copy) as f32:
        for name, info in original.tensors.items():
            expected = dequantize(original.tensor_data(name), info.ggml_type, info.shape)
            got = f32.tensor_data(name).view(np.float32).reshape(expected.shape)
            assert np.array_equal(got, expected), name


def test_llama_cpp_runs_the_f32_copy_like_its_source(f32_copy):
    # One token per batch: on this machine llama.cpp takes seconds for batches of SmolLM2.
    # An F32 KV cache (type 0) makes the copy's run the exact-F32 oracle configuration.
    source, copy = f32_copy
    logits = llama_logits(copy, TOKENS[:4], n_batch=1, type_k=0, type_v=0)
    assert logits.shape == (4, VOCAB_SIZE) and np.isfinite(logits).all()
    # The source's run differs only by llama.cpp's 8-bit rounding of activations for quantized
    # weights and its F16 KV cache, so the logits nearly agree.
    reference = llama_logits(source, TOKENS[:4], n_batch=1)
    for row, reference_row in zip(logits, reference):
        assert np.corrcoef(row, reference_row)[0, 1] > 0.99


def test_f32_copy_keeps_a_non_default_alignment(tmp_path):
    source = tmp_path / "tiny.gguf"
    source.write_bytes(build_tiny_gguf(alignment=64))
    copy = write_f32_copy(source, tmp_path / "f32.gguf")
    with read_gguf(copy) as f32:
        assert f32.alignment == 64 and f32.metadata["general.file_type"] == 0
        embedding = f32.tensor_data("token_embd.weight").view(np.float32)
        assert np.array_equal(embedding, np.arange(16, dtype=np.float32))


def test_f32_copy_refuses_to_overwrite_its_source(tmp_path):
    source = write_model(tmp_path / "m.gguf", ModelSpec())
    before = source.read_bytes()
    (tmp_path / "link.gguf").symlink_to(source)
    with pytest.raises(ValueError, match="overwrite"):
        write_f32_copy(source, tmp_path / "link.gguf")
    assert source.read_bytes() == before
