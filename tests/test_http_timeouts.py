"""Slow clients against the router's HTTP port (``router/http_server.py``): a request's
headers, then its body, must arrive within their deadlines, however the bytes trickle in;
a request that arrived in time is answered however long its answer takes; a client that
stops reading its response is dropped. A real uvicorn
port, a real Redis, one prefill and one decode worker in this process on the demo model;
the clients are raw sockets, as an attacker's would be."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest
import uvicorn
from inproc_cluster import in_process_cluster

from pdserve.entrypoints.redis_server import free_port
from pdserve.router.http_server import HTTPLimits, HTTPServerMetrics, timed_h11_protocol

HEADER_S = 0.6
BODY_S = 0.8
MAX_MODEL_LEN = 256
TRICKLE_S = 0.1  # a slow client's pause between two bytes
LIMIT_S = 10.0  # every wait of these tests
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with in_process_cluster(tmp_path_factory.mktemp("timeouts"), MAX_MODEL_LEN,
                            http_timeouts=HTTPLimits(HEADER_S, BODY_S)) as c:
        yield c


def connect(cluster) -> socket.socket:
    host, port = cluster.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=LIMIT_S)


def trickle_until_closed(sock: socket.socket, byte: bytes | None) -> tuple[bytes, float]:
    """Send ``byte`` every ``TRICKLE_S`` (nothing when None) until the server closes the
    connection; returns what it sent back and when it closed (seconds from the call)."""
    start = time.monotonic()
    received = b""
    while time.monotonic() - start < LIMIT_S:
        readable, _, _ = select.select([sock], [], [], TRICKLE_S)
        if readable:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return received, time.monotonic() - start
            received += data
        elif byte is not None:
            try:
                sock.sendall(byte)
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed: the next select says so
    raise AssertionError(f"the connection was still open after {LIMIT_S} s")


def timeouts_counted(cluster) -> dict[str, float]:
    """``pdserve:http_request_timeouts_total`` by phase, from ``/metrics``."""
    text = httpx.get(cluster.url + "/metrics", timeout=LIMIT_S).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("pdserve:http_request_timeouts_total{"):
            phase = line.split('phase="')[1].split('"')[0]
            counts[phase] = float(line.rsplit(" ", 1)[1])
    assert set(counts) == {"header", "body", "send"}, text
    return counts


def completion_body(max_tokens: int = 4, **extra) -> bytes:
    return json.dumps({"prompt": PROMPT, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, **extra}).encode()


def served(cluster, **extra) -> None:
    """One completion succeeds on a new connection: the router still serves."""
    with httpx.Client(timeout=LIMIT_S) as client:
        reply = client.post(cluster.url + "/v1/completions",
                            json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True,
                                  **extra})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_a_connection_that_sends_nothing_is_closed_silently(cluster):
    before = timeouts_counted(cluster)
    with connect(cluster) as sock:
        received, closed_after = trickle_until_closed(sock, None)
    assert received == b""  # nothing was asked: nothing is answered
    assert HEADER_S * 0.9 <= closed_after < HEADER_S + 3
    assert timeouts_counted(cluster)["header"] == before["header"] + 1
    served(cluster)


def test_headers_trickled_a_byte_at_a_time_get_408_at_the_header_deadline(cluster):
    before = timeouts_counted(cluster)
    with connect(cluster) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        received, _ = trickle_until_closed(sock, b"a")  # each byte arrives in time
        closed_after = time.monotonic() - start
    assert HEADER_S * 0.9 <= closed_after < HEADER_S + 3
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == 408 and f"{HEADER_S:g} s" in error["message"]
    assert timeouts_counted(cluster) == {**before, "header": before["header"] + 1}
    served(cluster)


def test_a_trickled_body_is_cut_at_the_body_deadline_and_nothing_is_admitted(cluster):
    before = timeouts_counted(cluster)
    body = completion_body(max_tokens=8) + b" " * 200  # JSON allows trailing blanks
    with connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10])
        start = time.monotonic()
        received, _ = trickle_until_closed(sock, b" ")  # never reaches the length
        closed_after = time.monotonic() - start
    assert received == b""  # the handler was still reading: it only saw the client leave
    # the headers' own time counts toward the header deadline only
    assert BODY_S * 0.9 <= closed_after < BODY_S + 3
    assert timeouts_counted(cluster) == {**before, "body": before["body"] + 1}
    cluster.wait_all_blocks_free()
    served(cluster)


def test_requests_that_arrive_in_time_are_answered(cluster):
    before = timeouts_counted(cluster)
    # a body in two halves, each in time, the whole longer than the header deadline
    body = completion_body()
    with connect(cluster) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) +
                     body[:20])
        time.sleep(HEADER_S * 0.7)
        sock.sendall(body[20:])
        received = b""
        while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            assert data, f"closed before a whole answer: {received!r}"
            received += data
        assert received.startswith(b"HTTP/1.1 200 ")
        # the same connection, kept alive, takes its next request after a pause shorter
        # than the header deadline: the deadline starts again with each request
        time.sleep(HEADER_S * 0.7)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200 "), data
    assert timeouts_counted(cluster) == before


@contextlib.contextmanager
def second_port(cluster, timeouts: HTTPLimits, metrics: HTTPServerMetrics | None = None,
                send_buffer_bytes: int | None = None):
    """The cluster's router app served on another port too, with ``timeouts`` counted in
    ``metrics`` (its own by default; the app's lifespan is the first server's). With
    ``send_buffer_bytes`` its connections' kernel send buffers are that small (loopback's
    grow to megabytes), as a real network's in-flight bytes are bounded. Yields the port."""
    listener = socket.create_server(("127.0.0.1", 0))
    if send_buffer_bytes is not None:  # NOTE: accepted sockets inherit it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    config = uvicorn.Config(cluster.app, log_level="warning", lifespan="off",
                            http=timed_h11_protocol(timeouts, metrics or HTTPServerMetrics()))
    server = uvicorn.Server(config)
    serving = asyncio.run_coroutine_threadsafe(server.serve(sockets=[listener]), cluster.loop)
    deadline = time.monotonic() + LIMIT_S
    while not server.started:
        assert time.monotonic() < deadline and not serving.done(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        serving.result(LIMIT_S)
        listener.close()


def test_a_stream_runs_past_both_deadlines_once_its_request_is_in(cluster):
    timeouts = HTTPLimits(header_timeout_s=0.05, body_timeout_s=0.05)
    with second_port(cluster, timeouts) as port:
        start = time.monotonic()
        with httpx.Client(timeout=LIMIT_S) as client, client.stream(
                "POST", f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                      "ignore_eos": True, "stream": True}) as reply:
            assert reply.status_code == 200
            events = [line for line in reply.iter_lines() if line.startswith("data: ")]
        took = time.monotonic() - start
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))["choices"][0]
    assert last["finish_reason"] == "length"
    assert len(events) > 100  # 200 tokens, streamed in pieces
    assert took > 2 * (timeouts.header_timeout_s + timeouts.body_timeout_s), \
        f"the stream took {took:.2f} s: too short to tell"


