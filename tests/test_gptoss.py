"""gpt-oss's own rules: which layers slide, and its malformed files. llama.cpp is its oracle in
test_oracle.py (exact on F32, within noise on Q8_0 and Q4_K) and test_moe_families.py takes it
through every MoE tier."""

import numpy as np
import pytest

from tests.support.gguf_writing import TensorEntry, encoded_kvs, write_gguf
from tests.support.make_model import ModelSpec, write_model
from tests.support.model_spec import spec_config
from tierflow import Engine
from tierflow.errors import ModelFileError
from tierflow.offload.gguf.reader import read_gguf

WINDOW = 16
SPEC = ModelSpec(arch="gpt-oss", num_layers=3, hidden_size=64, ffn_size=64, num_heads=4, num_kv_heads=2,
                 head_size=64, num_experts=8, experts_used=2, sliding_window=WINDOW, weight_type="Q8_0",
                 embedding_type="Q8_0")  # heads of 64 as gpt-oss's, wider than the hidden size


@pytest.fixture(scope="module")
def gptoss_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("gptoss") / "gpt-oss.gguf", SPEC)


def test_even_layers_are_local_with_the_files_window():
    """llama.cpp's swa pattern 2 for gpt-oss: layers 0, 2, ... slide, the others see everything."""
    assert spec_config(SPEC, 1000).layer_windows == (WINDOW, 0, WINDOW)


def with_shape(path, tmp_path, tensor: str, shape: tuple[int, ...]):
    """A copy of the file whose tensor `tensor` (F32) has the shape `shape` (GGUF order), zeros."""
    with read_gguf(path) as model:
        infos = list(model.tensors.values())
        entries = [TensorEntry(i.name, shape if i.name == tensor else i.shape, i.ggml_type) for i in infos]
        data = (np.zeros(shape, np.float32) if i.name == tensor else model.tensor_data(i.name) for i in infos)
        return write_gguf(tmp_path / "broken.gguf", list(encoded_kvs(path).values()), entries, data,
                          model.alignment)


@pytest.mark.parametrize("tensor,shape,expected", [
    ("blk.1.attn_sinks.weight", (3,), (4,)),
    ("blk.0.ffn_up_exps.bias", (64, 4), (64, 8)),
    ("blk.2.ffn_gate_inp.bias", (4,), (8,)),
    ("blk.0.attn_output.bias", (32,), (64,)),
])
def test_a_sink_or_bias_of_the_wrong_shape_is_a_model_file_error_naming_both_shapes(
        gptoss_path, tmp_path, tensor, shape, expected):
    listed = ", ".join(map(str, shape)), ", ".join(map(str, expected))
    with pytest.raises(ModelFileError, match=rf"'{tensor}' has shape \[{listed[0]}\], the metadata implies "
                                             rf"\[{listed[1]}\]"):
        Engine.load(with_shape(gptoss_path, tmp_path, tensor, shape))
