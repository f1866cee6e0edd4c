"""What one client connection may hold on the router's gRPC API (``router/grpc_server.py``,
``GRPCLimits``): a Generate whose client stops taking its messages ends with
DEADLINE_EXCEEDED and frees its request; one that reads slowly but steadily is served to
the end; a connection runs at most ``max_concurrent_streams`` RPCs at once; a connection
that never finishes its HTTP/2 preface, or runs no RPC for a while, is closed. A real
Redis, one prefill and one decode worker in this process on the demo model, the gRPC
server on the cluster's event loop; the clients are grpc channels and raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import subprocess
import sys
import time

import grpc
import pytest
from inproc_cluster import in_process_cluster

from pdserve.entrypoints.redis_server import free_port
from pdserve.proto import common_pb2, router_pb2, router_pb2_grpc
from pdserve.router.grpc_server import GRPCLimits, GRPCServerMetrics, start_grpc_server

MAX_MODEL_LEN = 256
LIMIT_S = 20.0  # every wait of these tests
# a client whose HTTP/2 window stays about 1 KiB: no BDP probe growing it
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with in_process_cluster(tmp_path_factory.mktemp("grpc_limits"), MAX_MODEL_LEN) as c:
        yield c


@contextlib.contextmanager
def grpc_port(cluster, limits: GRPCLimits, metrics: GRPCServerMetrics | None = None):
    """The cluster's router served over gRPC with ``limits`` on a port of its own;
    yields the port."""
    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, cluster.loop).result(LIMIT_S)

    server, port = call(start_grpc_server(cluster.router, "127.0.0.1", 0, limits=limits,
                                          metrics=metrics))
    try:
        yield port
    finally:
        call(server.stop(0))


def generate_request(max_tokens: int, *, logprobs: int | None = None):
    return router_pb2.GenerateRequest(
        text="The quick brown fox jumps over the lazy dog",
        sampling_params=common_pb2.SamplingParams(
            temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=True,
            logprobs=logprobs))


def test_a_client_that_stops_reading_gets_deadline_exceeded_and_its_request_ends(cluster):
    metrics = GRPCServerMetrics()
    limits = GRPCLimits(send_timeout_s=0.5)

    async def run(port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=SMALL_WINDOW) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            call = stub.Generate(generate_request(200, logprobs=5), timeout=LIMIT_S)
            first = await call.read()
            assert first.token_ids
            deadline = time.monotonic() + LIMIT_S
            while metrics.send_timeouts == 0:  # the client reads nothing meanwhile
                assert time.monotonic() < deadline, "the stream was never ended"
                await asyncio.sleep(0.05)
            received = [first]
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while (message := await call.read()) is not grpc.aio.EOF:
                    received.append(message)
            # the channel serves the next call
            again = [m async for m in stub.Generate(generate_request(8), timeout=LIMIT_S)]
            return received, ended.value, again

    with grpc_port(cluster, limits, metrics) as port:
        received, error, again = asyncio.run(run(port))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "--response-send-timeout-s" in error.details()
    tokens = sum(len(m.token_ids) for m in received)
    assert 0 < tokens < 200 and not any(m.finish_reason for m in received)
    assert metrics.send_timeouts == 1
    cluster.wait_all_blocks_free()
    assert again[-1].finish_reason == "length"
    assert sum(len(m.token_ids) for m in again) == 8


def test_a_client_that_reads_slowly_but_steadily_gets_its_whole_stream(cluster):
    """The deadline is on each message, not on the stream: a stream that takes many
    times ``send_timeout_s`` to read ends normally."""
    metrics = GRPCServerMetrics()
    limits = GRPCLimits(send_timeout_s=1.0)

    async def run(port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=SMALL_WINDOW) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            messages = []
            start = time.monotonic()
            async for message in stub.Generate(generate_request(120, logprobs=5),
                                               timeout=LIMIT_S):
                messages.append(message)
                await asyncio.sleep(0.03)  # 120 messages: 3.6 s at least
            return messages, time.monotonic() - start

    with grpc_port(cluster, limits, metrics) as port:
        messages, took = asyncio.run(run(port))
    assert messages[-1].finish_reason == "length"
    assert sum(len(m.token_ids) for m in messages) == 120
    assert took > 2 * limits.send_timeout_s, f"the stream took {took:.2f} s: too short to tell"
    assert metrics.send_timeouts == 0


@pytest.mark.parametrize("max_streams", [2, 100])
def test_a_connection_runs_at_most_max_concurrent_streams_at_once(cluster, max_streams):
    """Three streams on one connection: with a limit of 2 the third starts only once one
    of the first two has ended; with 100 it runs beside them."""
    async def run(port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            times: dict[int, tuple[float, float]] = {}

            async def one(i):
                first = None
                async for message in stub.Generate(generate_request(48), timeout=LIMIT_S):
                    first = first or time.monotonic()
                    last = message
                assert last.finish_reason == "length"
                times[i] = (first, time.monotonic())

            await asyncio.gather(*(one(i) for i in range(3)))
            return times

    with grpc_port(cluster, GRPCLimits(max_concurrent_streams=max_streams)) as port:
        times = asyncio.run(run(port))
    started_last = max(times, key=lambda i: times[i][0])
    others_ended = min(end for i, (_, end) in times.items() if i != started_last)
    if max_streams == 2:
        assert times[started_last][0] >= others_ended, times
    else:
        assert times[started_last][0] < others_ended, times
    cluster.wait_all_blocks_free()


def closed_after(port: int, send: bytes) -> float:
    """Connect to ``port``, send ``send``, then read (never answering) until the server
    closes the connection; returns how long that took in seconds."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=LIMIT_S) as sock:
        sock.sendall(send)
        while time.monotonic() - start < LIMIT_S:
            readable, _, _ = select.select([sock], [], [], 0.1)
            if readable:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    return time.monotonic() - start
    raise AssertionError(f"the connection was still open after {LIMIT_S} s")


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # length 0, type SETTINGS
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


