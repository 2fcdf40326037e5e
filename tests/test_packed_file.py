"""The packed model file: written only where a load reads from disk, built once, reused, rebuilt when
stale or damaged, 4 KiB-aligned, atomic.

Models are small random GGUFs made in tmp_path (tests/support/make_model.py); packs go to the test's own
cache folder (conftest.py's own_cache), keyed by the model file's identity. A load that
holds every layer in RAM builds them there (offload/pack/built.py) and writes no pack, so the tests of
the file load with a budget that streams a layer, or open the pack themselves (open_pack).
"""

import errno
import json
import os
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.budgets import streaming_budget
from tests.support.damage import flip_byte
from tests.support.make_model import write_model
from tests.support.model_spec import ModelSpec
from tests.support.packs import written_pack
from tierflow import Engine
from tierflow.cpu_kernels.dequant import dequantize
from tierflow.cpu_kernels.linear import PackedLinear
from tierflow.cpu_kernels.packed import pack
from tierflow.cpu_kernels.quant_groups import to_quant_groups
from tierflow.errors import ModelFileError, TierflowError, UnsupportedModelError
from tierflow.ggml_types import QUANT_SIZES
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.gguf.reader import read_gguf
from tierflow.offload.io.disk import ALIGNMENT, DiskFile, aligned_buffer
from tierflow.offload.pack import writer
from tierflow.offload.pack.built import BuiltPack
from tierflow.offload.pack.pack_cache import pack_path, packs_folder, source_identity
from tierflow.offload.pack.reader import TRAILER, PackedFile
from tierflow.offload.pack.writer import open_pack
from tierflow.runtime.compute.cpu import DenseLinear
from tierflow.runtime.compute.interfaces import Weights
from tierflow.runtime.decoder.decoder import Decoder
from tierflow.runtime.memory.kv_cache import KVCache
from tierflow.runtime.models import architecture

# The linears of a dense llama layer: its tensor map's matmul fields and the GGUF matrices of each.
LAYER_LINEARS = {"qkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",),
                 "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
pytestmark = pytest.mark.usefixtures("own_cache")

SPEC = ModelSpec(num_layers=4, hidden_size=128, ffn_size=256, num_heads=4, num_kv_heads=2)
PROMPT = [1, 502, 7051, 33, 919]  # token ids: the tests need no tokenizer round trip
GREEDY = dict(temperature=0)
CONTEXT = 128


@pytest.fixture
def model(tmp_path) -> Path:
    return write_model(tmp_path / "model.gguf", SPEC)


def load(model: Path, **kwargs) -> Engine:
    return Engine.load(model, threads=1, context_length=CONTEXT, **kwargs)


def streaming_load(model: Path) -> Engine:
    """A load that streams all but the first layer through a ring of two slots, and so reads the
    model's pack (building it first)."""
    engine = load(model, cpu_memory=streaming_budget(model, CONTEXT, SPEC.num_layers - 1, ring_slots=2))
    assert engine.weights.streamed_layers
    return engine


def greedy_tokens(model: Path, load=streaming_load) -> list[int]:
    with load(model) as engine:
        return engine.generate(PROMPT, max_tokens=16, **GREEDY).tokens


def assert_whole_pack(path: Path) -> None:
    """The pack's manifest reads and every extent matches its checksum."""
    packed = PackedFile(path)
    with open(path, "rb") as f:
        for extent in [packed.globals, *packed.layers]:
            f.seek(extent.offset)
            assert zlib.crc32(f.read(extent.nbytes)) == extent.crc32


# -- none where none is needed ----------------------------------------------------------------


# The types of the test model (SPEC's, Q8_0), and the codebook types the transcoder reads too
# (IQ4_NL, IQ4_XS, and MXFP4: gpt-oss's experts).
BUILT_IN_RAM = [None, "IQ4_NL", "IQ4_XS", "MXFP4"]


