"""What a default ``pdserve serve`` listens on: every socket of its process tree, its
own and those of the local Ray it starts, binds a loopback address.

pdserve's own listeners: the router's HTTP (``--port``) and gRPC (``--grpc-port``), the
private Redis, each worker's gRPC, and the KV transfer's: the decode worker's KV store and
its pair channel's listener (made by the first remote prefill, so the test sends one).
The workers' gRPC servers, the KV store and the pair listener must also refuse a client
without the cluster secret (the store: a ``TCPStore`` client, and a pdserve store client
with another key; the pair listener: a client that answers its challenge with another
key). Ray's: the GCS,
the raylet (node manager, object manager), every core worker (the driver's, the actors',
idle workers'), the dashboard agent, runtime-env agent, and the metrics exporters of the
dashboard head and the autoscaler monitor. Ray binds all of these to loopback once its node
IP is 127.0.0.1 (entrypoints/launcher.py), so no Ray listener needs an exception here.

Each socket is classified by owner: pdserve's by port (the router's flags, the workers'
``ready`` lines) or process (Redis), Ray's gRPC servers by the port each one logs at
start-up (``<name> server started, listening on port N``), its agents' and exporters' by
the ports it records in its session folder, the rest by process.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from test_serve_startup import (
    kill_marked,
    marked,
    start_serve,
    wait_for_line,
    wait_none_marked,
)

from pdserve.engine.demo_model import make_demo_model
from pdserve.entrypoints.launcher import node_ip_for
from pdserve.entrypoints.redis_server import free_port

START_TIMEOUT_S = 150
READY = re.compile(r"(prefill|decode) worker \d+/\d+ ready \(gRPC \S+:(\d+), KV (\S+), "
                   r"metrics \S+:(\d+), id \S+-(\d+), node \w+\)")
RAY_GRPC_LOG = re.compile(r"^\[\S+ \S+ \w (\d+) \d+\].* (\w+) server started, "
                          r"listening on port (\d+)\.", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Listener:
    """One listening TCP or bound UDP socket of one process."""

    pid: int
    process: str  # short process name: "pdserve", "raylet", "ray::WorkerActor", ...
    transport: str  # "tcp" or "udp"
    ip: str
    port: int
    owner: str = ""  # "pdserve" or "ray"
    purpose: str = ""

    def __str__(self) -> str:
        return (f"{self.owner:7} {self.purpose:40} {self.process:22} pid {self.pid:<7} "
                f"{self.transport} {self.ip}:{self.port}")


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1: an IPv6 socket on IPv4 loopback
    return (mapped or address).is_loopback


def process_name(proc: psutil.Process, serve_pid: int) -> str:
    if proc.pid == serve_pid:
        return "pdserve"
    cmdline = proc.cmdline()
    if cmdline and cmdline[0].startswith("ray::"):
        return cmdline[0].split()[0].split(".")[0]  # "ray::WorkerActor.info": an actor
    scripts = [Path(arg).name for arg in cmdline[:3] if arg.endswith(".py")]
    return scripts[0] if scripts else proc.name()


def sockets_of(procs: list[psutil.Process], serve_pid: int) -> list[Listener]:
    """Every TCP socket in LISTEN and every bound UDP socket of ``procs``."""
    found = []
    for proc in procs:
        try:
            name = process_name(proc, serve_pid)
            connections = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for conn in connections:
            tcp = conn.type == socket.SOCK_STREAM
            if (tcp and conn.status != psutil.CONN_LISTEN) or not conn.laddr:
                continue
            found.append(Listener(proc.pid, name, "tcp" if tcp else "udp", conn.laddr.ip,
                                  conn.laddr.port))
    return found


# Ray's own names for the ports it records in its session folder (``<name>_<node id>``)
RAY_PORT_FILES = {"metrics_agent_port": "dashboard agent gRPC (metrics)",
                  "metrics_export_port": "Prometheus metrics export",
                  "dashboard_agent_listen_port": "dashboard agent HTTP",
                  "runtime_env_agent_port": "runtime-env agent HTTP"}
RAY_PROCESSES = {"monitor.py": "autoscaler monitor metrics",
                 "dashboard.py": "dashboard head (metrics)"}


def ray_ports(procs: list[psutil.Process]) -> dict[tuple[int | None, int], str]:
    """What Ray's ports are for, from the session of the GCS among ``procs``:
    ``(pid, port) -> name`` of each gRPC server Ray logs ("GcsServer", "NodeManager",
    "ObjectManager", "driver", "worker"), and ``(None, port) -> purpose`` of the ports it
    records in its session folder."""
    session = None
    for proc in procs:
        try:
            cmdline = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if cmdline and cmdline[0].endswith("gcs_server"):
            log_dirs = [arg.split("=", 1)[1] for arg in cmdline if arg.startswith("--log_dir=")]
            session = Path(log_dirs[0]).parent
    assert session is not None, "no gcs_server among pdserve serve's processes"
    ports: dict[tuple[int | None, int], str] = {}
    for path in (session / "logs").iterdir():
        if path.is_file() and path.suffix in (".log", ".out", ".err"):
            for pid, name, port in RAY_GRPC_LOG.findall(path.read_text(errors="replace")):
                ports[int(pid), int(port)] = f"{name} gRPC"
    for path in session.glob("*_port_*"):
        purpose = RAY_PORT_FILES.get(path.name.rsplit("_", 1)[0])
        if purpose is not None and path.read_text().strip().isdigit():
            ports[None, int(path.read_text())] = purpose
    return ports


def classify(listener: Listener, router_ports: dict[int, str], worker_ports: dict[int, str],
             worker_pids: dict[int, str], ray: dict[tuple[int | None, int], str]) -> Listener:
    """``listener`` with its owner and purpose."""
    pid, port = listener.pid, listener.port
    if listener.process == "pdserve" and port in router_ports:
        owner, purpose = "pdserve", router_ports[port]
    elif listener.process == "redis-server":
        owner, purpose = "pdserve", "private Redis"
    elif port in worker_ports and pid in worker_pids:
        owner, purpose = "pdserve", worker_ports[port]
    elif (pid, port) in ray or (None, port) in ray:
        owner, purpose = "ray", ray.get((pid, port)) or ray[None, port]
    elif pid in worker_pids:
        owner, purpose = "pdserve", f"{worker_pids[pid]} KV transfer (pair channel)"
    else:
        owner, purpose = "ray", RAY_PROCESSES.get(listener.process, "unknown")
    return Listener(pid, listener.process, listener.transport, listener.ip, port, owner,
                    purpose)


def probe_unauthenticated(ready: list[tuple[str, ...]]) -> dict[str, str]:
    """Call each worker's gRPC server (``Health``) with no cluster credentials, and the
    decode worker's KV store as a ``TCPStore`` client and as a pdserve store client with
    another cluster's key: what each answered."""
    import datetime

    import grpc
    import torch.distributed as dist

    from pdserve.kvtransfer.store import RemoteStore, StoreAuthError
    from pdserve.proto import common_pb2

    answers = {}
    for role, grpc_port, kv, _, _ in ready:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        service = "PrefillWorker" if role == "prefill" else "DecodeWorker"
        health = channel.unary_unary(f"/pdserve.v1.{service}/Health",
                                     request_serializer=common_pb2.HealthRequest.SerializeToString,
                                     response_deserializer=common_pb2.HealthResponse.FromString)
        try:
            health(common_pb2.HealthRequest(), timeout=10)
            answers[f"{role} worker gRPC"] = "OK"
        except grpc.RpcError as exc:
            answers[f"{role} worker gRPC"] = exc.code().name
        channel.close()
        if role == "decode":
            host, _, port = kv.rpartition(":")
            try:
                dist.TCPStore(host, int(port), None, False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=2)).set("pdkv/x", "1")
                answers["decode worker KV store"] = "a TCPStore client got in"
                continue
            except (RuntimeError, OSError):
                pass
            try:
                RemoteStore(host, int(port), b"another cluster".ljust(32), 5).set("x", "1")
                answers["decode worker KV store"] = "another key got in"
            except StoreAuthError:
                answers["decode worker KV store"] = "refused a TCPStore client and another key"
    return answers


