"""Time to first token and decode tokens/s through the local server, against in-process, in one run.

    python -m benchmarks.serve [--model PATH] [--threads 2] [--max-tokens 64] [--repeats 3] [--json]

In-process calls `engine.chat_stream` in this process; the server path sends the same greedy chat
request with the official `openai` client (streaming) to `tierflow serve` started as a separate
process on a loopback port, as a desktop app would talk to it (a client inside the server's process
would fight its generation thread for the GIL). Each repeat runs both, alternating which goes
first; the median is reported. The server's overhead per token is the difference of the two
per-token times.
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass

from openai import OpenAI

from tierflow import Engine

MESSAGES = [{"role": "user", "content": "Write a detailed story about a lighthouse keeper."}]


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


def start_server(model: str | None, threads: int) -> tuple[subprocess.Popen, int]:
    """`tierflow serve` in its own process; returns once /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "tierflow.cli.app", "serve", "--port", str(port),
               "--threads", str(threads), "--ctx", "1024"] + (["-m", model] if model else [])
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


def median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

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
