"""`tierflow convert`: requantized models load and run, in tierflow and (at 4 bits) llama.cpp."""

import ctypes

import numpy as np
import pytest
from gguf import GGUFWriter, LlamaFileType

from tests.support.cli import run_tierflow as tierflow
from tests.support.make_model import ModelSpec, write_model
from tests.support.oracle import (
    LONG_TEXT,
    NEAR_TIE,
    assert_logits_agree,
    llama_cpp_logits,
    llama_cpp_model,
    top2_margin,
)
from tierflow import Engine
from tierflow.errors import InvalidArgumentError, ModelFileError, UnsupportedModelError
from tierflow.offload.gguf.convert import QUANTIZATION_KEY, convert_model
from tierflow.offload.gguf.reader import read_gguf

BLOCK_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
QUANT_TYPE = {4: "Q4_1", 3: "TQ3_1", 2: "TQ2_1"}
# The bundled model takes ~10 s to convert with the scale search, ~3 s round to nearest: search
# where llama.cpp can check the result (4 bits), rtn elsewhere; tiny models cover search at 2, 3.
BUNDLED_METHOD = {4: "search", 3: "rtn", 2: "rtn"}


def is_block_weight(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "blk" and parts[2] in BLOCK_WEIGHTS and parts[3] == "weight"


@pytest.fixture(scope="module")
def converted(tmp_path_factory, model_path):
    """bits -> the bundled model converted to that many bits, each written once, on first use."""
    directory, files = tmp_path_factory.mktemp("converted"), {}

    def convert(bits: int):
        if bits not in files:
            files[bits] = convert_model(model_path, directory / f"smollm2-{bits}bit.gguf", bits,
                                        BUNDLED_METHOD[bits])
        return files[bits]

    return convert


@pytest.fixture(scope="module", params=[4, 3, 2], ids=lambda bits: f"{bits}bit")
def converted_engine(request, converted):
    report = converted(request.param)
    with Engine.load(report.path, threads=2, context_length=256) as engine:
        yield report, engine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random llama with SmolLM2's tokenizer, Q8_0 weights: converts in a blink."""
    return write_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", ModelSpec(num_layers=2))


# -- the bundled model at each bit width ---------------------------------------------------------


@pytest.mark.slow
def test_converted_model_loads_and_generates(converted_engine):
    report, engine = converted_engine
    result = engine.generate("The capital of France is", max_tokens=8, temperature=0)
    assert result.tokens and result.text.strip()
    assert np.isfinite(engine.logits(engine.tokenize("Hello, world"))).all()
    print(f"{report.bits} bits ({report.method}): {result.text!r}")


def test_converted_file_holds_the_source_with_requantized_block_weights(converted, model_path):
    for bits in (4, 3, 2):
        report = converted(bits)
        with read_gguf(model_path) as source, read_gguf(report.path) as result:
            assert list(result.tensors) == list(source.tensors)
            for name, info in source.tensors.items():
                new = result.tensors[name]
                assert new.shape == info.shape
                if is_block_weight(name):
                    assert new.type_name == QUANT_TYPE[bits], name
                else:  # token_embd, norms: byte for byte
                    assert new.ggml_type == info.ggml_type, name
                    assert np.array_equal(result.tensor_data(name), source.tensor_data(name)), name
            _assert_same_metadata(source, result, bits)
        assert report.num_requantized == 30 * len(BLOCK_WEIGHTS)
        assert report.requantized_bits_per_weight == {4: 5.0, 3: 4.0, 2: 3.0}[bits]
        assert report.file_bytes == report.path.stat().st_size


def _assert_same_metadata(source, result, bits: int) -> None:
    expected = dict(source.metadata)
    del expected["general.file_type"]
    if bits == 4:
        expected["general.file_type"] = LlamaFileType.MOSTLY_Q4_1
    method = "scale search" if BUNDLED_METHOD[bits] == "search" else "round to nearest"
    expected[QUANTIZATION_KEY] = f"{QUANT_TYPE[bits]} g32, {method}"
    assert result.metadata.keys() == expected.keys()
    for key, value in expected.items():
        assert np.array_equal(result.metadata[key], value), key
        if key in source.value_types and key != "general.file_type":
            assert result.value_types[key] == source.value_types[key], key


@pytest.mark.slow  # the search takes ~10 s over the bundled model
@pytest.mark.parametrize("converted_engine", [4], indirect=True, ids=["4bit"])
def test_4_bit_file_runs_in_llama_cpp_like_in_tierflow(converted_engine):
    report, engine = converted_engine
    llama = llama_cpp_model(report.path)
    try:
        ids = engine.tokenize(LONG_TEXT)[:64]
        # Both now round activations to 8 bits per 32 for Q4_1 (llama.cpp's Q8_1, tierflow's int8 kernel),
        # each in its own way, so their differences add: about 0.38 here (0.30 with tierflow's LUT tables).
        diff = assert_logits_agree(engine, llama, ids, max_mean_diff=0.42, near_tie=NEAR_TIE)
        prompt = engine.tokenize("The capital of France is")
        llama.reset()
        llama.eval(prompt)
        theirs = np.array(llama.scores[len(prompt) - 1])[None]
        ours = engine.logits(prompt)[-1:]
        if top2_margin(theirs)[0] > NEAR_TIE:
            assert ours.argmax() == theirs.argmax()
    finally:
        llama.close()
    print(f"4-bit search: mean |logit difference| vs llama.cpp {diff:.4f}")


@pytest.mark.slow
def test_4_bit_rtn_rebuilds_the_bundled_q4_1_file_exactly(model_path, tmp_path):
    # The bundled weights were made by ggml's round to nearest, which rtn is bit for bit.
    report = convert_model(model_path, tmp_path / "q4_1.gguf", 4, "rtn")
    with read_gguf(model_path) as source, read_gguf(report.path) as result:
        for name in source.tensors:
            assert np.array_equal(result.tensor_data(name), source.tensor_data(name)), name


def test_llama_cpp_reads_the_vocabulary_of_a_tq_file_from_a_metadata_copy(converted, model_path):
    from tierflow.offload.gguf.vocab_file import llama_vocab_file
    from tierflow.runtime.text.tokenizer import Tokenizer

    with read_gguf(model_path) as source, llama_vocab_file(source) as path:
        assert path == model_path  # llama.cpp parses ggml's types itself
    with read_gguf(converted(2).path) as model, llama_vocab_file(model) as path:
        with read_gguf(path) as copy:
            assert not copy.tensors
            assert copy.value_types == model.value_types
            assert copy.metadata_bytes() == model.metadata_bytes()
        tokenizer = Tokenizer.from_gguf(path)
    assert not path.exists()
    with Tokenizer.from_gguf(model_path) as original:
        text = "The capital of France is Paris. <|im_start|>"
        assert tokenizer.encode(text) == original.encode(text)
        assert tokenizer.chat_template == original.chat_template
    tokenizer.close()


# -- the scale search end to end, on a tiny model ---------------------------------------------


@pytest.mark.parametrize("bits", [3, 2])
def test_search_converted_tiny_model_runs(tiny_model, tmp_path, bits):
    report = convert_model(tiny_model, tmp_path / "out.gguf", bits)
    assert (report.method, report.quant_type) == ("search", QUANT_TYPE[bits])
    with read_gguf(report.path) as result:
        assert result.metadata[QUANTIZATION_KEY] == f"{QUANT_TYPE[bits]} g32, scale search"
        assert "general.file_type" not in result.metadata
    with Engine.load(report.path, threads=2, context_length=64) as engine:
        assert len(engine.generate("Hello", max_tokens=4, temperature=0).tokens) == 4


def test_progress_counts_every_source_byte(tiny_model, tmp_path):
    calls = []
    convert_model(tiny_model, tmp_path / "out.gguf", 4, "rtn",
                  progress=lambda *args: calls.append(args))
    with read_gguf(tiny_model) as source:
        total = sum(info.nbytes for info in source.tensors.values())
    assert {phase for phase, _, _ in calls} == {"convert"}
    assert [done for _, done, _ in calls] == sorted(done for _, done, _ in calls)
    assert calls[-1] == ("convert", total, total)


def test_a_failed_conversion_leaves_no_file(tiny_model, tmp_path):
    def interrupt(phase, done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_model(tiny_model, tmp_path / "out.gguf", 2, progress=interrupt)
    assert list(tmp_path.iterdir()) == []


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 5, 8, True, "4", 4.0])
def test_bits_other_than_2_3_4_are_refused(tiny_model, tmp_path, bits):
    with pytest.raises(InvalidArgumentError, match="bits must be 2, 3 or 4"):
        convert_model(tiny_model, tmp_path / "out.gguf", bits)
    assert list(tmp_path.iterdir()) == []


