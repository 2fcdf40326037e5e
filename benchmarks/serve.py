"""Time to first token and decode tokens/s through the local server's APIs, against in-process, in one
run; the aggregate tokens/s of several clients at once, against one client's; and a model loaded on
demand, against Engine.load of the same file.

    python -m benchmarks.serve [--model PATH] [--threads 2] [--max-tokens 64] [--repeats 3] [--json]
    python -m benchmarks.serve --clients 1,2,4,8 [--streamed] [--max-tokens 64]
    python -m benchmarks.serve --on-demand [--model PATH]

In-process calls `engine.chat_stream` in this process; each server path sends the same greedy chat
request, streamed, with its API's official client (`openai`'s chat completions, `ollama`'s /api/chat,
`anthropic`'s /v1/messages) to `tierflow serve` started as a separate process on a loopback port, as
a desktop app would talk to it (a client inside the server's process would fight its generation
thread for the GIL). Each repeat runs every path, rotating which goes first; the median is
reported. A path's overhead per token is the difference of its per-token time and in-process's.

With --on-demand, the server serves the bundled model (loaded at start) and --model (loaded by its
first request): the time to the first token of that request, which includes the load, against
Engine.load of the file plus an in-process first token; /health's slowest answer while the model
loads; and the first token of each model when asked in turn once both are loaded (no reload).

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

import anthropic
import httpx
import ollama
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


def forget_prompt(client: OpenAI) -> None:
    """An unrelated short request, so that the next one shares no cached prefix either (the
    server runs with one sequence's cache)."""
    client.completions.create(model="tierflow", prompt="Zebra", max_tokens=1)


def through_server(client: OpenAI, max_tokens: int) -> Sample:
    forget_prompt(client)
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


def through_ollama(client: ollama.Client, max_tokens: int, forget: OpenAI) -> Sample:
    forget_prompt(forget)
    started, first, tokens = time.perf_counter(), None, 0
    for chunk in client.chat(model="tierflow", messages=MESSAGES, stream=True,
                             options={"num_predict": max_tokens, "temperature": 0}):
        if chunk.message.content:
            first = first or time.perf_counter()
        if chunk.done:
            tokens = chunk.eval_count
    return _sample(started, first, time.perf_counter(), tokens)


def through_anthropic(client: anthropic.Anthropic, max_tokens: int, forget: OpenAI) -> Sample:
    forget_prompt(forget)
    started, first = time.perf_counter(), None
    with client.messages.stream(model="tierflow", max_tokens=max_tokens, messages=MESSAGES,
                                extra_body={"temperature": 0}) as stream:
        for _ in stream.text_stream:
            first = first or time.perf_counter()
        tokens = stream.get_final_message().usage.output_tokens
    return _sample(started, first, time.perf_counter(), tokens)


def on_demand(args) -> None:
    """A model's first request, its load included, against Engine.load and an in-process first
    token; /health while it loads; then each model's first token in turn, both loaded."""
    from tierflow.offload.store.model_path import resolve_model_path

    model = str(resolve_model_path(args.model))
    server, port = start_server(None, args.threads, "-m", f"default={resolve_model_path(None)}",
                                "-m", f"asked={model}", "--keep-alive", "-1")
    base = f"http://127.0.0.1:{port}"
    client, health, loading = ollama.Client(host=base), [], threading.Event()

    def poll_health() -> None:
        with httpx.Client(timeout=30) as http:  # one client: building one costs tens of ms itself
            while not loading.is_set():
                sent = time.perf_counter()
                http.get(f"{base}/health")
                health.append(time.perf_counter() - sent)
                time.sleep(0.01)

    def first_token(name: str) -> float:
        started = time.perf_counter()
        for chunk in client.chat(model=name, messages=MESSAGES, stream=True, options={"num_predict": 2}):
            if chunk.message.content:
                return time.perf_counter() - started
        return time.perf_counter() - started

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        cold = first_token("asked")
        loading.set()
        poller.join()
        switches = [first_token(name) for name in ("default", "asked") * args.repeats]
    finally:
        loading.set()
        server.terminate()
        server.wait()
    started = time.perf_counter()
    with Engine.load(model, threads=args.threads, context_length=1024) as engine:
        loaded = time.perf_counter() - started
        sample = in_process(engine, 2)
    local = loaded + sample.first_token_s
    print(f"model: {Path(model).name}; threads {args.threads}")
    print(f"first token, loaded on demand: {cold:.2f} s; Engine.load + in-process first token: {local:.2f} s "
          f"({loaded:.2f} + {sample.first_token_s:.2f}); ratio {cold / local:.2f}x")
    print(f"/health while it loaded: {len(health)} answers, slowest {1e3 * max(health, default=0):.1f} ms, "
          f"median {1e3 * statistics.median(health or [0]):.1f} ms")
    switch = 1e3 * statistics.median(switches)
    print(f"first token switching between the two loaded models: median {switch:.1f} ms "
          f"(slowest {1e3 * max(switches):.1f} ms): no reload")


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
        from benchmarks.speculative import CONTEXT, bench_files, resident_share_budget
        from tierflow.kv_types import kv_type
        from tierflow.offload.gguf.model_file import open_model_file
        from tierflow.offload.plan.budgets import kv_cache_bytes

        model = str(bench_files()[2])
        with open_model_file(model) as opened:
            more_caches = (max(counts) - 1) * kv_cache_bytes(opened.config, CONTEXT, kv_type("f16"))
        budget = resident_share_budget(Path(model)) + more_caches  # its caches beside the first's
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
    from tierflow.offload.store.model_path import resolve_model_path
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
    parser.add_argument("--on-demand", action="store_true", help="a model loaded by its first request")
    args = parser.parse_args(argv)
    if args.clients:
        return concurrency(args)
    if args.on_demand:
        return on_demand(args)

    engine = Engine.load(args.model, threads=args.threads, context_length=1024)
    server, port = start_server(args.model, args.threads, "--parallel", "1")  # one cache: each run prefills
    base = f"http://127.0.0.1:{port}"
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    runs = {"in-process": lambda: in_process(engine, args.max_tokens),
            "openai": lambda: through_server(client, args.max_tokens),
            "ollama": lambda: through_ollama(ollama.Client(host=base), args.max_tokens, client),
            "anthropic": lambda: through_anthropic(anthropic.Anthropic(base_url=base, api_key="unused"),
                                                   args.max_tokens, client)}
    for run in runs.values():
        run()  # warm-up
    samples: dict[str, list[Sample]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        names = list(runs)
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            samples[name].append(runs[name]())
    server.terminate()
    server.wait()

    summary = {name: {"first_token_ms": 1e3 * median(s, "first_token_s"),
                      "tokens_per_s": median(s, "tokens_per_s"),
                      "tokens": median(s, "tokens")} for name, s in samples.items()}
    local = summary["in-process"]
    overhead_ms = {name: 1e3 * (1 / row["tokens_per_s"] - 1 / local["tokens_per_s"])
                   for name, row in summary.items() if name != "in-process"}
    if args.json:
        print(json.dumps({"summary": summary, "overhead_ms_per_token": overhead_ms,
                          "samples": {n: [asdict(s) for s in v] for n, v in samples.items()}}))
        return
    print(f"model: {engine.config.name}; threads {args.threads}; {args.max_tokens} tokens; "
          f"median of {args.repeats}")
    print(f"{'path':<12}{'first token ms':>16}{'decode tok/s':>14}{'x in-process':>14}"
          f"{'overhead ms/token':>19}")
    for name, row in summary.items():
        print(f"{name:<12}{row['first_token_ms']:>16.1f}{row['tokens_per_s']:>14.1f}"
              f"{row['tokens_per_s'] / local['tokens_per_s']:>13.2f}x{overhead_ms.get(name, 0.0):>+19.2f}")


if __name__ == "__main__":
    sys.exit(main())
