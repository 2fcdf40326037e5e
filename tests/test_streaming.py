"""Streaming layers from the pack under a cpu_memory budget: exact results, budgets kept, faults named.

Models are random GGUFs made here (tests/support/make_model.py). Budgets are computed from the pack:
the globals extent, the layers to keep resident, and a ring of 3 slots (prefetch depth 2) of the
largest layer, plus what cpu_memory keeps beside the weights (the KV cache, activations), so a
test says about how much streams rather than guessing sizes (the planner picks
the depth, 1 to 4, so the count streamed may differ by a layer or two). A fixed hardware profile
is written into the test cache, so no load spends seconds measuring this machine.
"""

import errno
import os
import shutil
import tempfile
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.support.budgets import ram_beside_weights, streaming_budget
from tests.support.damage import flip_byte
from tests.support.make_model import write_model
from tests.support.model_spec import ModelSpec
from tests.support.packs import written_pack
from tests.support.peak_memory import in_child
from tierflow import Engine
from tierflow.errors import BudgetError, ModelFileError, TierflowError
from tierflow.offload.io import disk as disk_module
from tierflow.offload.io import streamer as streamer_module
from tierflow.offload.io.disk import ALIGNMENT, DiskFile, aligned_buffer
from tierflow.offload.pack import reader as reader_module
from tierflow.offload.pack.pack_cache import pack_path
from tierflow.offload.pack.reader import PackedFile
from tierflow.offload.plan.profile import HardwareProfile, profile_path
from tierflow.units import parse_size

# 20 small layers beside a 6.7 MB globals extent. ffn 544 makes the smallest budget (globals and
# two slots) 7,245,824 bytes: not a whole tenth of a MiB, so a printed minimum must round up.
SPEC = ModelSpec(num_layers=20, hidden_size=128, ffn_size=544, num_heads=4, num_kv_heads=2)
PROMPT = [1, 502, 7051, 33, 919]  # token ids
GREEDY = dict(temperature=0)
CONTEXT = 128
RING_SLOTS = 3  # prefetch depth 2
HANG_S = 30  # a fault must end the generation well before this


def load(model: Path, **kwargs) -> Engine:
    return Engine.load(model, threads=1, context_length=CONTEXT, **kwargs)


def budget(model: Path, num_streamed: int, kv_cache_type: str | None = None) -> int:
    """cpu_memory for the globals, all but the last num_streamed layers and the ring, beside the
    KV cache and activations."""
    return streaming_budget(model, CONTEXT, num_streamed, RING_SLOTS, kv_cache_type)


def generate(engine: Engine, max_tokens: int = 16) -> list[int]:
    return engine.generate(PROMPT, max_tokens=max_tokens, **GREEDY).tokens


def in_thread(work) -> dict:
    """Runs work() on a thread; its {"value"} or {"error"}. Fails if it is still running after HANG_S."""
    outcome = {}

    def run():
        try:
            outcome["value"] = work()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"still running after {HANG_S} s: a fault hung the generation"
    return outcome


# The speeds the planner places layers by: a plausible small machine.
PROFILE = HardwareProfile(threads=1, cpu_name="Test CPU", disk_read_gbps=1.0, disk_direct_io=True,
                          ram_read_gbps=20.0, kernel_gbps={b: 10.0 for b in (1, 2, 3, 4, 8)},
                          kernel_batch_gbps={b: 30.0 for b in (1, 2, 3, 4, 8)}, layer_overhead_s=3e-5)


def provide_profile() -> None:
    """Writes PROFILE where Engine.load(threads=1) looks, unless a profile is already there."""
    path = profile_path(1)
    if not path.exists():
        path.write_text(PROFILE.to_json())


@pytest.fixture(autouse=True)
def profile() -> None:
    provide_profile()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("streaming") / "model.gguf", SPEC)


@pytest.fixture(scope="module")
def resident(model) -> dict:
    """Fully resident results (built in RAM from the GGUF: no pack): 40 greedy tokens and their logits."""
    with load(model) as engine:
        assert engine.weights.bytes_by_tier()["disk"] == 0
        tokens = generate(engine, 40)
        return {"tokens": tokens, "logits": engine.logits(PROMPT + tokens)}


@pytest.fixture(scope="module")
def packed(model, resident) -> PackedFile:
    return written_pack(model)


@pytest.fixture
def own_model(tmp_path, resident) -> Path:
    """The same model (same bytes) at a path of its own: its pack may be damaged freely."""
    return write_model(tmp_path / "own.gguf", SPEC)


