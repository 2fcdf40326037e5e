"""The model-file fuzzer: a seeded quick run, the attacker's findings as named cases, and the harness
that runs them (a crash, hang or runaway allocation in one case is that case's failure)."""

import os
import threading
from pathlib import Path

import pytest

from tests.fuzz.cases import random_case
from tests.fuzz.corpus import KNOWN_FAILURES
from tests.fuzz.harness import DEFAULT_MEMORY_BYTES, Call, ForkServer, Result, case_call
from tests.fuzz.seeds import load_seeds

QUICK_RUN_CASES = 150  # a longer run: `python -m tests.fuzz --cases 20000 --jobs 2`
JOBS = 2  # this machine's cores


@pytest.fixture(scope="module")
def seeds_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-seeds")


@pytest.fixture(scope="module")
def server(seeds_folder, tmp_path_factory):
    with ForkServer(seeds_folder, tmp_path_factory.mktemp("fuzz-work")) as server:
        yield server


def _run_one(server: ForkServer, call: Call, **limits) -> Result:
    [result] = server.run([call], **limits)
    return result


# -- the quick run ----------------------------------------------------------------------------

@pytest.mark.slow
def test_seeded_cases_load_or_are_refused_with_a_tierflow_error(server, seeds_folder):
    cases = [*range(QUICK_RUN_CASES), *KNOWN_FAILURES]
    results = list(server.run([case_call(seeds_folder, case) for case in cases], jobs=JOBS))
    failures = [result for result in results if result.failed]
    assert len(results) == len(cases)
    reports = "\n\n".join(failure.report() for failure in failures)
    assert not failures, (f"{len(failures)} of {len(cases)} cases failed (rerun one with "
                          f"`python -m tests.fuzz --seed N`):\n\n{reports}")


def test_a_case_number_always_gives_the_same_file(seeds_folder):
    seeds = load_seeds(str(seeds_folder))
    assert random_case(12345, seeds).build(seeds) == random_case(12345, seeds).build(seeds)
    assert str(random_case(12345, seeds)) == str(random_case(12345, seeds))


def test_an_unmutated_seed_rebuilds_byte_for_byte(seeds_folder):
    for seed in load_seeds(str(seeds_folder)).values():
        assert seed.parts.to_bytes() == seed.data, seed.name


# -- the attacker's findings against an older version -----------------------------------------

def _load_refusal(server: ForkServer, seeds_folder: Path, name: str) -> str:
    """The case's load outcome, once the harness saw it end without a failure."""
    result = _run_one(server, case_call(seeds_folder, name))
    assert not result.failed, result.report()
    return result.value["load"]


def test_a_duplicated_token_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "duplicated_token")
    assert refusal.startswith("ModelFileError") and "token 501 repeats token 500" in refusal


def test_a_sentencepiece_model_on_a_bpe_vocabulary_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "sentencepiece_model_on_bpe_vocabulary")
    assert refusal.startswith("ModelFileError") and "needs a token for every byte" in refusal


def test_a_no_vocab_tokenizer_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "no_vocab_tokenizer")
    assert refusal.startswith("ModelFileError") and "'no_vocab'" in refusal


def test_a_billion_layers_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "billion_layers")
    assert refusal.startswith("ModelFileError") and "llama.block_count" in refusal


def test_more_layers_than_tensors_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "block_count_past_the_tensors")
    assert refusal.startswith("ModelFileError") and "block_count" in refusal


def test_fewer_layers_than_the_file_holds_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "block_count_below_the_layers")
    assert refusal.startswith("ModelFileError") and "llama.block_count is 1 but" in refusal
    assert "tensors of layer 1 ('blk.1." in refusal


def test_a_string_rope_freq_base_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "string_rope_freq_base")
    assert refusal.startswith("ModelFileError") and "llama.rope.freq_base" in refusal


def test_an_array_where_an_optional_count_belongs_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "array_head_count_kv")
    assert refusal.startswith("ModelFileError") and "llama.attention.head_count_kv" in refusal


def test_a_key_length_that_does_not_fit_the_tensors_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "key_length_that_does_not_fit")
    assert refusal.startswith("ModelFileError") and "blk.0.attn_q.weight" in refusal


def test_a_missing_shared_expert_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "missing_shared_expert")
    assert refusal.startswith("ModelFileError") and "blk.0.ffn_up_shexp.weight" in refusal


def test_an_infinite_quant_scale_is_a_model_file_error(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "infinite_quant_scale")
    assert refusal.startswith("ModelFileError") and "'blk.0.attn_q.weight'" in refusal


def test_a_nan_weight_is_a_model_file_error_naming_the_tensor(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "nan_norm_weight")
    assert refusal.startswith("ModelFileError") and "'output_norm.weight'" in refusal


def test_nested_metadata_arrays_are_a_model_file_error_naming_the_key(server, seeds_folder):
    refusal = _load_refusal(server, seeds_folder, "nested_array_metadata")
    assert refusal.startswith("ModelFileError") and "'general.tags'" in refusal


def test_the_largest_float16_scale_in_q4_0_loads_as_the_file_holds_it(server, seeds_folder):
    assert _load_refusal(server, seeds_folder, "largest_float16_scale_in_q4_0") == "ok"


# -- the harness -------------------------------------------------------------------------------
# Calls the fork server's children run (as function(note, *args)), each misbehaving one way.

def abort_after_a_note(note) -> None:
    note("about to abort")
    os.abort()


def wait_forever(note) -> None:
    threading.Event().wait()


def allocate_past_the_limit(note) -> int:
    return len(bytearray(DEFAULT_MEMORY_BYTES + (1 << 30)))


def raise_key_error(note) -> None:
    raise KeyError("no such key")


_calls_seen = 0


def count_calls(note) -> int:
    global _calls_seen
    _calls_seen += 1
    return _calls_seen


def _call(function) -> Call:
    return Call(function.__name__, f"{__name__}:{function.__name__}")


def test_a_case_that_aborts_is_a_signal_failure_that_keeps_its_note(server):
    result = _run_one(server, _call(abort_after_a_note))
    assert (result.status, result.notes) == ("signal", ("about to abort",))
    assert "SIGABRT" in result.detail


def test_a_case_that_hangs_is_killed_at_its_time_limit(server):
    result = _run_one(server, _call(wait_forever), timeout_s=1.0)
    assert result.status == "timeout"


def test_a_case_past_its_memory_limit_is_a_memory_failure(server):
    result = _run_one(server, _call(allocate_past_the_limit))
    assert result.status == "memory"


def test_an_exception_other_than_a_tierflow_error_is_a_failure(server):
    result = _run_one(server, _call(raise_key_error))
    assert result.status == "exception" and result.detail.startswith("KeyError: 'no such key'")


def test_each_case_runs_in_a_fresh_fork(server):
    results = list(server.run([_call(count_calls)] * 3, jobs=JOBS))
    assert [result.value for result in results] == [1, 1, 1]
