"""Time to first token and decode tokens/s through the local server, against in-process, in one run;
and the aggregate tokens/s of several clients at once, against one client's.

    python -m benchmarks.serve [--model PATH] [--threads 2] [--max-tokens 64] [--repeats 3] [--json]
    python -m benchmarks.serve --clients 1,2,4,8 [--streamed] [--max-tokens 64]

In-process calls `engine.chat_stream` in this process; the server path sends the same greedy chat
request with the official `openai` client (streaming) to `tierflow serve` started as a separate
process on a loopback port, as a desktop app would talk to it (a client inside the server's process
would fight its generation thread for the GIL). Each repeat runs both, alternating which goes
first; the median is reported. The server's overhead per token is the difference of the two
per-token times.

With --clients, the server runs with --parallel set to the most clients, and each count of clients
sends its chats at once (streaming, greedy, each a different question, its end tokens banned by a
logit_bias so that every answer runs to --max-tokens, as llama.cpp's batched-bench runs fixed
lengths); the aggregate rate is all their generated tokens over the time from the first request
to the last answer's end, and its ratio against one client's is what batching the sequences gains
(one sweep of the weights serves every sequence). llama.cpp decodes the same counts of sequences
batched in one context, as llama-server's slots do (benchmarks/llama_batched.py), in the same run.
--streamed serves the F32 copy of the bundled model with a quarter of its layers in RAM, the rest
read from disk every pass (benchmarks/speculative.py's setting), where one sweep shared by all is
worth the most.
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from openai import OpenAI

from benchmarks.llama_batched import batched_rates
from tierflow import Engine

MESSAGES = [{"role": "user", "content": "Write a detailed story about a lighthouse keeper."}]
QUESTIONS = ["Write a story about a lighthouse keeper.", "Explain how a bicycle works.",
             "Describe a walk through a forest in autumn.", "Tell me about the history of bread.",
             "Write a letter to a friend about a trip to the mountains.", "Explain why the sky is blue.",
             "Describe the life of a honeybee.", "Write a story about a robot learning to paint."]


@dataclass
class Sample:
    first_token_s: float  # request sent -> first text piece received
    tokens_per_s: float  # generated tokens after the first, per second after the first
    tokens: int


def in_process(engine: Engine, max_tokens: int) -> Sample:
    engine.logits([50])  # forget the cached prompt: every run prefills the whole prompt
    started = time.perf_counter()
    stream = engine.chat_stream(MESSAGES, max_tokens=max_tokens, temperature=0)
    first = None
    for _ in stream:
        first = first or time.perf_counter()
    return _sample(started, first, time.perf_counter(), len(stream.result.tokens))


def through_server(client: OpenAI, max_tokens: int) -> Sample:
    # An unrelated short request first, so the measured one shares no cached prefix either.
    client.completions.create(model="tierflow", prompt="Zebra", max_tokens=1)
    started = time.perf_counter()
    chunks = client.chat.completions.create(model="tierflow", messages=MESSAGES, stream=True,
                                            max_tokens=max_tokens, temperature=0,
                                            stream_options={"include_usage": True})
    first, tokens = None, 0
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return _sample(started, first, time.perf_counter(), tokens)


def _sample(started: float, first: float | None, ended: float, tokens: int) -> Sample:
    first = first or ended
    rate = (tokens - 1) / (ended - first) if tokens > 1 and ended > first else 0.0
    return Sample(first - started, rate, tokens)


def start_server(model: str | None, threads: int, *options: str) -> tuple[subprocess.Popen, int]:
    """`tierflow serve` in its own process; returns once /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "tierflow.cli.app", "serve", "--port", str(port),
               "--threads", str(threads), "--ctx", "1024", *options] + (["-m", model] if model else [])
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server, port
        except OSError:
            if server.poll() is not None:
                break
            time.sleep(0.2)
    server.kill()
    raise SystemExit("tierflow serve did not start")


def together(client: OpenAI, clients: int, max_tokens: int, no_end: dict[str, int]) -> tuple[float, int]:
    """Aggregate generated tokens/s of `clients` chats sent at once, and their tokens; no_end (a
    logit_bias) keeps each from ending before max_tokens, so that all run the whole time."""
    tokens = [0] * clients
    start = threading.Barrier(clients + 1)

    def chat(i: int) -> None:
        start.wait()
        chunks = client.chat.completions.create(
            model="tierflow", messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            stream=True, max_tokens=max_tokens, temperature=0, stream_options={"include_usage": True},
            logit_bias=no_end)
        for chunk in chunks:
            if chunk.usage:
                tokens[i] = chunk.usage.completion_tokens

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return sum(tokens) / (time.perf_counter() - started), sum(tokens)


