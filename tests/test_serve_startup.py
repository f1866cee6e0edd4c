"""``pdserve serve`` start-up as an operator sees it: a taken port ends it at once, a signal
during start-up stops everything it started, and its children are its own to stop.

Each run marks its environment (``PDSERVE_TEST_MARK``), which every process it starts
inherits (Redis, Ray's processes, the workers), so "nothing is left" is checked over all
processes, orphans included. ("serving" means accepting connections: tests/test_serve.py.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from pdserve.engine.demo_model import make_demo_model
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.entrypoints.serve import Interrupts, computing_workers

MARK = "PDSERVE_TEST_MARK"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("demo") / "model")


def start_serve(model, log_path, mark: str, *flags: str) -> subprocess.Popen:
    """``pdserve serve`` in its own session (as a terminal's foreground job), output to
    ``log_path``."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", "--model", str(model),
             "--dtype", "float32", "--max-model-len", "512", *flags],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, MARK: mark})


def marked(mark: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``mark``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def wait_none_marked(mark: str, timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def kill_marked(mark: str) -> None:
    for proc in marked(mark):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def wait_for_line(proc: subprocess.Popen, log_path, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (log := log_path.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {text!r} in pdserve serve's output:\n{log[-3000:]}")
        time.sleep(0.1)
    return log


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_taken_port_exits_2_at_once_and_starts_nothing(model, tmp_path, flag):
    mark = uuid.uuid4().hex
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--grpc-port" if flag == "--port" else "--port"
        log_path = tmp_path / "serve.log"
        proc = start_serve(model, log_path, mark, flag, str(port), other, "0")
        try:
            assert proc.wait(timeout=30) == 2
        finally:
            proc.kill()
            kill_marked(mark)
    output = log_path.read_text()
    assert f"pdserve: error: cannot listen on 127.0.0.1:{port}" in output
    assert flag in output
    assert "Redis at" not in output and "worker" not in output
    assert marked(mark) == []


def test_sigint_during_start_up_stops_everything_it_started(model, tmp_path):
    """Ctrl-C (SIGINT to the whole process group) while the workers start."""
    mark = uuid.uuid4().hex
    log_path = tmp_path / "serve.log"
    proc = start_serve(model, log_path, mark, "--port", "0", "--grpc-port", "0",
                       "--prefill-workers", "1", "--decode-workers", "1")
    try:
        log = wait_for_line(proc, log_path, "pdserve: starting 1 prefill", timeout_s=120)
        redis_port = int(log.split("Redis at redis://:***@127.0.0.1:")[1].split("/")[0])
        time.sleep(1.0)  # the workers' constructors are running
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("redis" in child.name() for child in children)
        os.killpg(proc.pid, signal.SIGINT)
        status = proc.wait(timeout=30)
        left = wait_none_marked(mark, timeout_s=20)
    finally:
        proc.kill()
        kill_marked(mark)
    output = log_path.read_text()
    assert status == 128 + signal.SIGINT
    assert "pdserve: start-up interrupted by SIGINT" in output
    assert "pdserve serving" not in output
    assert left == []
    assert not any(child.is_running() for child in children)
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", redis_port)) != 0


def test_private_redis_is_out_of_reach_of_a_terminal_ctrl_c():
    with RedisServer() as server:
        assert os.getpgid(server.pid) != os.getpgid(0)
        assert os.getsid(server.pid) != os.getsid(0)


def test_deferred_interrupt_waits_for_the_step_then_raises():
    steps = []
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with Interrupts() as interrupts:
        with pytest.raises(KeyboardInterrupt), interrupts.deferred():
            signal.raise_signal(signal.SIGTERM)
            steps.append("started and registered")
        assert interrupts.signum == signal.SIGTERM
        # a second signal does not wait
        with pytest.raises(KeyboardInterrupt), interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            steps.append("never")
    assert steps == ["started and registered"]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_cores_are_split_between_the_workers_that_compute():
    """On one CPU node, "auto" keeps prompts on the decode workers, so they alone split the
    cores; "always" and GPUs count every worker."""
    assert computing_workers({"prefill": 1, "decode": 1}, "auto", has_gpus=False) == 1
    assert computing_workers({"prefill": 2, "decode": 3}, "auto", has_gpus=False) == 3
    assert computing_workers({"prefill": 1, "decode": 1}, "always", has_gpus=False) == 2
    assert computing_workers({"prefill": 1, "decode": 2}, "auto", has_gpus=True) == 3