def model_of_type(tmp_path: Path, weight_type: str | None) -> Path:
    """SPEC's model, or one of another weight type (256 wide: IQ4_XS's blocks are 256 weights)."""
    spec = SPEC if weight_type is None else ModelSpec(**{**SPEC.__dict__, "hidden_size": 256,
                                                          "weight_type": weight_type})
    return write_model(tmp_path / "model.gguf", spec)


@pytest.mark.parametrize("weight_type", BUILT_IN_RAM)
def test_a_load_that_holds_every_layer_in_ram_writes_no_pack(tmp_path, builds, weight_type):
    model = model_of_type(tmp_path, weight_type)
    with load(model) as engine:
        assert not engine.weights.streamed_layers
        engine.generate(PROMPT, max_tokens=4, **GREEDY)
    assert builds == [] and not any(packs_folder().iterdir())


@pytest.mark.parametrize("weight_type", BUILT_IN_RAM)
def test_layers_built_in_ram_hold_the_packs_bytes_and_compute_its_tokens(tmp_path, weight_type):
    model = model_of_type(tmp_path, weight_type)
    with open_model_file(model) as opened:
        built = BuiltPack(opened)
        packed = open_pack(opened)
        assert [e.nbytes for e in built.layers] == [e.nbytes for e in packed.layers]
        with open(packed.path, "rb") as f:
            for built_extent, extent in zip([built.globals, *built.layers], [packed.globals, *packed.layers]):
                assert built_extent.weights == extent.weights
                f.seek(extent.offset)
                buffer = aligned_buffer(extent.nbytes)
                assert bytes(built.build_into(built_extent, buffer)) == f.read(extent.nbytes)
    assert greedy_tokens(model, load) == greedy_tokens(model, streaming_load)


@pytest.mark.parametrize("weight_type", ["Q2_K", "TQ2_0"])
def test_a_model_whose_types_are_packed_in_numpy_gets_its_pack_though_it_is_resident(tmp_path, builds,
                                                                                     weight_type):
    model = write_model(tmp_path / "model.gguf", ModelSpec(**{**SPEC.__dict__, "hidden_size": 256,
                                                              "weight_type": weight_type}))
    with load(model) as engine:
        assert not engine.weights.streamed_layers
    assert builds == [pack_path(model)]


# -- built once, reused -----------------------------------------------------------------------


def test_the_first_streaming_load_writes_the_pack_and_the_second_reuses_it(model, builds):
    path = pack_path(model)
    assert not path.exists()
    first = greedy_tokens(model)
    assert path.exists() and len(builds) == 1
    written = path.stat()
    second = greedy_tokens(model)
    assert len(builds) == 1  # nothing packed the second time
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == (written.st_mtime_ns, written.st_ino)
    assert second == first


def test_reusing_a_pack_is_much_faster_than_building_it(tmp_path):
    # Wider than SPEC: a build scales with the weights, a reuse reads a manifest (about 50x here,
    # 20x on SPEC's model, where one pause of the machine made it fail).
    wide = write_model(tmp_path / "model.gguf", ModelSpec(**{**SPEC.__dict__, "hidden_size": 512,
                                                             "ffn_size": 1536}))
    with open_model_file(wide) as opened:
        build_s = _timed(lambda: open_pack(opened))
        reuse_s = min(_timed(lambda: open_pack(opened)) for _ in range(3))  # the least disturbed
    assert reuse_s * 10 < build_s, (reuse_s, build_s)  # a manifest read vs packing every tensor


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


# -- stale and damaged packs are rebuilt ------------------------------------------------------


def recorded_identity(model: Path) -> dict:
    """What the model's pack records of its source, but the CRC of the whole file (which
    source_identity, read at every load, does not compute)."""
    source = PackedFile(pack_path(model)).source
    return {key: value for key, value in source.items() if key != "content_crc32"}