def concurrency(args) -> None:
    """Aggregate tokens/s of 1, 2, 4, ... clients at once, against one client's."""
    counts = sorted({1, *(int(n) for n in args.clients.split(","))})
    model, options = args.model, ["--parallel", str(max(counts))]
    if args.streamed:
        from benchmarks.speculative import CONTEXT, bench_files, quarter_resident_budget
        from tierflow.kv_types import kv_type
        from tierflow.offload.gguf.model_file import open_model_file
        from tierflow.offload.plan.budgets import kv_cache_bytes

        model = str(bench_files()[2])
        with open_model_file(model) as opened:
            more_caches = (max(counts) - 1) * kv_cache_bytes(opened.config, CONTEXT, kv_type("f16"))
        budget = quarter_resident_budget(Path(model)) + more_caches  # its caches beside the first's
        options += ["--cpu-memory", str(budget)]
    server, port = start_server(model, args.threads, *options)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600)
    try:
        no_end = {str(token): -100 for token in end_tokens(model)}
        together(client, 1, 4, no_end)  # warm-up
        rates, shared = {}, {}
        for n in counts:
            before = batched(port)
            rates[n] = [together(client, n, args.max_tokens, no_end)[0] for _ in range(args.repeats)]
            passes, sequences = (now - then for now, then in zip(batched(port), before))
            shared[n] = sequences / passes if passes else 0.0
    finally:
        server.terminate()
        server.wait()
    llama = batched_rates(model, counts, args.max_tokens, args.threads)
    one = statistics.median(rates[1])
    setting = "streamed F32 copy, a quarter resident" if args.streamed else "resident"
    print(f"{setting}; threads {args.threads}; {args.max_tokens} tokens per client; "
          f"--parallel {max(counts)}; median of {args.repeats}; llama.cpp: the same sequences batched "
          f"in-process{', the whole file in RAM' if args.streamed else ''}")
    print(f"{'clients':>8}{'aggregate tok/s':>17}{'x one client':>14}{'sequences per pass':>20}"
          f"{'llama.cpp tok/s':>17}{'x one':>7}{'x llama.cpp':>13}")
    for n in counts:
        rate = statistics.median(rates[n])
        print(f"{n:>8}{rate:>17.1f}{rate / one:>13.2f}x{shared[n]:>20.2f}{llama[n]:>17.1f}"
              f"{llama[n] / llama[1]:>6.2f}x{rate / llama[n]:>12.2f}x")


def end_tokens(model: str | None) -> frozenset[int]:
    """The model's end-of-generation token ids."""
    from tierflow.offload.gguf.model_file import open_model_file
    from tierflow.offload.gguf.model_path import resolve_model_path
    from tierflow.runtime.loading.loader import load_tokenizer

    with open_model_file(resolve_model_path(model)) as opened:
        tokenizer = load_tokenizer(opened)
    try:
        return tokenizer.eog_ids
    finally:
        tokenizer.close()


def batched(port: int) -> tuple[int, int]:
    """The server's (passes, sequences served) so far, from /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = dict(line.split() for line in text.splitlines() if line and not line.startswith("#"))
    return tuple(int(float(values[f"tierflow_batched_{kind}_total"])) for kind in ("passes", "sequences"))


def median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--clients", default=None, help="counts of clients at once, e.g. 1,2,4,8")
    parser.add_argument("--streamed", action="store_true", help="with --clients: stream the weights")
    args = parser.parse_args(argv)
    if args.clients:
        return concurrency(args)

    engine = Engine.load(args.model, threads=args.threads, context_length=1024)
    server, port = start_server(args.model, args.threads)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    runs = {"in-process": lambda: in_process(engine, args.max_tokens),
            "server": lambda: through_server(client, args.max_tokens)}
    for run in runs.values():
        run()  # warm-up
    samples: dict[str, list[Sample]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
        for name in order:
            samples[name].append(runs[name]())
    server.terminate()
    server.wait()

    summary = {name: {"first_token_ms": 1e3 * median(s, "first_token_s"),
                      "tokens_per_s": median(s, "tokens_per_s"),
                      "tokens": median(s, "tokens")} for name, s in samples.items()}
    local, remote = summary["in-process"], summary["server"]
    overhead_ms = 1e3 * (1 / remote["tokens_per_s"] - 1 / local["tokens_per_s"])
    if args.json:
        print(json.dumps({"summary": summary, "overhead_ms_per_token": overhead_ms,
                          "samples": {n: [asdict(s) for s in v] for n, v in samples.items()}}))
        return
    print(f"model: {engine.config.name}; threads {args.threads}; {args.max_tokens} tokens; "
          f"median of {args.repeats}")
    print(f"{'path':<14}{'first token ms':>16}{'decode tok/s':>14}")
    for name, row in summary.items():
        print(f"{name:<14}{row['first_token_ms']:>16.1f}{row['tokens_per_s']:>14.1f}")
    print(f"{'server/local':<14}{remote['first_token_ms'] / local['first_token_ms']:>15.2f}x"
          f"{remote['tokens_per_s'] / local['tokens_per_s']:>13.2f}x")
    print(f"server overhead: {overhead_ms:+.2f} ms per token")


if __name__ == "__main__":
    sys.exit(main())