@pytest.mark.parametrize("send", [b"", PREFACE[:10]], ids=["nothing", "part of the preface"])
def test_a_connection_without_its_preface_is_closed_at_the_handshake_deadline(cluster, send):
    limits = GRPCLimits(handshake_timeout_s=0.5, max_connection_idle_s=100)
    with grpc_port(cluster, limits) as port:
        took = closed_after(port, send)
    assert took < 0.5 + 2.0, took


def test_a_connection_with_no_rpc_is_closed_when_idle_and_its_client_reconnects(cluster):
    limits = GRPCLimits(max_connection_idle_s=0.5)

    async def two_calls_apart(port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            first = await stub.ListModels(router_pb2.ListModelsRequest(), timeout=LIMIT_S)
            await asyncio.sleep(2.0)  # the server closes the idle connection meanwhile
            second = await stub.ListModels(router_pb2.ListModelsRequest(), timeout=LIMIT_S)
            return first, second

    with grpc_port(cluster, limits) as port:
        took = closed_after(port, PREFACE + EMPTY_SETTINGS + SETTINGS_ACK)
        first, second = asyncio.run(two_calls_apart(port))
    assert took < 0.5 + 3.0, took
    assert list(first.models) == list(second.models) == [cluster.router.served_model_name]


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--grpc-max-concurrent-streams", "0", "--grpc-max-concurrent-streams must be an integer"),
    ("--grpc-max-connection-idle-s", "inf", "--grpc-max-connection-idle-s must be a positive"),
])
def test_a_bad_grpc_limit_stops_serve_before_it_starts(flag, value, message):
    done = subprocess.run([sys.executable, "-m", "pdserve.entrypoints.cli", "serve", flag,
                           value, "--port", str(free_port())], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
