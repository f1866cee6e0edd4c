"""Who may scrape a worker's ``/metrics`` (cluster/metrics_auth.py): with a key, only a
scrape that presents it (or the admin key) as ``Authorization: Bearer``; with none, a worker
on a routable address serves it on loopback only and leaves it out of discovery. Real HTTP
servers, no engine (a collector reads nothing before the engine exists)."""

from __future__ import annotations

import argparse
import hashlib
import logging
import pickle
import socket
import subprocess

import httpx
import pytest

from pdserve.cluster.metrics_auth import (
    METRICS_KEY_ENV,
    MetricsAuth,
    load_metrics_keys,
    metrics_auth_from_args,
)
from pdserve.cluster.worker_config import WorkerConfig, add_worker_args, worker_config_from_args
from pdserve.cluster.worker_metrics import MetricsServer, WorkerCollector
from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.engine.args import add_engine_args
from pdserve.engine.engine_config import EngineConfig
from pdserve.kvtransfer.protocol import KVTransferCounters

METRICS_KEY = "metrics-key-0123456789"
ADMIN_KEY = "admin-key-0123456789"


def routable_address() -> str | None:
    """This machine's first routable address (``hostname -I``'s first), or None."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return next((a for a in out if ":" not in a and not a.startswith("127.")), None)


def runtime(host: str, auth: MetricsAuth | None = None) -> WorkerRuntime:
    """A worker runtime with no engine, its metrics on a free port of ``host``."""
    return WorkerRuntime(WorkerConfig("prefill", EngineConfig("<model>"), host=host,
                                      metrics_auth=auth or MetricsAuth()))


def scrape(address: str, key: str | None = None, scheme: str = "Bearer") -> int:
    headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
    return httpx.get(f"http://{address}/metrics", headers=headers, timeout=10).status_code


@pytest.fixture
def guarded_server():
    auth = MetricsAuth.of([METRICS_KEY], [hashlib.sha256(ADMIN_KEY.encode()).digest()])
    server = MetricsServer(WorkerCollector(runtime("127.0.0.1"), KVTransferCounters), "127.0.0.1",
                           0, auth=auth)
    yield server
    server.close()


def test_a_scrape_needs_the_metrics_key_or_the_admin_key(guarded_server):
    address = guarded_server.address
    reply = httpx.get(f"http://{address}/metrics", timeout=10)
    assert reply.status_code == 401
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    assert "vllm" not in reply.text and "python_" not in reply.text
    assert scrape(address, "wrong-key") == 401
    assert scrape(address, METRICS_KEY[:-1]) == 401
    assert scrape(address, METRICS_KEY, scheme="Basic") == 401
    assert scrape(address, "-") == 401
    assert scrape(address, METRICS_KEY) == 200
    assert scrape(address, ADMIN_KEY) == 200
    assert scrape(address, METRICS_KEY, scheme="bearer") == 200  # the scheme's case: RFC 9110


def test_auth_compares_digests_only_and_crosses_ray_intact():
    auth = MetricsAuth.of([METRICS_KEY])
    assert METRICS_KEY not in repr(auth) and hashlib.sha256(METRICS_KEY.encode()).hexdigest() \
        not in repr(auth)
    copy = pickle.loads(pickle.dumps(auth))
    assert copy.allows(f"Bearer {METRICS_KEY}") and not copy.allows("Bearer other")
    assert not MetricsAuth().allows(f"Bearer {METRICS_KEY}")  # no key: nobody holds one
    assert not auth.allows(None) and not auth.allows(METRICS_KEY)


def test_a_loopback_worker_without_a_key_serves_metrics_as_before():
    worker = runtime("127.0.0.1")
    address = worker.start_metrics(KVTransferCounters)
    try:
        assert address.startswith("127.0.0.1:") and worker.metrics_server.discoverable
        assert scrape(address) == 200
    finally:
        worker.metrics_server.close()


def refused_from(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_routable_worker_without_a_key_serves_metrics_on_loopback_only(caplog):
    host = routable_address()
    if host is None:
        pytest.skip("no routable address on this machine")
    worker = runtime(host)
    with caplog.at_level(logging.WARNING, logger="pdserve.cluster.worker_runtime"):
        address = worker.start_metrics(KVTransferCounters)
    try:
        server = worker.metrics_server
        assert address == f"127.0.0.1:{server.port}" and not server.discoverable
        assert refused_from(host, server.port)
        assert scrape(address) == 200  # this machine's own eyes
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and f"on {address} only" in warnings[0], warnings
    finally:
        worker.metrics_server.close()


def test_a_routable_worker_with_a_key_serves_it_there_and_refuses_without(caplog):
    host = routable_address()
    if host is None:
        pytest.skip("no routable address on this machine")
    worker = runtime(host, MetricsAuth.of([METRICS_KEY]))
    with caplog.at_level(logging.WARNING):
        address = worker.start_metrics(KVTransferCounters)
    try:
        assert address == f"{host}:{worker.metrics_server.port}"
        assert worker.metrics_server.discoverable
        assert scrape(address) == 401 and scrape(address, "wrong") == 401
        assert scrape(address, METRICS_KEY) == 200
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        worker.metrics_server.close()


def test_keys_come_from_flags_else_the_environment(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"\n  {METRICS_KEY}  \nsecond-key\n")
    assert load_metrics_keys(["cli-key"], str(path), {METRICS_KEY_ENV: "env"}) == (
        ["cli-key", METRICS_KEY, "second-key"], "--metrics-api-key, --metrics-api-key-file")
    assert load_metrics_keys((), None, {METRICS_KEY_ENV: "env-key"}) == (
        ["env-key"], METRICS_KEY_ENV)
    assert load_metrics_keys((), None, {}) == ([], None)
    with pytest.raises(ValueError, match=f"{METRICS_KEY_ENV}: the API key is empty"):
        load_metrics_keys((), None, {METRICS_KEY_ENV: ""})  # set but empty: not "no key"
    (tmp_path / "bad").write_text("a key with spaces\n")
    with pytest.raises(ValueError, match="bad, line 1"):
        load_metrics_keys((), str(tmp_path / "bad"), {})
    (tmp_path / "empty").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no API key"):
        load_metrics_keys((), str(tmp_path / "empty"), {})


def test_serve_adds_the_admin_key_and_refuses_a_client_key():
    args = argparse.Namespace(metrics_api_key=[METRICS_KEY], metrics_api_key_file=None)
    admin = hashlib.sha256(ADMIN_KEY.encode()).digest()
    auth = metrics_auth_from_args(args, [admin], environ={})
    assert auth.allows(f"Bearer {METRICS_KEY}") and auth.allows(f"Bearer {ADMIN_KEY}")
    only_admin = metrics_auth_from_args(argparse.Namespace(metrics_api_key=None,
                                                           metrics_api_key_file=None),
                                        [admin], environ={})
    assert only_admin.allows(f"Bearer {ADMIN_KEY}")
    assert not metrics_auth_from_args(argparse.Namespace(metrics_api_key=None,
                                                         metrics_api_key_file=None),
                                      environ={})
    client = hashlib.sha256(METRICS_KEY.encode()).digest()
    with pytest.raises(ValueError, match="also a client API key"):
        metrics_auth_from_args(args, [admin], [client], environ={})


def test_a_worker_process_reads_its_keys_from_a_file_or_the_environment(
        tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 32)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_worker_args(parser)
    flags = [action.option_strings for action in parser._actions]
    assert ["--metrics-api-key-file"] in flags
    assert ["--metrics-api-key"] not in flags  # NOTE: no secret on a worker's command line
    (tmp_path / "keys").write_text(METRICS_KEY)
    args = parser.parse_args(["--model", "m", "--metrics-api-key-file",
                              str(tmp_path / "keys")])
    assert worker_config_from_args("decode", args).metrics_auth.allows(f"Bearer {METRICS_KEY}")
    monkeypatch.setenv(METRICS_KEY_ENV, "env-key")
    args = parser.parse_args(["--model", "m"])
    assert worker_config_from_args("decode", args).metrics_auth.allows("Bearer env-key")
