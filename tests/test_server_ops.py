"""Operating `tierflow serve`: /metrics in Prometheus's text format, one log line per request with
its timings, --log-level, and an address that cannot be bound as one line and exit code 2."""

import logging
import re
import select
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.budgets import ram_beside_weights
from tests.support.cli import run_tierflow
from tests.support.live_server import (
    LONG_COMPLETION,
    assert_error,
    raw_connection,
    read_until_text,
    running_server,
    serve_command,
    slot_held,
)
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine

KEY = "test-key"
CHAT = {"messages": [{"role": "user", "content": "Hi, who are you?"}], "temperature": 0, "max_tokens": 6}
COMPLETION = {"prompt": "The token counters", "temperature": 0, "max_tokens": 6}
# Prometheus's text format, version 0.0.4: `name{label="value",...} number`
SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_]\w*="(?:[^"\\]|\\.)*",?)*)\})? (\S+)')
LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')
WAIT_S = 30  # bounds a wait for something that must happen; a slow machine does not come near it


def parse_prometheus(text: str) -> dict[tuple[str, frozenset], float]:
    """{(name, labels): value}; fails on a line that is not the format, or a sample whose family
    has no TYPE line before it."""
    typed, samples = set(), {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:]
            assert kind in {"counter", "gauge"}
            typed.add(name)
        elif line and not line.startswith("# HELP "):
            match = SAMPLE.fullmatch(line)
            assert match, f"not Prometheus text: {line!r}"
            name, labels, value = match.groups()
            assert name in typed, f"{name} has no TYPE line"
            samples[name, frozenset(LABEL.findall(labels or ""))] = float(value)
    return samples


def metrics(url: str, **labels: str) -> dict[str, float]:
    """The samples whose labels include `labels`, by name."""
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {name: value for (name, have), value in parse_prometheus(response.text).items()
            if set(labels.items()) <= have}


