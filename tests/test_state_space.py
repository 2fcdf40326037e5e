"""Mamba and Mamba-2 files tierflow refuses: sizes in the metadata that the tensors disagree with,
and decays or skips that are not numbers. (Their logits against llama.cpp: tests/test_families.py
and tests/test_oracle.py.)"""

import numpy as np
import pytest

from tests.support.damage import copy_patched
from tests.support.gguf_bytes import UINT32, Typed
from tests.support.gguf_writing import rewrite_metadata
from tests.support.make_model import write_model
from tests.support.model_spec import family_spec
from tierflow import Engine
from tierflow.errors import ModelFileError
from tierflow.offload.gguf.reader import read_gguf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: write_model(tmp_path_factory.mktemp(name) / "model.gguf", family_spec(name))
            for name in ("mamba", "mamba2")}


def load(path):
    return Engine.load(path, threads=1, context_length=256)


SIZES = {  # (family, key, a value the file's tensors disagree with) -> the first tensor that does
    ("mamba", "ssm.inner_size", 96): r"'blk.0.ssm_in.weight' has shape \[64, 256\], the metadata "
                                      r"implies \[64, 192\]",
    ("mamba", "ssm.state_size", 8): r"'blk.0.ssm_x.weight' has shape \[128, 64\], the metadata "
                                     r"implies \[128, 48\]",
    ("mamba", "ssm.conv_kernel", 3): r"'blk.0.ssm_conv1d.weight' has shape \[4, 128\], the metadata "
                                      r"implies \[3, 128\]",
    ("mamba2", "ssm.inner_size", 96): r"'blk.0.ssm_in.weight' has shape \[64, 328\], the metadata "
                                       r"implies \[64, 264\]",
    ("mamba2", "ssm.state_size", 8): r"'blk.0.ssm_in.weight' has shape \[64, 328\], the metadata "
                                      r"implies \[64, 296\]",
    ("mamba2", "ssm.time_step_rank", 4): r"'blk.0.ssm_in.weight' has shape \[64, 328\], the metadata "
                                          r"implies \[64, 324\]",
    ("mamba2", "ssm.group_count", 1): r"'blk.0.ssm_in.weight' has shape \[64, 328\], the metadata "
                                       r"implies \[64, 296\]",
    ("mamba2", "ssm.conv_kernel", 3): r"'blk.0.ssm_conv1d.weight' has shape \[4, 192\], the metadata "
                                       r"implies \[3, 192\]",
}


@pytest.mark.parametrize("family, key, value", list(SIZES))
def test_a_state_size_the_projections_disagree_with_is_refused_naming_the_tensor_and_both_shapes(
        tmp_path, models, family, key, value):
    changes = {f"{family}.{key}": Typed(UINT32, value)}
    with pytest.raises(ModelFileError, match=SIZES[family, key, value]):
        load(rewrite_metadata(models[family], tmp_path / "broken.gguf", changes))


@pytest.mark.parametrize("key, value, refusal", [
    ("ssm.time_step_rank", 5, r"'mamba2.ssm.inner_size' 128 is not a multiple of "
                              r"'mamba2.ssm.time_step_rank' 5"),
    ("ssm.group_count", 3, r"'mamba2.ssm.time_step_rank' 8 is not a multiple of 'mamba2.ssm.group_count' 3"),
])
def test_heads_that_do_not_divide_the_channels_or_groups_that_do_not_divide_the_heads_are_refused(
        tmp_path, models, key, value, refusal):
    changes = {f"mamba2.{key}": Typed(UINT32, value)}
    with pytest.raises(ModelFileError, match=refusal):
        load(rewrite_metadata(models["mamba2"], tmp_path / "broken.gguf", changes))


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
@pytest.mark.parametrize("tensor", ["blk.1.ssm_a", "blk.0.ssm_d"])
@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_a_decay_or_skip_that_is_not_a_finite_number_is_refused_naming_the_tensor(tmp_path, models, family,
                                                                                  tensor, value):
    with read_gguf(models[family]) as gguf:
        offset = gguf.tensors[tensor].offset
    broken = copy_patched(models[family], tmp_path / "broken.gguf", offset, np.float32(value).tobytes())
    with pytest.raises(ModelFileError, match=f"tensor '{tensor}' holds a value that is not a finite number"):
        load(broken)