def probe_pair_listeners(listeners: list[Listener], ready: list[tuple[str, ...]],
                         ray: dict[tuple[int | None, int], str]) -> dict:
    """Answer the challenge of every TCP listener of the decode worker that is neither one
    of its known ports nor Ray's (``ray``: as ``classify`` takes it), that is its pair
    channels', with another key: ``{port: "refused"}`` where it closed the connection,
    else what it did."""
    from pdserve.kvtransfer.socket_pair import MAGIC

    known = {int(p) for _, grpc_port, _, metrics, _ in ready for p in (grpc_port, metrics)}
    known |= {int(kv.rpartition(":")[2]) for role, _, kv, _, _ in ready if role == "decode"}
    decode_pids = {int(pid) for role, _, _, _, pid in ready if role == "decode"}
    answers = {}
    for listener in listeners:
        if (listener.pid not in decode_pids or listener.transport != "tcp"
                or listener.port in known or (listener.pid, listener.port) in ray
                or (None, listener.port) in ray):
            continue
        with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
            hello = sock.recv(len(MAGIC) + 16)
            sock.sendall(os.urandom(48))
            sock.settimeout(10)
            closed = sock.recv(1) == b""
        answers[listener.port] = ("refused" if hello.startswith(MAGIC) and closed
                                  else f"hello {hello[:16]!r}, closed {closed}")
    return answers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("demo") / "model")


