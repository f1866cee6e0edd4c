"""A pdserve cluster of plain processes (no Ray) with each process pinned to chosen CPUs,
for the benchmarks that compare cluster shapes (``interference.py``, ``prefix_routing.py``).

A private Redis (``RedisServer``, with a password), workers started as ``python -m
pdserve.<role>_worker``, and the router as ``python -m pdserve.router``, all sharing a
fresh cluster secret (``PDSERVE_CLUSTER_SECRET``). ``os.sched_setaffinity`` pins each
process right after it starts, before its interpreter starts a thread, so all its threads
inherit the CPUs. Everything started is stopped by ``close()`` (SIGTERM, then SIGKILL
after a timeout), also when a start fails.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Self

from pdserve.entrypoints.redis_server import RedisServer, free_port

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


class PlainCluster:
    """Processes of one cluster; ``work`` holds their logs and ready files.

    Args:
        model: checkpoint folder.
        work: a folder for logs.
        worker_args: engine flags for every worker (``--dtype``, ``--max-model-len``...).
    """

    def __init__(self, model: Path, work: Path, worker_args: list[str]) -> None:
        self.model, self.work, self.worker_args = model, work, worker_args
        work.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PDSERVE_CLUSTER_SECRET": secrets.token_hex(32)}
        self.redis = RedisServer()
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.router_url: str | None = None

    def _start(self, name: str, argv: list[str], cpus: set[int]) -> subprocess.Popen:
        log = self.work / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True)
        os.sched_setaffinity(proc.pid, cpus)
        self.procs.append((name, proc, log))
        return proc

    def _failed(self, name: str, proc: subprocess.Popen, log: Path) -> RuntimeError:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        return RuntimeError(f"{name} did not start (exit code {proc.poll()}); last lines "
                            f"of {log}:\n{tail}")

    def start_worker(self, role: str, name: str, cpus: set[int]) -> dict:
        """Start a ``role`` worker on ``cpus`` (one torch thread per CPU); returns its
        ready file's addresses."""
        ready = self.work / f"{name}.ready.json"
        argv = [sys.executable, "-m", f"pdserve.{role}_worker", "--model", str(self.model),
                *self.worker_args, "--num-threads", str(len(cpus)), "--redis-url",
                self.redis.url, "--port", "0", "--ready-file", str(ready), "--log-level",
                "WARNING"]
        proc = self._start(name, argv, cpus)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise self._failed(name, proc, self.work / f"{name}.log")
            time.sleep(0.2)
        return json.loads(ready.read_text())

    def start_router(self, cpus: set[int], args: list[str], num_prefill: int,
                     num_decode: int) -> str:
        """Start the router on ``cpus`` with extra ``args``; wait until it sees the
        workers. Returns its base URL."""
        port = free_port()
        argv = [sys.executable, "-m", "pdserve.router", "--model", str(self.model),
                "--redis-url", self.redis.url, "--port", str(port), "--log-level",
                "warning", *args]
        proc = self._start("router", argv, cpus)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                    health = json.loads(reply.read())
                if health.get("num_prefill_workers") == num_prefill and \
                        health.get("num_decode_workers") == num_decode:
                    self.router_url = url
                    return url
            except OSError:
                pass
            time.sleep(0.5)
        raise self._failed("router", proc, self.work / "router.log")

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Sum of the router's ``name`` samples whose labels include ``labels``."""
        with urllib.request.urlopen(f"{self.router_url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in (labels or {}).items()):
                total += float(value)
        return total

    def close(self) -> None:
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT_S)
        self.redis.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def pin_self(cpus: set[int]) -> None:
    """Pin this process (the benchmark's client) to ``cpus``."""
    os.sched_setaffinity(0, cpus)