def test_a_touched_model_gets_its_pack_rebuilt(model, builds):
    expected = greedy_tokens(model)
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert recorded_identity(model) != source_identity(model)
    assert greedy_tokens(model) == expected
    assert builds == [pack_path(model)] * 2
    assert recorded_identity(model) == source_identity(model)


@pytest.mark.slow
def test_a_rewritten_model_gets_its_pack_rebuilt_with_the_new_weights(model, tmp_path, builds):
    old = greedy_tokens(model)
    new_spec = ModelSpec(**{**SPEC.__dict__, "seed": 1})  # same size, other weights
    write_model(model, new_spec)
    expected = greedy_tokens(write_model(tmp_path / "fresh.gguf", new_spec))  # from a fresh pack
    assert expected != old  # else the test could not tell the packs apart
    assert greedy_tokens(model) == expected
    assert builds.count(pack_path(model)) == 2
    assert recorded_identity(model) == source_identity(model)


def _truncate(path: Path, packed: PackedFile) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _garbage_trailer(path: Path, packed: PackedFile) -> None:
    with open(path, "r+b") as f:
        f.seek(-TRAILER.size, os.SEEK_END)
        f.write(np.random.default_rng(0).bytes(TRAILER.size))


def _flip_a_globals_byte(path: Path, packed: PackedFile) -> None:
    flip_byte(path, packed.globals.offset + 100)  # read at load (a streamed layer's: tests/test_streaming.py)


def test_a_pack_changed_between_a_read_and_its_check_is_hashed_at_the_next_read(model):
    packed = written_pack(model)
    extent, disk = packed.layers[0], DiskFile(packed.path)
    buffer = aligned_buffer(extent.nbytes)
    try:
        changed = disk.changed()
        data = disk.read_into(buffer, extent.offset, extent.nbytes)
        flip_byte(packed.path, extent.offset + 100)  # after the read: `data` still holds the good bytes
        packed.check(extent, data, disk.fd, changed)
        changed = disk.changed()
        data = disk.read_into(buffer, extent.offset, extent.nbytes)
        with pytest.raises(ModelFileError, match="checksum"):
            packed.check(extent, data, disk.fd, changed)
    finally:
        disk.close()


@pytest.mark.parametrize("damage", [_truncate, _garbage_trailer, _flip_a_globals_byte],
                         ids=["truncated", "garbage-trailer", "flipped-globals-byte"])
def test_a_damaged_pack_is_rebuilt_never_used(model, builds, damage):
    expected = greedy_tokens(model)  # from the fresh pack
    path = pack_path(model)
    damage(path, PackedFile(path))
    assert greedy_tokens(model) == expected
    assert builds == [path, path]  # the first load's build, then the rebuild
    assert_whole_pack(path)


def _rewrite_manifest(path: Path, change) -> None:
    """The pack with change(manifest) applied, under a valid checksum and trailer."""
    data = path.read_bytes()
    _, offset, length, _ = TRAILER.unpack(data[-TRAILER.size:])
    manifest = json.loads(data[offset:offset + length])
    change(manifest)
    raw = json.dumps(manifest).encode()
    path.write_bytes(data[:offset] + raw + TRAILER.pack(b"TFPACK01", offset, len(raw), zlib.crc32(raw)))


@pytest.mark.parametrize("change", [
    lambda m: m["layers"][1].update(nbytes=10**12),
    lambda m: m["layers"][0]["weights"]["qkv"].update(rows=10**9),
    lambda m: m["layers"][2].update(offset=m["layers"][1]["offset"]),
    lambda m: m["layers"][0]["weights"]["qkv"].update(codebook="mxfp4"),
], ids=["absurd-extent-size", "absurd-matrix-rows", "overlapping-extents", "codebook-of-another-type"])
def test_a_crafted_manifest_with_a_valid_checksum_is_rebuilt_not_read(model, builds, change):
    expected = greedy_tokens(model)
    _rewrite_manifest(pack_path(model), change)
    assert greedy_tokens(model) == expected
    assert builds == [pack_path(model)] * 2  # the first load's build, then the rebuild
    assert_whole_pack(pack_path(model))