def test_every_listener_of_a_default_serve_binds_loopback(model, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")  # NOTE: no kernel build: it listens on nothing
    mark = uuid.uuid4().hex
    log_path = tmp_path / "serve.log"
    port, grpc_port = free_port(), free_port()
    proc = start_serve(model, log_path, mark, "--port", str(port), "--grpc-port",
                       str(grpc_port), "--served-model-name", "demo",
                       "--local-prefill-threshold", "0",  # every prompt is prefilled remotely
                       "--disaggregation", "always")
    try:
        log = wait_for_line(proc, log_path, "pdserve serving", START_TIMEOUT_S)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "demo", "prompt": "The KV cache moves. " * 4,
                                 "max_tokens": 2})  # NOTE: whole blocks to move
        assert reply.status_code == 200, reply.text
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        procs = list({p.pid: p for p in [*tree, *marked(mark)]}.values())
        ray_known = ray_ports(procs)
        listeners = sockets_of(procs, proc.pid)
        ready = READY.findall(log)
        refusals = probe_unauthenticated(ready)
        pair_refusals = probe_pair_listeners(listeners, ready, ray_known)
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=60)
        left = wait_none_marked(mark, timeout_s=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        kill_marked(mark)

    worker_ports = {int(port): f"{role} worker gRPC" for role, port, _, _, _ in ready}
    worker_ports.update({int(port): f"{role} worker metrics" for role, _, _, port, _ in ready})
    worker_ports.update({int(kv.rpartition(":")[2]): "decode worker KV store"
                         for role, _, kv, _, _ in ready if role == "decode"})
    worker_pids = {int(pid): role for role, _, _, _, pid in ready}
    router_ports = {port: "router HTTP", grpc_port: "router gRPC"}
    found = [classify(listener, router_ports, worker_ports, worker_pids, ray_known)
             for listener in listeners]
    table = "\n".join(map(str, sorted(found, key=lambda f: (f.owner, f.purpose, f.port))))
    print(table)  # NOTE: shown with -s
    purposes = {(f.process, f.purpose) for f in found}
    # the enumeration sees pdserve's listeners and Ray's, in the processes expected
    assert {("pdserve", "router HTTP"), ("pdserve", "router gRPC"),
            ("redis-server", "private Redis"), ("ray::WorkerActor", "prefill worker gRPC"),
            ("ray::WorkerActor", "decode worker gRPC"), ("gcs_server", "GcsServer gRPC"),
            ("ray::WorkerActor", "prefill worker metrics"),
            ("ray::WorkerActor", "decode worker metrics"),
            ("raylet", "NodeManager gRPC"), ("raylet", "ObjectManager gRPC"),
            ("pdserve", "driver gRPC")} <= purposes, table
    assert len(worker_pids) == 2, log
    assert ("ray::WorkerActor", "decode worker KV store") in purposes, table
    assert any(f.purpose == "decode KV transfer (pair channel)" for f in found), table
    assert pair_refusals and set(pair_refusals.values()) == {"refused"}, pair_refusals
    # each of pdserve's workers' listeners refuses a client without the cluster secret
    assert refusals == {"prefill worker gRPC": "UNAUTHENTICATED",
                        "decode worker gRPC": "UNAUTHENTICATED",
                        "decode worker KV store": "refused a TCPStore client and another key"}
    wide = "\n".join(str(f) for f in found if not is_loopback(f.ip))
    assert not wide, f"listeners beyond loopback:\n{wide}\nall:\n{table}"
    assert status == 0 and left == []
    assert "pdserve stopped" in log_path.read_text()


def test_ray_node_ip_is_loopback_unless_a_host_is_another_address():
    assert node_ip_for("127.0.0.1", "127.0.0.1") == "127.0.0.1"
    assert node_ip_for("localhost", "::1") == "127.0.0.1"
    assert node_ip_for("127.0.0.2", "127.0.0.1") == "127.0.0.1"
    assert node_ip_for("0.0.0.0", "127.0.0.1") is None  # Ray's routable default
    assert node_ip_for("127.0.0.1", "::") is None
    assert node_ip_for("10.0.0.7", "127.0.0.1") == "10.0.0.7"
    assert node_ip_for("127.0.0.1", "10.0.0.8") == "10.0.0.8"


def test_a_loopback_ray_is_refused_once_ray_was_imported_without_single_node_mode():
    """The launcher cannot narrow a Ray imported before it: it refuses rather than start
    one on the routable address."""
    code = ("import ray\nfrom pdserve.entrypoints.launcher import RayLauncher\n"
            "try:\n    RayLauncher(num_cpus=1)\nexcept RuntimeError as exc:\n    print(exc)\n"
            "print('initialized', ray.is_initialized())")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "cannot start Ray on 127.0.0.1 only" in out
    assert "initialized False" in out
