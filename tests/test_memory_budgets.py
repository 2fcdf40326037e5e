"""Budgets kept from the first second (issue 47): the first load on a machine measures it (the probe),
packs the model and computes, all within cpu_memory; the probe and the pack writer each keep their own
bound too.

Each measurement runs in a child process of its own (tests/support/peak_memory.py): its peak RSS less
its RSS just before the code measured is what that code took. The model's largest tensor, its
embedding (151936 x 1536, Qwen2.5-1.5B's shape; 248 MB in Q8_0), is larger than the bounds the probe and
the writer are given alone (64 MiB), and most of what the load's budget holds.

What a budget holds is the load's weights, KV cache and activations (offload/plan/budgets.py). A load also
has fixed costs it does not count, a few tens of MiB whatever the budget: llama.cpp's library, loaded
once a process (about 30 MiB; the child loads it before it measures, as it imports torch), the tokenizer's
tables, torch's threads. So the budget of the whole load is a few hundred MiB, where those stay within the
10% the check allows.
"""

import re
from pathlib import Path

import pytest

from tests.support.budgets import streaming_budget
from tests.support.make_model import write_model
from tests.support.model_spec import ModelSpec
from tests.support.peak_memory import in_child
from tests.support.test_cache import TEST_PROFILE, HardwareProfile
from tierflow.offload.gguf.model_file import open_model_file
from tierflow.offload.pack.writer import pack_sizes
from tierflow.offload.plan import probe as probing
from tierflow.offload.plan.profile import profile_path
from tierflow.units import parse_size

BIG = ModelSpec(num_layers=4, hidden_size=1536, ffn_size=4096, num_heads=12, num_kv_heads=2,
                vocab_size=151936)
CONTEXT = 256
PROMPT = [1, 502, 7051, 33, 919]
TOLERANCE = 1.10  # the check: the budget plus 10%
BOUND = 64 << 20  # what the probe and the writer are given on their own


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("big") / "big.gguf", BIG)


def largest_tensor_bytes(model: Path) -> int:
    with open_model_file(model) as opened:
        return max(info.nbytes for info in opened.gguf.tensors.values())


def taken(measured: dict) -> int:
    return measured["peak"] - measured["before"]


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@pytest.mark.slow
def test_a_first_load_on_a_fresh_cache_probes_packs_and_computes_within_cpu_memory(big_model, tmp_path):
    budget = streaming_budget(big_model, CONTEXT, num_streamed=3, ring_slots=2)
    with open_model_file(big_model) as opened:
        assert pack_sizes(opened).globals.nbytes > budget // 2  # the embedding is most of the budget
    measured = in_child(f'''
        import logging
        import warnings
        from pathlib import Path
        from tierflow import Engine
        from tierflow.offload.gguf.model_file import open_model_file
        from tierflow.offload.pack.pack_cache import pack_path
        from tierflow.offload.plan.profile import profile_path
        from tierflow.runtime.loading.loader import load_tokenizer

        warnings.simplefilter("ignore")  # a busy machine, an L3 larger than the budget: said, not failed
        said = []  # what the load said, in order: the probe's notice (a CLI prints it), its progress
        class Said(logging.Handler):
            def emit(self, record):
                said.append(record.getMessage())
        logging.getLogger("tierflow.offload.plan.probe").addHandler(Said())
        logging.getLogger("tierflow.offload.plan.probe").setLevel(logging.INFO)

        def progress(phase, done, total):
            if not said or said[-1] != phase:
                said.append(phase)

        model = Path({str(big_model)!r})
        with open_model_file(model) as opened:  # llama.cpp's library, loaded once a process
            load_tokenizer(opened).close()
        assert not profile_path(1).exists() and not pack_path(model).exists()
        before = rss()
        with Engine.load(model, threads=1, context_length={CONTEXT}, cpu_memory={budget},
                         progress=progress) as engine:
            engine.logits({PROMPT})
            streamed = len(engine.weights.streamed_layers)
        report(before=before, peak=peak_rss(), probed=profile_path(1).exists(),
               packed=pack_path(model).exists(), streamed=streamed, said=said)
    ''', env={"TIERFLOW_CACHE": str(tmp_path / "cache")})
    assert measured["probed"] and measured["packed"] and measured["streamed"]  # the probe, the pack, a pass
    first, *then = measured["said"]
    announced = re.fullmatch(r"measuring this machine once for the planner \(tierflow probe\): about \d+ s, "
                             r"within (.+) of RAM", first)
    assert announced and parse_size(announced.group(1).replace(" ", "")) <= 1.001 * budget  # as printed
    assert then == ["probing", "packing", "loading"]
    assert taken(measured) <= TOLERANCE * budget, (
        f"the first load took {mib(taken(measured))} with cpu_memory {mib(budget)}")