class RequestLines(logging.Handler):
    """The request log's lines as they come; `wait_for` waits (on a condition, not a clock) for one."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.records.append(record)
            self.changed.notify_all()

    def wait_for(self, start: str) -> logging.LogRecord:
        """The first line that starts with `start`, once it is logged."""
        def found() -> list[logging.LogRecord]:
            return [record for record in self.records if record.getMessage().startswith(start)]

        with self.changed:
            assert self.changed.wait_for(found, WAIT_S), f"no request line {start!r}"
            return found()[0]


@pytest.fixture
def request_lines() -> Iterator[RequestLines]:
    """The request log at every level, for the test."""
    handler, logger = RequestLines(), logging.getLogger("tierflow.requests")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def fields(record: logging.LogRecord) -> dict[str, str]:
    return dict(field.split("=", 1) for field in record.getMessage().split()[3:])


# -- /metrics ----------------------------------------------------------------------------------

def test_metrics_is_prometheus_text_with_every_family(url, request_lines):
    httpx.get(f"{url}/health")
    request_lines.wait_for("GET /health 200")  # a request counted, so its family has a sample
    names = set(metrics(url))
    assert {"tierflow_requests_total", "tierflow_prompt_tokens_total", "tierflow_generated_tokens_total",
            "tierflow_prefill_tokens_per_second", "tierflow_decode_tokens_per_second",
            "tierflow_requests_running", "tierflow_requests_queued", "tierflow_kv_cache_bytes",
            "tierflow_weight_bytes"} <= names


def test_request_counter_moves_by_one_per_request(url, request_lines):
    labels = {"method": "POST", "route": "/v1/chat/completions", "status": "200"}
    before = metrics(url, **labels).get("tierflow_requests_total", 0)
    httpx.post(f"{url}/v1/chat/completions", json=CHAT)
    request_lines.wait_for("POST /v1/chat/completions 200")  # recorded (the client may see the end first)
    assert metrics(url, **labels)["tierflow_requests_total"] == before + 1


def test_token_counters_move_by_the_usage_of_a_request(url, request_lines):
    before = metrics(url)
    usage = httpx.post(f"{url}/v1/completions", json=COMPLETION).json()["usage"]
    request_lines.wait_for("POST /v1/completions 200")
    now = metrics(url)
    for name, used in (("prompt", usage["prompt_tokens"]), ("generated", usage["completion_tokens"])):
        assert now[f"tierflow_{name}_tokens_total"] == before[f"tierflow_{name}_tokens_total"] + used


def test_speed_gauges_are_set_by_a_generation(url, request_lines):
    httpx.post(f"{url}/v1/chat/completions", json=CHAT)
    request_lines.wait_for("POST /v1/chat/completions 200")
    now = metrics(url)
    assert now["tierflow_prefill_tokens_per_second"] > 0 and now["tierflow_decode_tokens_per_second"] > 0


def test_refused_and_unknown_requests_are_counted_by_status(url, request_lines):
    before = metrics(url, route="unmatched", status="404").get("tierflow_requests_total", 0)
    assert httpx.get(f"{url}/no/such/route").status_code == 404
    request_lines.wait_for("GET /no/such/route 404")
    assert metrics(url, route="unmatched", status="404")["tierflow_requests_total"] == before + 1


def test_a_client_that_hangs_up_while_sending_its_body_is_a_disconnect_not_a_500(url, request_lines,
                                                                                 server_errors):
    errors = metrics(url, route="/v1/chat/completions", status="500").get("tierflow_requests_total", 0)
    with raw_connection(url) as client:  # declares 1000 bytes of body, sends 14, hangs up
        client.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.removeprefix('http://')}\r\n"
                       "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                       '{"messages": ['.encode())
    line = request_lines.wait_for("POST /v1/chat/completions ").getMessage()
    assert line.split()[2] == "499"  # nginx's code for a client that left: nobody got an answer
    # The request's task has ended by the time the event loop answers this: anything it logged is in.
    now = metrics(url, route="/v1/chat/completions", status="500").get("tierflow_requests_total", 0)
    assert now == errors and [record.getMessage() for record in server_errors] == []


def test_cache_and_weight_bytes_are_the_engines(url, engine):
    now = metrics(url)
    assert now["tierflow_kv_cache_bytes"] == engine.kv_cache_bytes
    by_tier = {tier: metrics(url, tier=tier)["tierflow_weight_bytes"] for tier in ("gpu", "cpu", "disk")}
    assert by_tier == {"gpu": 0, "cpu": engine.weights.bytes_by_tier()["cpu"], "disk": 0}


def test_a_dense_model_has_no_expert_cache_metrics(url):
    assert not any(name.startswith("tierflow_expert") for name in metrics(url))


def test_metrics_answers_during_a_generation_and_counts_it_running(url):
    with slot_held(url):
        now = metrics(url)  # the engine is busy generating: /metrics must not wait for it
    assert now["tierflow_requests_running"] == 1 and now["tierflow_requests_queued"] == 0


def test_a_request_waiting_for_the_engine_is_counted_queued(url):
    with httpx.Client(timeout=WAIT_S) as client, client.stream("POST", f"{url}/v1/completions",
                                                                json=LONG_COMPLETION) as running:
        lines = running.iter_lines()
        read_until_text(lines)
        # Its headers come once its handler has taken a slot; its text would wait for the first's end.
        with client.stream("POST", f"{url}/v1/completions", json=LONG_COMPLETION):
            now = metrics(url)
    assert now["tierflow_requests_running"] == 1 and now["tierflow_requests_queued"] == 1


def test_metrics_needs_the_api_key_when_one_is_set(engine):
    with running_server(engine, api_key=KEY) as base:
        assert_error(httpx.get(f"{base}/metrics"), 401, "invalid_api_key")
        assert httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.fixture(scope="module")
def moe_url(tmp_path_factory) -> Iterator[tuple[str, Engine]]:
    """A server over a MoE model whose experts stream from disk through a cache of a few."""
    spec = ModelSpec(num_layers=2, hidden_size=128, ffn_size=256, num_experts=8, experts_used=2,
                     weight_type="Q4_0", embedding_type="Q4_0", seed=7)
    path, context = write_model(tmp_path_factory.mktemp("moe") / "moe.gguf", spec), 128
    with Engine.load(path, threads=1, context_length=context) as resident:
        packed = resident.weights.packed
        base = packed.globals.nbytes + sum(layer.nbytes for layer in packed.layers)
        one = packed.experts[0][0].nbytes
    budget = base + ram_beside_weights(path, context) + 12 * one  # of 16
    with Engine.load(path, threads=1, context_length=context, cpu_memory=budget) as engine, \
            running_server(engine) as base_url:
        yield base_url, engine


def test_expert_cache_hit_rate_is_the_engines(moe_url):
    base_url, engine = moe_url
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "Experts", "max_tokens": 8})
    assert response.status_code == 200
    stats, now = engine.expert_stats, metrics(base_url)
    assert now["tierflow_expert_cache_misses_total"] == stats.misses > 0
    assert now["tierflow_expert_cache_hits_total"] == stats.hits
    assert now["tierflow_expert_cache_hit_rate"] == pytest.approx(stats.hit_rate)


# -- the request log ---------------------------------------------------------------------------

def test_a_generation_logs_one_line_with_its_timings(url, engine, request_lines):
    reply = httpx.post(f"{url}/v1/chat/completions", json=CHAT).json()
    line = request_lines.wait_for("POST /v1/chat/completions 200")
    logged = fields(line)
    assert line.levelno == logging.INFO
    assert int(logged["prompt_tokens"]) == reply["usage"]["prompt_tokens"]
    assert int(logged["generated_tokens"]) == reply["usage"]["completion_tokens"]
    assert int(logged["cached_tokens"]) == reply["tierflow"]["cached_prompt_tokens"]
    assert logged["finish"] == "length"
    assert 0 < int(logged["ttft_ms"]) <= int(logged["total_ms"])
    assert float(logged["prefill_tok_s"]) > 0 and float(logged["decode_tok_s"]) > 0


def test_a_streamed_generation_logs_its_line_when_it_ends(url, request_lines):
    response = httpx.post(f"{url}/v1/completions", json={**LONG_COMPLETION, "max_tokens": 4})
    assert response.text.endswith("data: [DONE]\n\n")
    logged = fields(request_lines.wait_for("POST /v1/completions 200"))
    assert logged["generated_tokens"] == "4" and logged["finish"] == "length"


@pytest.mark.slow
def test_a_context_shift_is_in_the_line(url, engine, request_lines):
    turn = "tell me more about it " * 40
    messages = [{"role": role, "content": turn} for role in ("user", "assistant") * 3]  # past 1024 tokens
    body = {"messages": messages + [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    shift = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=WAIT_S).headers["x-context-shift"]
    line = request_lines.wait_for("POST /v1/chat/completions 200").getMessage()
    assert line.endswith(f' context_shift="{shift}"')


def test_health_checks_are_logged_only_at_debug(url, request_lines):
    httpx.get(f"{url}/health")
    assert request_lines.wait_for("GET /health 200").levelno == logging.DEBUG


def test_a_path_cannot_forge_log_lines(url, request_lines):
    httpx.get(f"{url}/x%0AGET%20/forged%20200")
    line = request_lines.wait_for("GET /x").getMessage()
    assert line.startswith(r"GET /x\nGET /forged 200 404 total_ms=") and "\n" not in line


# -- the command -------------------------------------------------------------------------------

@pytest.mark.slow
def test_serve_logs_a_line_per_request(tmp_path):
    with open(tmp_path / "log", "w+") as log:
        with serve_command("--ctx", "256", "--threads", "1", log=log) as base:
            httpx.post(f"{base}/v1/chat/completions", json=CHAT)
        log.seek(0)
        output = log.read()
    assert re.search(r"^INFO: +POST /v1/chat/completions 200 total_ms=\d+ prompt_tokens=\d+ ", output, re.M)
    assert "HTTP/1.1" not in output  # uvicorn's access line is not there as well


@pytest.mark.slow
def test_log_level_warning_silences_the_request_lines(tmp_path):
    with open(tmp_path / "log", "w+") as log:
        with serve_command("--ctx", "256", "--threads", "1", "--log-level", "warning", log=log) as base:
            httpx.post(f"{base}/v1/chat/completions", json=CHAT)
        log.seek(0)
        output = log.read()
    assert "/v1/chat/completions" not in output


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_port_in_use_is_one_line_and_exit_code_2(taken_port):
    result = run_tierflow("serve", "--port", str(taken_port))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"127.0.0.1:{taken_port} is already in use" in result.stderr and "--port" in result.stderr


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])  # TEST-NET-1: on no machine
def test_a_host_that_cannot_be_bound_is_one_line_and_exit_code_2(host):
    result = run_tierflow("serve", "--host", host, "--port", "8000")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"cannot listen on {host}:8000" in result.stderr and "--host" in result.stderr


@pytest.mark.parametrize("args, env", [(["--log-level", "loud"], None), ([], {"TIERFLOW_LOG_LEVEL": "loud"})])
def test_an_unknown_log_level_is_refused_before_loading(args, env):
    result = run_tierflow("serve", *args, env=env)
    assert result.returncode == 2 and "log_level must be one of debug, info, warning, error" in result.stderr


# -- slow clients --------------------------------------------------------------------------------

HEADER_TIMEOUT_S = 0.5  # the impatient server's: a test waits on it, and a slow machine stays under WAIT_S


@pytest.fixture(scope="module")
def impatient_url(engine) -> Iterator[str]:
    with running_server(engine, header_timeout_s=HEADER_TIMEOUT_S) as base:
        yield base


def seconds_until_closed(client: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the server closes the connection (an end of file, or a reset), sending
    `trickle` a byte at a time meanwhile, ten a second, as a slow client sends its headers."""
    start = time.monotonic()
    for byte in (trickle[i:i + 1] for i in range(len(trickle))):
        try:
            client.sendall(byte)
        except OSError:  # the server has closed it and said so
            return time.monotonic() - start
        if select.select([client], [], [], 0.1)[0]:
            break
    try:
        assert client.recv(1024) == b"", "the server answered headers that never ended"
    except ConnectionResetError:
        pass
    return time.monotonic() - start


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "])
def test_a_connection_whose_headers_do_not_come_is_closed_after_the_header_timeout(impatient_url, sent):
    with raw_connection(impatient_url) as client:
        client.sendall(sent)
        assert HEADER_TIMEOUT_S * 0.5 < seconds_until_closed(client) < WAIT_S


def test_headers_sent_a_byte_at_a_time_are_timed_out_from_their_first_byte(impatient_url):
    with raw_connection(impatient_url) as client:
        # 30 bytes at ten a second outlast the timeout: each byte must not start it again
        assert seconds_until_closed(client, b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 30) < 2.5


def test_a_kept_alive_connections_next_headers_are_timed_out_too(impatient_url):
    host = impatient_url.removeprefix("http://").encode()
    with raw_connection(impatient_url) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):  # the whole answer: its headers, then its body
            answer += client.recv(1024)
        assert answer.startswith(b"HTTP/1.1 200 ")
        client.sendall(b"GET /health HTTP/1.1\r\nHost: ")
        assert seconds_until_closed(client) < 4  # before uvicorn's keep-alive timeout (5 s) would


def test_an_answer_that_outlasts_the_header_timeout_is_not_cut(impatient_url):
    with httpx.stream("POST", f"{impatient_url}/v1/completions", json=LONG_COMPLETION) as running:
        lines = running.iter_lines()
        read_until_text(lines)
        time.sleep(2 * HEADER_TIMEOUT_S)
        read_until_text(lines)  # still generating
