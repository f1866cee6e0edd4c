"""What a default ``pdserve serve`` listens on (issue 13): every listener of pdserve's own
(the router's HTTP and gRPC, the workers' gRPC and KV stores, the gloo pair channels,
Redis) binds loopback only; what binds wider is Ray's, and only what Ray does not let
anyone narrow (README, Security).

One real ``pdserve serve`` with no flag but its ports, one completion through it (so the
pair channels exist), then every listening socket of every process it started.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import psutil
import pytest

from pdserve.cluster.redis_server import free_port
from pdserve.engine.demo_model import make_demo_model

MARK = "PDSERVE_TEST_MARK"
START_TIMEOUT_S = 240.0
# Ray's own servers, which bind every interface whatever ray.init is given (it turns a
# 127.0.0.1 node IP into the machine's address): matched on the command line.
RAY_SERVICES = {
    "gcs_server": "the GCS (cluster metadata), gRPC",
    "raylet": "the raylet (scheduling, object manager), gRPC",
    "ray::DashboardAgent": "the dashboard agent (gRPC, HTTP, metrics export)",
    "ray::RuntimeEnvAgent": "the runtime-env agent (HTTP, on the node's IP)",
    "dashboard/dashboard.py": "the dashboard head's metrics port (no UI without "
                              "--ray-dashboard)",
    "autoscaler/_private/monitor.py": "the autoscaler monitor's metrics port",
}
# Processes that run a Ray core worker (the pdserve serve driver, the worker actors, idle
# Ray workers): each has one gRPC server of Ray's on every interface, and nothing else
# pdserve may open there.
RAY_CORE_WORKERS = ("pdserve.cluster.cli serve", "ray::WorkerActor", "ray::IDLE")


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def listeners(processes: list[psutil.Process]) -> list[tuple[int, str, int, str]]:
    """(pid, address, port, command line) of each listening TCP socket and bound UDP
    socket of ``processes``."""
    found = []
    for proc in processes:
        try:
            command = " ".join(proc.cmdline())
            for conn in proc.net_connections(kind="inet"):
                udp = conn.type == 2 and not conn.raddr
                if conn.status == psutil.CONN_LISTEN or udp:
                    found.append((proc.pid, conn.laddr.ip, conn.laddr.port, command))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def started_by(proc: subprocess.Popen, mark: str) -> list[psutil.Process]:
    """``proc``, its descendants, and every process carrying ``mark`` in its environment
    (Ray's processes are not all its descendants)."""
    found = {}
    root = psutil.Process(proc.pid)
    for p in [root, *root.children(recursive=True)]:
        found[p.pid] = p
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark:
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return list(found.values())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("listeners") / "demo")


def test_a_default_pdserve_serve_listens_on_loopback_only(model, tmp_path):
    port, grpc_port, mark = free_port(), free_port(), uuid.uuid4().hex
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cluster.cli", "serve", "--model", str(model),
             "--dtype", "float32", "--max-model-len", "512", "--port", str(port),
             "--grpc-port", str(grpc_port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, MARK: mark})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "pdserve serving" not in (output := log_path.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"pdserve serve did not start:\n{output[-3000:]}")
            time.sleep(0.2)
        body = json.dumps({"model": str(model), "prompt": "a prompt of a few blocks " * 8,
                           "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.loads(reply.read())["usage"]["completion_tokens"] == 4
        found = listeners(started_by(proc, mark))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    output = log_path.read_text()
    redis_port = int(re.search(r"Redis at redis://:\*\*\*@127\.0\.0\.1:(\d+)/", output)[1])
    worker_ports = {int(p) for p in re.findall(r"gRPC 127\.0\.0\.1:(\d+), KV", output)}
    kv_ports = {int(p) for p in re.findall(r"KV 127\.0\.0\.1:(\d+),", output)}
    assert len(worker_ports) == 2 and len(kv_ports) == 1  # a prefill and a decode worker
    ours = {port, grpc_port, redis_port, *worker_ports, *kv_ports}

    table = "\n".join(f"{pid} {address}:{p} {command[:80]}" for pid, address, p, command in found)
    by_port = {}
    for _, address, p, _ in found:
        by_port.setdefault(p, set()).add(address)
    for p in ours:  # each is listening, on loopback only
        assert p in by_port, f"port {p} of pdserve not found listening:\n{table}"
        assert all(is_loopback(a) for a in by_port[p]), f"port {p}:\n{table}"
    wide_per_core_worker = {}
    for pid, address, p, command in found:
        if is_loopback(address):
            continue
        assert p not in ours, f"{address}:{p} is pdserve's:\n{table}"
        if any(service in command for service in RAY_SERVICES):
            continue
        assert any(worker in command for worker in RAY_CORE_WORKERS), \
            f"{address}:{p} of an unknown process:\n{table}"
        wide_per_core_worker.setdefault(pid, []).append(p)
    # the serve driver and both worker actors each have Ray's core worker server, alone
    assert len(wide_per_core_worker) >= 3, table
    assert all(len(ports) == 1 for ports in wide_per_core_worker.values()), table
