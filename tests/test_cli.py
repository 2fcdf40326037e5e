"""The `tierflow` command, run as a user runs it: through the console script's entry point, in this
process, or in a subprocess where only a process shows the behaviour (signals, the installed script's
shell completion)."""

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_tierflow as tierflow
from tests.support.gguf_bytes import FLOAT32, Typed
from tests.support.gguf_writing import rewrite_metadata

TIERFLOW = [sys.executable, "-m", "tierflow.cli.app"]


def test_run_json_prints_text_tokens_and_stats():
    done = tierflow("run", "The capital of France is", "-n", "6", "--temperature", "0", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == {"text", "tokens", "finish_reason", "stats"}
    assert len(result["tokens"]) <= 6 and result["stats"]["generated_tokens"] == len(result["tokens"])


def test_run_without_sampling_options_samples_as_the_model_file_recommends(model_path, tmp_path):
    greedy_model = rewrite_metadata(model_path, tmp_path / "greedy.gguf",
                                    {"general.sampling.temp": Typed(FLOAT32, 0.0)})
    runs = [tierflow("run", "Once upon a time", "-m", str(greedy_model), "-n", "8", "--seed", seed, "--json")
            for seed in ("1", "2")]
    assert all(done.returncode == 0 for done in runs), runs[0].stderr
    first, second = (json.loads(done.stdout)["tokens"] for done in runs)
    assert first == second


def test_an_option_can_be_set_in_the_environment():
    # greedy: sampled at the model's own temperature, an end token could come before the third
    done = tierflow("run", "The capital of France is", "--temperature", "0", "--json",
                    env={"TIERFLOW_MAX_TOKENS": "3"})
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 3


def test_version_prints_the_installed_version():
    done = tierflow("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"tierflow {importlib.metadata.version('tierflow')}"


def test_the_shell_completes_command_names():
    script = Path(sys.executable).with_name("tierflow")  # where pip put this interpreter's scripts
    assert script.is_file(), "the tierflow console script is not installed"
    completing = {"_TIERFLOW_COMPLETE": "complete_bash", "COMP_WORDS": "tierflow se", "COMP_CWORD": "1"}
    done = subprocess.run([script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **completing})
    assert done.stdout.split() == ["serve"]


def test_bench_prints_speeds_and_tokens_per_pass_with_a_draft():
    done = tierflow("bench", "-n", "8", "-r", "1", "--draft", "ngram", "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["decode_tokens_per_s"] > 0 and figures["tokens_per_pass"] >= 1


def test_run_streams_the_completion_to_stdout():
    done = tierflow("run", "1, 2, 3, 4,", "-n", "6", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_info_shows_architecture_and_tensor_types(model_path):
    done = tierflow("info", str(model_path))
    assert done.returncode == 0, done.stderr
    assert "llama" in done.stdout and "Q4_1" in done.stdout and "30" in done.stdout


def test_chat_answers_resets_and_exits():
    done = tierflow("chat", "--temperature", "0", "-n", "16",
                    input="What is 2 + 2?\n/reset\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert "4" in done.stdout and "conversation cleared" in done.stdout


def interrupted_chat(prompt: str, answer_chars: int) -> tuple[int, str]:
    """A chat given `prompt`, sent Ctrl-C once `answer_chars` of its answer have shown, then /exit:
    its exit status and what it printed after the Ctrl-C."""
    chat = subprocess.Popen([*TIERFLOW, "chat", "-n", "2000", "--seed", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    chat.stdin.write(prompt + "\n")
    chat.stdin.flush()
    shown = ""
    while not shown.endswith(">>> "):  # the banner, then the prompt marker the answer follows
        shown += chat.stdout.read(1)
    chat.stdout.read(answer_chars)
    chat.send_signal(signal.SIGINT)
    out, err = chat.communicate("/exit\n", timeout=60)
    return chat.returncode, out + err


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_but_not_the_chat():
    status, out = interrupted_chat("Tell me a very long story about a dragon.", answer_chars=20)
    assert status == 0 and "[stopped]" in out, out


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "hi", "-m", "/no/such/model.gguf"], "not found"),
        (["run", "hi", "-m", "/tmp"], "directory"),
        (["run", "hi", "--cpu-memory", "lots"], "lots"),
        (["info", "/no/such/model.gguf"], "not found"),
        (["run", "hi", "--draft", "/no/such/draft.gguf"], "not found"),
        (["run", "hi", "--draft", "ngram", "--draft-shape", "bush"], "draft_shape"),
        (["run", ""], "the prompt is empty"),
        (["run", b"caf\xe9"], "cannot be encoded as UTF-8"),  # not UTF-8: a lone surrogate in argv
        (["run", "hi", "--seed", "-1"], "seed"),
        (["bench", "--prompt", "", "-n", "2", "-r", "1"], "the prompt is empty"),
        (["run", "hi", "--kv-type", "q5_1"], "choose one of f32, f16, q8_0, q4_0"),
        (["run", "hi", "--ctx", "9000"], "context_length 9000 exceeds the 8192 positions"),
        (["plan", "--ctx", "9000"], "--allow-context-extension"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_code_2(args, message):
    done = tierflow(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_chat_input_that_is_not_utf8_is_one_line_on_stderr_and_exit_code_2():
    done = tierflow("chat", "-n", "4", input=b"caf\xe9\n/exit\n")  # stdin decoded strictly as UTF-8
    assert done.returncode == 2 and "UTF-8" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_cpu_memory_in_scientific_notation_is_read():
    done = tierflow("run", "hi", "-n", "2", "--json", "--cpu-memory", "1e9")
    assert done.returncode == 0, done.stderr


def test_a_file_that_is_not_gguf_is_exit_code_2(tmp_path):
    notes = tmp_path / "notes.gguf"
    notes.write_text("these are notes, not a model " * 10)
    done = tierflow("run", "hi", "-m", str(notes))
    assert done.returncode == 2 and "notes.gguf" in done.stderr and "Traceback" not in done.stderr


def test_prompt_longer_than_the_context_is_exit_code_2():
    done = tierflow("run", "word " * 400, "--ctx", "64")
    assert done.returncode == 2 and "context" in done.stderr


def test_a_default_context_shortened_to_fit_is_said_once_on_stderr():
    # the bundled model's 8192-position f16 cache is 180 MiB
    done = tierflow("run", "hi", "-n", "2", "--json", "--cpu-memory", "200MiB")
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "not the model's 8192" in line]
    assert len(notes) == 1 and "note: context:" in notes[0]


def test_plan_with_parallel_counts_each_sequences_kv_cache():
    plans = [json.loads(tierflow("plan", "--ctx", "512", "--json", *options).stdout)
             for options in ((), ("--parallel", "3"))]
    assert plans[1]["sequences"] == 3 and plans[1]["kv_bytes"] == 3 * plans[0]["kv_bytes"]


def test_a_bad_parallel_count_is_refused_naming_it():
    done = tierflow("plan", "--parallel", "0")
    assert done.returncode == 2 and "parallel must be" in done.stderr


def test_the_kv_cache_options_are_read_from_the_command_line_and_the_environment():
    done = tierflow("plan", "--ctx", "512", "--kv-on-cpu", "--json", env={"TIERFLOW_KV_TYPE": "q8_0"})
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["kv_type"] == "q8_0" and plan["kv_on_cpu"] and plan["context_length"] == 512
