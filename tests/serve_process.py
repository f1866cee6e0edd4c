"""``pdserve serve`` as a subprocess for the tests that need the whole program: the demo
model, a Redis of the test's own, the ports it is given; stopped with SIGINT as an
operator's Ctrl-C would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.engine.demo_model import make_demo_model
from pdserve.entrypoints.redis_server import RedisServer, free_port

START_TIMEOUT_S = 240


@dataclass
class ServeProcess:
    """A ``pdserve serve`` that has printed "pdserve serving"."""

    model: Path
    port: int
    redis: RedisServer
    log: Path
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def serve_process(tmp_path_factory, flags: list[str], port: int | None = None,
                  env: dict[str, str] | None = None,
                  models: list[str] | None = None) -> Iterator[ServeProcess]:
    """Start ``pdserve serve --model <demo> --served-model-name demo --dtype float32
    --max-model-len 512 --port <port> --redis-url <own> <flags>``, wait (at most
    ``START_TIMEOUT_S``) until it serves, and stop it on the way out; "pdserve stopped"
    is checked then. ``env`` adds to the environment; ``models`` replaces ``--model
    <demo> --served-model-name demo`` (``["--models-config", FILE]``)."""
    model = make_demo_model(tmp_path_factory.mktemp("demo") / "model")
    if models is None:
        models = ["--model", str(model), "--served-model-name", "demo"]
    redis = RedisServer()
    port = port or free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", *models,
             "--dtype", "float32", "--max-model-len", "512",
             "--port", str(port), "--redis-url", redis.url, *flags],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RAY_DEDUP_LOGS": "0", **(env or {})})
    deadline = time.monotonic() + START_TIMEOUT_S
    while "pdserve serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            redis.close()
            pytest.fail(f"pdserve serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)
    try:
        yield ServeProcess(model, port, redis, log, proc)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
        redis.close()
    assert "pdserve stopped" in log.read_text()