# -- layout -----------------------------------------------------------------------------------


def test_extents_are_4k_aligned_and_layer_major(model):
    packed = written_pack(model)
    path = packed.path
    extents = [packed.globals, *packed.layers]
    assert len(packed.layers) == SPEC.num_layers and packed.globals.offset == 0
    for extent in extents:
        assert extent.offset % ALIGNMENT == 0 and extent.nbytes % ALIGNMENT == 0
    for previous, extent in zip(extents, extents[1:]):  # globals, layer 0, 1, ... back to back
        assert extent.offset == previous.offset + previous.nbytes
    with open(path, "rb") as f:
        f.seek(-TRAILER.size, os.SEEK_END)
        _, manifest_offset, _, _ = TRAILER.unpack(f.read(TRAILER.size))
    assert manifest_offset == extents[-1].offset + extents[-1].nbytes


def _reference_linear(gguf, names: list[str]):
    """The GGUF matrices packed one by one, their outputs side by side."""
    linears = []
    for name in names:
        info = gguf.tensors[name + ".weight"]
        matrix = to_quant_groups(gguf.tensor_data(info.name), info.ggml_type, info.shape)
        linears.append(PackedLinear(pack(matrix)))
    return lambda x: np.concatenate([linear(x) for linear in linears], axis=-1)


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_1", "IQ4_NL", "MXFP4"])
def test_a_layer_extent_computes_what_the_gguf_tensors_packed_compute(tmp_path, weight_type):
    model = write_model(tmp_path / "model.gguf", ModelSpec(**{**SPEC.__dict__, "weight_type": weight_type}))
    packed = written_pack(model)
    disk, buffer = DiskFile(packed.path), aligned_buffer(packed.largest_layer_bytes)
    rng = np.random.default_rng(0)
    try:
        with read_gguf(model) as gguf:
            for index, extent in enumerate(packed.layers):
                weights = packed.layer_weights(index, disk.read_into(buffer, extent.offset, extent.nbytes))
                for field, names in LAYER_LINEARS.items():
                    reference = _reference_linear(gguf, [f"blk.{index}.{name}" for name in names])
                    linear = getattr(weights, field)
                    columns = gguf.tensors[f"blk.{index}.{names[0]}.weight"].shape[0]  # GGUF order
                    x = rng.standard_normal((3, columns), dtype=np.float32)
                    np.testing.assert_array_equal(linear(x), reference(x), err_msg=f"layer {index} {field}")
                for norm in ("attn_norm", "ffn_norm"):
                    info = gguf.tensors[f"blk.{index}.{norm}.weight"]
                    np.testing.assert_array_equal(getattr(weights, norm), dequantize(
                        gguf.tensor_data(info.name), info.ggml_type, info.shape))
                del weights  # views of the buffer
    finally:
        disk.close()


# -- atomic writes ----------------------------------------------------------------------------


def _temporaries(model: Path) -> list[Path]:
    path = pack_path(model)
    return list(path.parent.glob(path.name + "*.tmp"))


def test_a_build_leaves_no_temporary_file(model):
    written_pack(model)
    assert pack_path(model).exists() and _temporaries(model) == []


def test_a_build_failing_midway_leaves_neither_pack_nor_temporary(model, monkeypatch):
    extents = []
    original = writer.extents

    def fail_after_the_first_layer(opened, decoder=None, **kwargs):
        for layer, expert, layout in original(opened, decoder, **kwargs):
            if layer == 1 and decoder is not None:  # writing: the globals and layer 0 are written already
                extents.append(_temporaries(model))
                raise RuntimeError("disk full")
            yield layer, expert, layout

    monkeypatch.setattr(writer, "extents", fail_after_the_first_layer)
    with pytest.raises(RuntimeError, match="disk full"):
        streaming_load(model)
    assert len(extents) == 1 and len(extents[0]) == 1  # it failed while the temporary existed
    assert not pack_path(model).exists() and _temporaries(model) == []