def test_unknown_method_is_refused(tiny_model, tmp_path):
    with pytest.raises(InvalidArgumentError, match="method must be one of search, rtn"):
        convert_model(tiny_model, tmp_path / "out.gguf", 4, "gptq")


def test_the_source_is_never_the_output(tiny_model):
    before = tiny_model.read_bytes()
    with pytest.raises(InvalidArgumentError, match="overwrite the source"):
        convert_model(tiny_model, tiny_model, 4, force=True)
    assert tiny_model.read_bytes() == before


def test_an_existing_output_needs_force(tiny_model, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(InvalidArgumentError, match="already exists .*--force"):
        convert_model(tiny_model, out, 4)
    assert out.read_bytes() == b"keep me"
    convert_model(tiny_model, out, 4, "rtn", force=True)
    with read_gguf(out) as result:
        assert result.metadata[QUANTIZATION_KEY] == "Q4_1 g32, round to nearest"


@pytest.mark.parametrize("name, message", [(".", "is a directory"), ("no/such/dir/out.gguf",
                                                                     "no such directory")])
def test_an_output_path_that_cannot_be_written_is_refused(tiny_model, tmp_path, name, message):
    with pytest.raises(InvalidArgumentError, match=message):
        convert_model(tiny_model, tmp_path / name, 4)


def test_a_malformed_source_is_a_model_file_error(tmp_path):
    source = tmp_path / "broken.gguf"
    source.write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(ModelFileError, match="broken.gguf"):
        convert_model(source, tmp_path / "out.gguf", 4)
    with pytest.raises(ModelFileError, match="not found"):
        convert_model(tmp_path / "missing.gguf", tmp_path / "out.gguf", 4)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["broken.gguf"]


FLOAT = dict(weight_type="F32", embedding_type="F32")


def test_rows_that_are_not_whole_groups_are_named(tmp_path):
    spec = ModelSpec(hidden_size=48, num_heads=2, num_kv_heads=1, ffn_size=64, **FLOAT)
    source = write_model(tmp_path / "odd.gguf", spec)
    with pytest.raises(UnsupportedModelError, match="'blk.0.attn_q.weight' has rows of 48 weights"):
        convert_model(source, tmp_path / "out.gguf", 3)


def test_a_fragment_of_a_model_is_refused_naming_what_is_missing(tmp_path):
    writer = GGUFWriter(tmp_path / "norms.gguf", "llama")
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="token_embd.weight"):
        convert_model(tmp_path / "norms.gguf", tmp_path / "out.gguf", 3)