@pytest.mark.slow
def test_the_probe_measures_within_its_allowance_and_says_first_how_long_it_takes(tmp_path):
    measured = in_child(f'''
        import time, warnings
        from pathlib import Path
        import torch  # as a load has it imported: the probe asks it whether there is a GPU
        from tierflow.offload.plan import probe as probing

        warnings.simplefilter("ignore")
        torch.cuda.is_available()
        said, started = [], time.perf_counter()
        before = rss()
        probing.probe(1, directory=Path({str(tmp_path)!r}), memory_bytes={BOUND},
                      progress=lambda *step: said.append([time.perf_counter() - started, *step]))
        report(before=before, peak=peak_rss(), allowance=probing.allowance({BOUND}), said=said,
               seconds=time.perf_counter() - started)
    ''')
    assert measured["allowance"] <= BOUND
    assert taken(measured) <= TOLERANCE * measured["allowance"], (
        f"the probe took {mib(taken(measured))} of an allowance of {mib(measured['allowance'])}")
    (first_at, first, _, _), *rest = measured["said"]
    estimate = re.fullmatch(r"disk read speed, about (\d+) s left", first)
    assert estimate and first_at < 1 and 1 <= int(estimate.group(1)) <= 60  # before anything is measured
    assert [step.split(",")[0] for _, step, _, _ in rest] == ["RAM and kernel speeds", "GPU", "done"]
    assert [(done, total) for _, _, done, total in measured["said"]] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert list(tmp_path.iterdir()) == []  # the scratch file went


def test_the_default_allowance_is_a_tenth_of_the_available_ram_and_a_budget_lowers_it(monkeypatch):
    class Memory:
        available = 8 << 30

    monkeypatch.setattr(probing.psutil, "virtual_memory", lambda: Memory())
    assert probing.allowance() == (8 << 30) // 10
    assert probing.allowance(256 << 20) == 256 << 20
    assert probing.allowance(64 << 30) == (8 << 30) // 10  # a budget never raises it
    assert probing.allowance(1 << 20) == probing.MIN_ALLOWANCE


@pytest.mark.parametrize("l3", [8 << 20, 32 << 20, 105 << 20, 480 << 20], ids=lambda b: f"L3={b >> 20}MiB")
@pytest.mark.parametrize("allowed", [32 << 20, 64 << 20, 256 << 20, 1 << 30, 8 << 30],
                         ids=lambda b: f"{b >> 20}MiB")
def test_probe_sizes_fit_the_allowance_and_are_rough_only_below_two_l3_sizes(l3, allowed):
    sizes = probing.probe_sizes(allowed, l3)
    making = sizes.chunk_rows * probing.COLS * probing.MAKE_BYTES_PER_WEIGHT
    assert sizes.arena_bytes + making + probing.RESERVE_BYTES <= allowed
    assert sizes.disk_chunk_bytes <= allowed // 8 and sizes.h2d_bytes <= allowed // 4
    assert sizes.rough == (sizes.arena_bytes < probing.MIN_READ_L3 * l3)
    if not sizes.rough:  # the RAM buffer exceeds the caches, and is no larger than it need be
        assert probing.MIN_READ_L3 * l3 <= sizes.arena_bytes
        assert sizes.arena_bytes <= max(probing.MAX_READ_L3 * l3, 200 << 20)
    int8_matrix = sizes.matrix_rows * probing.COLS * probing.INT8_BYTES_PER_WEIGHT
    assert 2 * len(probing.KERNEL_BITS) * int8_matrix <= sizes.arena_bytes  # every ring fits, half the arena
    assert probing.TILE_ROWS <= sizes.matrix_rows <= probing.MAX_ROWS
    assert 1 <= sizes.seconds <= 60


def test_the_smallest_allowance_that_is_not_rough_is_the_one_the_warning_names():
    for l3 in (8 << 20, 32 << 20, 480 << 20):
        floor = probing._floor_allowance(l3)
        assert not probing.probe_sizes(floor, l3).rough and probing.probe_sizes(floor - (2 << 20), l3).rough


def test_a_rough_profile_is_measured_again_once_the_allowance_holds_the_smallest_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(probing, "total_l3_bytes", lambda: 32 << 20)
    rough = HardwareProfile(threads=1, **TEST_PROFILE, rough=True, overhead_by_shape={"shape": 1e-5})
    profile_path(1).write_text(rough.to_json())
    probed = []

    def fake_probe(threads, memory_bytes=None, **kwargs):
        probed.append(memory_bytes)
        return HardwareProfile(threads=threads, **{**TEST_PROFILE, "cpu_name": "measured"})

    monkeypatch.setattr(probing, "probe", fake_probe)
    assert probing.load_profile(1, memory_bytes=40 << 20) == rough  # still too little: kept as it is
    measured = probing.load_profile(1, memory_bytes=1 << 30)
    assert probed == [1 << 30] and measured.cpu_name == "measured" and not measured.rough
    assert measured.overhead_by_shape == {"shape": 1e-5}  # measured per model shape: kept
    assert probing.load_profile(1, memory_bytes=40 << 20) == measured  # not rough: never again


@pytest.mark.slow
def test_a_pack_build_holds_at_most_its_memory_bound_though_a_tensor_is_larger(big_model, tmp_path):
    assert largest_tensor_bytes(big_model) > 3 * BOUND
    measured = in_child(f'''
        from pathlib import Path
        from tierflow.offload.gguf.model_file import open_model_file
        from tierflow.offload.pack.writer import build_pack

        with open_model_file(Path({str(big_model)!r})) as opened:
            before = rss()
            build_pack(opened, Path({str(tmp_path / "big.tfpack")!r}), memory_bytes={BOUND})
            report(before=before, peak=peak_rss())
    ''')
    assert (tmp_path / "big.tfpack").exists()
    assert taken(measured) <= TOLERANCE * BOUND, f"the build took {mib(taken(measured))} of {mib(BOUND)}"