# -- float models -----------------------------------------------------------------------------


class DenseWeights:
    """The float path of the loader before packs: every tensor dequantized from the GGUF to float32,
    q/k/v and gate/up concatenated into one torch Linear each."""

    def __init__(self, gguf, config):
        def tensor(name):
            info = gguf.tensors[name]
            return torch.from_numpy(dequantize(gguf.tensor_data(name), info.ggml_type, info.shape))

        def layer(i):
            linears = {field: DenseLinear(torch.cat([tensor(f"blk.{i}.{name}.weight") for name in names]))
                       for field, names in LAYER_LINEARS.items()}
            return Weights({"attn_norm": tensor(f"blk.{i}.attn_norm.weight").numpy(),
                            "ffn_norm": tensor(f"blk.{i}.ffn_norm.weight").numpy(), **linears})

        self.embedding = tensor("token_embd.weight")
        self.norm = tensor("output_norm.weight").numpy()
        self.layers = [layer(i) for i in range(config.num_layers)]

    def embedding_rows(self, token_ids):
        return self.embedding.numpy()[token_ids]

    def layer(self, layer_idx):
        return self.layers[layer_idx]

    def output_norm(self):
        return self.norm

    def output(self):
        return DenseLinear(self.embedding)  # tied

    def rope_freq_factors(self):
        return None


def test_a_float_model_packs_dense_float32_and_computes_the_same_logits(tmp_path):
    spec = ModelSpec(**{**SPEC.__dict__, "weight_type": "F32", "embedding_type": "F32"})
    model = write_model(tmp_path / "f32.gguf", spec)
    with load(model, kv_cache_type="f32") as engine:  # the cache type of the reference decoder below
        logits = engine.logits(PROMPT)
        assert not engine.weights.uses_kernels
        packed = engine.weights.packed
    assert packed.globals.weights["token_embd"]["kind"] == "dense"
    layer_specs = [extent.weights[field] for extent in packed.layers for field in LAYER_LINEARS]
    assert all(spec["kind"] == "dense" for spec in layer_specs)
    with open_model_file(model) as opened:
        config = opened.config
        decoder = Decoder(config, architecture("llama").block, DenseWeights(opened.gguf, config), 128)
        expected = decoder.forward(np.array(PROMPT), KVCache(config, 128), all_logits=True)
    np.testing.assert_array_equal(logits, expected)


def _unwritable_cache(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("TIERFLOW_CACHE", str(blocker / "cache"))


def test_an_unwritable_cache_folder_is_a_clear_error(tmp_path, monkeypatch, model):
    budget = streaming_budget(model, CONTEXT, SPEC.num_layers - 1, ring_slots=2)
    _unwritable_cache(tmp_path, monkeypatch)
    with pytest.raises(TierflowError, match="TIERFLOW_CACHE"):
        load(model, cpu_memory=budget)


def test_a_load_built_in_ram_needs_no_cache_folder(tmp_path, monkeypatch, model):
    _unwritable_cache(tmp_path, monkeypatch)
    with load(model) as engine:
        assert len(engine.generate(PROMPT, max_tokens=2, **GREEDY).tokens) == 2


def test_a_failed_pack_write_is_a_clear_error_and_leaves_no_file(monkeypatch, model):
    streaming_load(model).close()  # keeps the layer overhead it measures for this model's shape
    pack_path(model).unlink()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer.os, "fsync", disk_full)
    with pytest.raises(TierflowError, match="cannot write the packed weights"):
        streaming_load(model)
    assert not pack_path(model).exists() and _temporaries(model) == []