def test_non_finite_weights_are_named(tmp_path):
    source = write_model(tmp_path / "nan.gguf", ModelSpec(num_layers=4, **FLOAT))
    with read_gguf(source) as model:
        at = model.tensors["blk.3.ffn_up.weight"].offset
    with open(source, "r+b") as file:
        file.seek(at + 4 * 7)
        file.write(np.float32(np.nan).tobytes())
    with pytest.raises(ModelFileError, match="'blk.3.ffn_up.weight'.*non-finite"):
        convert_model(source, tmp_path / "out.gguf", 2)
    assert not (tmp_path / "out.gguf").exists()


# -- the command line ----------------------------------------------------------------------------


def test_cli_converts_and_says_what_it_wrote(tiny_model, tmp_path):
    out = tmp_path / "tiny-3bit.gguf"
    done = tierflow("convert", str(tiny_model), "--bits", "3", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert out.exists()
    assert str(out) in done.stdout and "TQ3_1" in done.stdout and "bits per weight" in done.stdout


def test_cli_converts_to_a_ggml_type(float_model, tmp_path):
    out = tmp_path / "iq4xs.gguf"
    done = tierflow("convert", str(float_model[0]), "--type", "IQ4_XS", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "as IQ4_XS" in done.stdout and "4.3 bits" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--bits", "7"], "bits must be 2, 3 or 4"),
    (["--method", "gptq"], "method must be"),
    ([], "already exists"),
])
def test_cli_bad_input_is_one_line_and_exit_code_2(tiny_model, tmp_path, args, message):
    out = tmp_path / "exists.gguf"
    out.write_bytes(b"")
    done = tierflow("convert", str(tiny_model), "-o", str(out), *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_cli_needs_an_output_file(tiny_model):
    done = tierflow("convert", str(tiny_model), "--bits", "2")
    assert done.returncode == 2 and "-o/--output" in done.stderr


# -- ggml's Q2_K, Q3_K and IQ4_XS, which llama.cpp reads ----------------------------------------

GGML_FILE_TYPES = {"Q2_K": LlamaFileType.MOSTLY_Q2_K, "Q3_K": LlamaFileType.MOSTLY_Q3_K_S,
                   "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS}


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    """A 2-layer F32 qwen2 whose FFN width, 352, is not whole 256-weight blocks (ffn_down's rows
    fall back to IQ4_NL), with llama.cpp's logits over 64 tokens of it."""
    spec = ModelSpec(arch="qwen2", hidden_size=256, ffn_size=352, num_heads=4, num_kv_heads=2,
                     context_length=512, **FLOAT)
    path = write_model(tmp_path_factory.mktemp("float") / "f32.gguf", spec)
    llama = llama_cpp_model(path, n_ctx=256, f32_kv=True)
    ids = llama.tokenize(LONG_TEXT.encode(), add_bos=False)[:64]
    logits = llama_cpp_logits(llama, ids)
    llama.close()
    return path, ids, logits


def llama_cpp_quantize(source, dest, weight_type: str):
    """llama.cpp's own quantizer: every layer matrix to `weight_type` (its fallback where rows are
    not whole blocks), the embedding and output kept in F32, as convert_model does."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = int(GGML_FILE_TYPES[weight_type]), True, 1
    params.token_embedding_type = params.output_tensor_type = llama_cpp.GGML_TYPE_F32
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params)) == 0
    return dest


def mean_logit_difference(path, ids, expected) -> float:
    llama = llama_cpp_model(path, n_ctx=256, f32_kv=True)
    try:
        return float(np.abs(llama_cpp_logits(llama, ids) - expected).mean())
    finally:
        llama.close()


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", GGML_FILE_TYPES)
def test_ggml_type_file_is_as_close_to_the_source_in_llama_cpp_as_its_own_quantizer_makes_it(
        float_model, tmp_path, weight_type):
    source, ids, expected = float_model
    ours = convert_model(source, tmp_path / "ours.gguf", weight_type=weight_type).path
    theirs = llama_cpp_quantize(source, tmp_path / "theirs.gguf", weight_type)
    ours_diff, theirs_diff = (mean_logit_difference(path, ids, expected) for path in (ours, theirs))
    print(f"{weight_type}: mean |logit difference| from the F32 source in llama.cpp {ours_diff:.3f} "
          f"(llama.cpp's own quantizer: {theirs_diff:.3f})")
    assert ours_diff <= 1.1 * theirs_diff


@pytest.mark.slow
def test_ggml_type_file_holds_the_type_and_iq4_nl_where_rows_are_not_whole_blocks(float_model, tmp_path):
    source, ids, _ = float_model
    report = convert_model(source, tmp_path / "q3k.gguf", weight_type="Q3_K")
    assert (report.quant_type, report.bits, report.method) == ("Q3_K", 3, "search")
    with read_gguf(report.path) as result:
        assert result.metadata["general.file_type"] == LlamaFileType.MOSTLY_Q3_K_S
        assert result.metadata[QUANTIZATION_KEY] == "Q3_K (IQ4_NL where rows are not whole blocks of 256), " \
                                                    "scale search"
        types = {name: result.tensors[name].type_name for name in result.tensors if is_block_weight(name)}
    assert {name for name, kind in types.items() if kind == "IQ4_NL"} == {"blk.0.ffn_down.weight",
                                                                         "blk.1.ffn_down.weight"}
    assert {kind for kind in types.values()} == {"Q3_K", "IQ4_NL"}
    llama = llama_cpp_model(report.path, n_ctx=256)
    with Engine.load(report.path, threads=2, context_length=256, kv_cache_type="f32") as engine:
        assert_logits_agree(engine, llama, ids, max_mean_diff=0.25, near_tie=1.0)
    llama.close()


@pytest.mark.parametrize("weight_type, method, message", [
    ("Q4_K", "search", "weight type must be one of Q2_K, Q3_K, IQ4_XS, got 'Q4_K'"),
    ("Q2_K", "rtn", "Q2_K has one encoder, the scale search"),
])
def test_a_ggml_type_without_an_encoder_is_refused(tiny_model, tmp_path, weight_type, method, message):
    with pytest.raises(InvalidArgumentError, match=message):
        convert_model(tiny_model, tmp_path / "out.gguf", method=method, weight_type=weight_type)
    assert list(tmp_path.iterdir()) == []