@pytest.mark.parametrize(("argv", "flag"), [
    (["serve", "--request-header-timeout-s", "0"], "--request-header-timeout-s"),
    (["serve", "--request-body-timeout-s", "nan"], "--request-body-timeout-s"),
    (["serve", "--response-send-timeout-s", "-1"], "--response-send-timeout-s"),
])
def test_a_deadline_that_is_not_a_positive_time_stops_serve_before_it_starts(argv, flag):
    done = subprocess.run([sys.executable, "-m", "pdserve.entrypoints.cli", *argv, "--port",
                           str(free_port())], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2, done.stderr
    assert f"{flag} must be a positive number of seconds" in done.stderr


def test_a_client_that_stops_reading_is_dropped_and_its_request_cancelled(cluster):
    """A stream's client that takes no bytes for ``send_timeout_s`` while the router has
    more to send: the connection is aborted, the request ends on the workers, and the
    router goes on serving."""
    metrics = HTTPServerMetrics()
    timeouts = HTTPLimits(header_timeout_s=5, body_timeout_s=5, send_timeout_s=0.3)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "n": 4, "logprobs": 5,
                       "temperature": 1.0, "ignore_eos": True, "stream": True}).encode()
    with second_port(cluster, timeouts, metrics, send_buffer_bytes=4096) as port, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
        sock.settimeout(LIMIT_S)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + LIMIT_S
        while metrics.counts()["send"] == 0:  # the client reads nothing meanwhile
            assert time.monotonic() < deadline, "the connection was never dropped"
            time.sleep(0.05)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while data := sock.recv(65536):
                received += data
    assert received.startswith(b"HTTP/1.1 200 ")  # the stream had started...
    assert b"data: [DONE]" not in received  # ...and was cut
    assert metrics.counts() == {"header": 0, "body": 0, "send": 1}
    cluster.wait_all_blocks_free()
    served(cluster)