@pytest.fixture(scope="module")
def half(model) -> int:
    """cpu_memory that streams half the layers (of any copy of the model: the packs are alike)."""
    return budget(model, SPEC.num_layers // 2)


# -- exact results ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_streamed_generation_matches_resident_exactly(model, resident, packed, fraction):
    num_streamed = round(fraction * SPEC.num_layers)
    with load(model, cpu_memory=budget(model, num_streamed)) as engine:
        assert abs(len(engine.weights.streamed_layers) - num_streamed) <= 2
        tokens = generate(engine, 40)
        assert tokens == resident["tokens"]
        assert np.array_equal(engine.logits(PROMPT + tokens), resident["logits"])


# -- budgets ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_weights_in_ram_never_exceed_the_budget(model, packed):
    slot, total = packed.largest_layer_bytes, packed.globals.nbytes + sum(e.nbytes for e in packed.layers)
    smallest, beside = packed.globals.nbytes + 2 * slot, ram_beside_weights(model, CONTEXT)
    weight_budgets = sorted({*range(smallest, total, (total - smallest) // 9), smallest + slot // 2 + 1,
                             smallest + slot - 1, total - 1, total, total + slot})
    for weights in weight_budgets:
        with load(model, cpu_memory=weights + beside) as engine:
            held = engine.weights.bytes_by_tier()
            assert held["cpu"] <= weights, (weights, held)
            assert (held["disk"] == 0) == (weights >= total), (weights, held)


BIG_SPEC = ModelSpec(num_layers=16, hidden_size=256, ffn_size=4096, num_heads=4, num_kv_heads=2)  # ~72 MB
RSS_MARGIN = 16 << 20  # beside cpu_memory: logits, the tokenizer, the decoder's tables, allocator slack

# Measured in a process of its own (tests/support/peak_memory.py): in the long test process the
# allocator's arenas of many earlier threads made a load's growth depend on what ran before it.
RSS_GROWTH = f"""
import gc
import threading
from tierflow import Engine


def rss_growth(**kwargs):
    gc.collect()
    base = peak = rss()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, rss())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with Engine.load(MODEL, threads=1, context_length={CONTEXT}, kv_cache_type="f32", **kwargs) as engine:
            engine.generate({PROMPT}, max_tokens=2, temperature=0)
            peak = max(peak, rss())
            held = engine.weights.bytes_by_tier()["cpu"]
    finally:
        done.set()
        sampler.join()
    gc.collect()
    return peak - base, held
"""


@pytest.mark.slow
def test_rss_growth_stays_within_the_budget_and_streaming_saves_the_streamed_bytes(tmp_path):
    model = write_model(tmp_path / "big.gguf", BIG_SPEC)
    written_pack(model)  # the first load's one-off costs are not measured
    cpu_memory = budget(model, BIG_SPEC.num_layers - 2, kv_cache_type="f32")  # planned bytes are held bytes
    measured = in_child(RSS_GROWTH + f"""
MODEL = {str(model)!r}
rss_growth(cpu_memory={cpu_memory})  # warm-up: the allocator's pools, the tokenizer
streamed, streamed_held = rss_growth(cpu_memory={cpu_memory})
resident, resident_held = rss_growth()
report(streamed=streamed, streamed_held=streamed_held, resident=resident, resident_held=resident_held)
""")
    assert measured["streamed"] <= cpu_memory + RSS_MARGIN, (measured, cpu_memory)
    saved = measured["resident_held"] - measured["streamed_held"]  # the streamed layers, less the ring
    assert saved > 2 * RSS_MARGIN  # the model is large enough for the difference to show
    difference = measured["resident"] - measured["streamed"]
    assert 0.75 * saved <= difference <= saved + RSS_MARGIN, (measured, saved)


def _named_minimum(model: Path, packed: PackedFile) -> int:
    with pytest.raises(BudgetError, match=r"at least \S+ ?\w+ is needed") as refused:
        load(model, cpu_memory=packed.globals.nbytes + packed.largest_layer_bytes)
    named = str(refused.value).split("at least ")[1].split(" is needed")[0]
    return parse_size(named)


def test_too_small_a_budget_raises_budget_error_naming_the_minimum(model, packed):
    minimum = _named_minimum(model, packed)
    with pytest.raises(BudgetError):  # named to a tenth of a MiB: just below it is refused too
        load(model, cpu_memory=minimum - (1 << 20) // 10)


def test_the_named_minimum_loads_and_streams_correctly(model, resident, packed):
    minimum = _named_minimum(model, packed)
    with load(model, cpu_memory=minimum) as engine:
        assert engine.weights.streamed_layers and engine.weights.bytes_by_tier()["cpu"] <= minimum
        assert generate(engine) == resident["tokens"][:16]


# -- faults -------------------------------------------------------------------------------------


def _fail_read_into(monkeypatch, call: int) -> None:
    read_into, calls = DiskFile.read_into, []

    def failing(self, buffer, offset, nbytes):
        calls.append(offset)
        if len(calls) == call:
            raise ModelFileError(f"{self.path.name}: injected read failure at {offset}")
        return read_into(self, buffer, offset, nbytes)

    monkeypatch.setattr(DiskFile, "read_into", failing)


def _fail_preadv(monkeypatch, call: int) -> None:
    preadv, calls = os.preadv, []

    def failing(fd, buffers, offset, *args):
        calls.append(offset)
        if len(calls) == call:
            raise OSError(errno.EIO, "Input/output error")
        return preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", failing)


@pytest.mark.parametrize("fault, message", [(_fail_read_into, "injected read failure"),
                                            (_fail_preadv, "failed: Input/output error")],
                         ids=["read-into-raises", "preadv-raises-eio"])
def test_a_failed_read_ends_the_generation_with_a_clear_error_and_the_engine_recovers(
        model, half, monkeypatch, fault, message):
    with load(model, cpu_memory=half) as engine:
        before = generate(engine)
        fault(monkeypatch, call=8)  # in the second pass: tokens were already produced
        outcome = in_thread(lambda: generate(engine))
        error = outcome.get("error")
        assert isinstance(error, ModelFileError) and isinstance(error, TierflowError), outcome
        assert message in str(error) and pack_path(model).name in str(error)
        monkeypatch.undo()
        assert in_thread(lambda: generate(engine)).get("value") == before


@pytest.mark.parametrize("cut", [0, 1000], ids=["at-an-extent-start", "inside-an-extent"])
def test_a_pack_truncated_in_use_fails_clearly_and_works_again_once_restored(own_model, half, cut):
    path = pack_path(own_model)
    with load(own_model, cpu_memory=half) as engine:
        before = generate(engine)
        saved = path.read_bytes()
        last = engine.weights.packed.layers[engine.weights.streamed_layers[-1]]  # not read ahead yet
        os.truncate(path, last.offset + cut)
        error = in_thread(lambda: generate(engine)).get("error")
        assert isinstance(error, ModelFileError), error
        assert "ends before byte" in str(error) and "truncated" in str(error)
        with open(path, "r+b") as f:  # the same file, as the engine holds it open
            f.write(saved)
        assert in_thread(lambda: generate(engine)).get("value") == before


def test_a_damaged_streamed_extent_fails_the_generation_and_the_next_load_rebuilds(own_model, half, resident):
    path = pack_path(own_model)
    with load(own_model, cpu_memory=half) as engine:
        extent = engine.weights.packed.layers[engine.weights.streamed_layers[-1]]
        flip_byte(path, extent.offset + 100)  # loaded, but this layer has not been read yet
        error = in_thread(lambda: generate(engine)).get("error")
        assert isinstance(error, ModelFileError) and "checksum" in str(error), error
    with load(own_model, cpu_memory=half) as engine:  # the same command again
        assert generate(engine) == resident["tokens"][:16]
    with open(path, "rb") as f:
        f.seek(extent.offset)
        assert zlib.crc32(f.read(extent.nbytes)) == extent.crc32


def test_a_pack_changed_in_place_after_its_first_read_is_an_error_not_wrong_output(own_model, half, resident):
    path = pack_path(own_model)
    with load(own_model, cpu_memory=half) as engine:
        assert generate(engine) == resident["tokens"][:16]  # every streamed layer read (and checked) once
        extent = engine.weights.packed.layers[engine.weights.streamed_layers[0]]
        flip_byte(path, extent.offset + 100)
        error = in_thread(lambda: generate(engine)).get("error")
        assert isinstance(error, ModelFileError) and "checksum" in str(error), error
    with load(own_model, cpu_memory=half) as engine:  # rebuilt
        assert generate(engine) == resident["tokens"][:16]



def test_an_extent_read_again_from_an_unchanged_pack_is_not_hashed_again(own_model, half, monkeypatch):
    hashed = []
    monkeypatch.setattr(reader_module, "crc32", lambda data: hashed.append(len(data)) or zlib.crc32(data))
    with load(own_model, cpu_memory=half) as engine:
        generate(engine)  # every streamed layer read, and hashed, once
        assert hashed
        hashed.clear()
        generate(engine)
        assert hashed == []

# -- O_DIRECT and its fallback ------------------------------------------------------------------


def _accepts_o_direct(path: Path) -> bool:
    """Whether the file system serves aligned O_DIRECT reads of path (tmpfs does since Linux 6.6)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    buffer = aligned_buffer(ALIGNMENT)
    try:
        os.preadv(fd, [buffer], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buffer.close()


@pytest.fixture
def tmpfs_cache(monkeypatch) -> Path:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    folder = Path(tempfile.mkdtemp(prefix="tierflow-test-cache-", dir="/dev/shm"))
    monkeypatch.setenv("TIERFLOW_CACHE", str(folder))
    provide_profile()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_pack_on_tmpfs_streams_correctly(model, half, resident, tmpfs_cache):
    with load(model, cpu_memory=half) as engine:
        pack = engine.weights.packed.path
        assert pack.is_relative_to(tmpfs_cache) and engine.weights.streamed_layers
        assert engine.weights.disk.direct == _accepts_o_direct(pack)  # False where tmpfs refuses
        assert generate(engine) == resident["tokens"][:16]


def _refuse_o_direct_opens(monkeypatch) -> None:
    open_ = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return open_(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


def _refuse_o_direct_reads(monkeypatch) -> None:
    """Like some network file systems: the flag is accepted, the reads fail."""
    open_, preadv, direct_fds = os.open, os.preadv, set()

    def opening(path, flags, *args, **kwargs):
        fd = open_(path, flags, *args, **kwargs)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)
        return fd

    def reading(fd, buffers, offset, *args):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "preadv", reading)


@pytest.mark.parametrize("refuse", [_refuse_o_direct_opens, _refuse_o_direct_reads],
                         ids=["open-refused", "reads-refused"])
def test_without_o_direct_reads_fall_back_to_buffered_and_stream_correctly(model, half, resident, monkeypatch,
                                                                           refuse):
    refuse(monkeypatch)
    with load(model, cpu_memory=half) as engine:
        assert not engine.weights.disk.direct
        assert generate(engine) == resident["tokens"][:16]


def test_packs_in_the_normal_cache_are_read_with_o_direct(packed):
    if not _accepts_o_direct(packed.path):
        pytest.skip(f"the file system of {packed.path.parent} refuses O_DIRECT")
    disk = DiskFile(packed.path)
    try:
        assert disk.direct
    finally:
        disk.close()


# -- the streamer -------------------------------------------------------------------------------


def test_close_stops_the_streamer_threads(model, half):
    engine = load(model, cpu_memory=half)
    threads = engine.weights.streamer._threads
    generate(engine, 2)
    assert all(thread.is_alive() and thread.name == "tierflow-streamer" for thread in threads)
    engine.close()
    assert not any(thread.is_alive() for thread in threads)
    assert not [t for t in threading.enumerate() if t.name == "tierflow-streamer"]


def _in_order_but_for_overlap(reads: list[int], expected: list[int], readers: int) -> bool:
    """Whether `reads` are `expected` but for reads in flight together, which any reader may start first."""
    return sorted(reads) == sorted(expected) and all(
        layer in expected[max(0, k - readers + 1): k + readers] for k, layer in enumerate(reads))


def test_the_streamer_reads_ahead_in_the_decoders_layer_order_across_tokens(model, half, packed, monkeypatch):
    layer_at = {extent.offset: index for index, extent in enumerate(packed.layers)}
    read_into, get = DiskFile.read_into, streamer_module.LayerStreamer.get
    reads, queued_after = [], []

    def recording_read(self, buffer, offset, nbytes):
        reads.append(layer_at.get(offset))
        return read_into(self, buffer, offset, nbytes)

    def recording_get(self, layer):
        weights = get(self, layer)
        queued_after.append((layer, [read.layer for _, read in sorted(self._reads.items())]))
        return weights

    with load(model, cpu_memory=half) as engine:
        monkeypatch.setattr(disk_module.DiskFile, "read_into", recording_read)
        monkeypatch.setattr(streamer_module.LayerStreamer, "get", recording_get)
        generate(engine, 4)  # prefill and 3 decode steps: 4 passes
        order, depth = engine.weights.streamer.order, len(engine.weights.streamer.slots) - 1
        assert order == list(engine.weights.streamed_layers) and depth >= 1
    cycle = order * 6
    assert len(reads) >= 4 * len(order)
    assert _in_order_but_for_overlap(reads, cycle[: len(reads)], streamer_module.READERS)  # across tokens
    assert [layer for layer, _ in queued_after] == cycle[: len(queued_after)]
    for k, (layer, queued) in enumerate(queued_after):  # when layer k is handed over, k+1.. are queued
        assert queued == cycle[k + 1: k + 1 + depth], (layer, queued)


# -- huge pages ------------------------------------------------------------------------------


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (Linux's /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split()[0] and ":" not in line.split()[0]:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
@pytest.mark.parametrize(("size", "huge"), [(ALIGNMENT, False), (4 << 20, True)])
def test_a_buffer_of_a_huge_page_or_more_asks_for_huge_pages(size, huge):
    buffer = aligned_buffer(size)
    address = np.frombuffer(buffer, np.uint8).ctypes.data
    assert ("hg" in _vm_flags(address)) == huge
    assert "sh" not in _vm_flags(address)  # private: shared anonymous memory gets no huge pages