# -- blocks the packed layout cannot hold ----------------------------------------------------------


def set_block_bytes(model: Path, tensor: str, block: int, offset: int, value: bytes) -> None:
    """Overwrites bytes at `offset` in block `block` of a tensor of the GGUF file, in place."""
    with read_gguf(model) as gguf:
        info = gguf.tensors[tensor]
    block_bytes = QUANT_SIZES[info.ggml_type][1]
    with open(model, "r+b") as f:
        f.seek(info.offset + block * block_bytes + offset)
        f.write(value)


# (weight type, byte offset of its float16 d in a block, the value written there)
BAD_SCALES = [("Q8_0", 0, np.nan), ("Q2_K", 80, np.inf), ("TQ1_0", 52, -np.inf), ("Q4_K", 2, np.inf),
              ("Q6_K", 208, np.nan), ("IQ4_XS", 0, np.inf)]


@pytest.mark.parametrize("weight_type, offset, value", BAD_SCALES, ids=lambda v: str(v))
@pytest.mark.parametrize("loaded_by", [load, streaming_load], ids=["resident", "streaming"])
def test_a_block_scale_that_is_not_a_number_is_refused_at_load_naming_the_tensor(
        tmp_path, weight_type, offset, value, loaded_by):
    spec = ModelSpec(**{**SPEC.__dict__, "hidden_size": 256, "weight_type": weight_type})
    model = write_model(tmp_path / "model.gguf", spec)
    set_block_bytes(model, "blk.1.ffn_down.weight", 3, offset, np.float16(value).tobytes())
    with pytest.raises(ModelFileError, match="tensor 'blk.1.ffn_down.weight' has block scales that are not "
                                             "finite numbers"):
        loaded_by(model)
    assert not pack_path(model).exists() and _temporaries(model) == []


def _layer_extent_bytes(tmp_path: Path, weight_type: str) -> int:
    spec = ModelSpec(**{**SPEC.__dict__, "hidden_size": 256, "ffn_size": 512, "weight_type": weight_type})
    model = write_model(tmp_path / f"{weight_type}.gguf", spec)
    return written_pack(model).layers[0].nbytes


@pytest.mark.parametrize("weight_type", ["IQ4_NL", "IQ4_XS", "MXFP4"])
def test_a_codebook_type_packs_at_about_half_its_int8_size(tmp_path, weight_type):
    # Q8_0: int8 codes, float16 scales per 32. Per weight 1 + 2/32 bytes against 1/2 + 2/32 (IQ4_XS:
    # 1/2 + 1/32, its file's), plus the norms and the extent's padding.
    ratio = _layer_extent_bytes(tmp_path, weight_type) / _layer_extent_bytes(tmp_path, "Q8_0")
    assert 0.49 < ratio < 0.56


def test_an_mxfp4_scale_above_float16_is_refused_naming_the_tensor(tmp_path):
    model = write_model(tmp_path / "model.gguf", ModelSpec(**{**SPEC.__dict__, "weight_type": "MXFP4"}))
    set_block_bytes(model, "blk.0.attn_k.weight", 5, 0, bytes([145]))  # 2^17: weights up to 12 x 2^17
    with pytest.raises(UnsupportedModelError, match=r"'blk.0.attn_k.weight'.*MXFP4 block scales above 2\^15"):
        load(model)


def test_an_mxfp4_scale_below_float16_is_refused_naming_the_tensor(tmp_path):
    model = write_model(tmp_path / "model.gguf", ModelSpec(**{**SPEC.__dict__, "weight_type": "MXFP4"}))
    set_block_bytes(model, "blk.0.attn_k.weight", 5, 0, bytes([100]))  # 2^-28 times codes up to 12
    refusal = r"'blk.0.attn_k.weight'.*a scale of 3.7\d*e-09 is outside the float16 range \(it would round"
    with pytest.raises(UnsupportedModelError, match=refusal):
        load(model)
