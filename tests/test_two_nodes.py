"""A cluster shaped like two nodes on one machine: ``ray start --head``, then ``ray start
--address`` (two raylets, Ray's token authentication on), and ``pdserve serve
--ray-address`` joining it. The workers land on both nodes, and a disaggregated request
moves its KV from one to the other."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import httpx
import pytest
from serve_process import serve_process

from pdserve.entrypoints.redis_server import free_port

# Ray refuses a second node on a loopback head without this; its token auth stays on.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_MODE": "token"}
READY = re.compile(r"(prefill|decode) worker \d+/\d+ ready .*, node (\w+)\)")


def ray(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("ray") or "ray", *args], capture_output=True,
                          text=True, timeout=180, check=False, env={**os.environ, **RAY_ENV})


@pytest.fixture(scope="module")
def two_nodes():
    """The head's address; both nodes are stopped on the way out."""
    port = free_port()
    common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    head = ray("start", "--head", "--port", str(port), "--include-dashboard=false", *common)
    if head.returncode != 0:
        pytest.fail(f"ray start --head failed:\n{head.stderr[-2000:]}")
    try:
        node = ray("start", f"--address=127.0.0.1:{port}", *common)
        assert node.returncode == 0, node.stderr[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        ray("stop", "--force")


def test_workers_spread_over_both_nodes_and_serve_across_them(two_nodes, tmp_path_factory):
    with serve_process(tmp_path_factory, [
            "--ray-address", two_nodes, "--grpc-port", "0", "--prefill-workers", "1",
            "--decode-workers", "1", "--disaggregation", "always"], env=RAY_ENV) as serve:
        nodes = dict(READY.findall(serve.log.read_text()))
        assert set(nodes) == {"prefill", "decode"}, serve.log.read_text()[-2000:]
        assert nodes["prefill"] != nodes["decode"]  # one worker on each node
        reply = httpx.post(f"{serve.url}/v1/completions", timeout=120, json={
            "model": "demo", "prompt": " ".join(["the KV moves between nodes"] * 8),
            "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        metrics = httpx.get(f"{serve.url}/metrics", timeout=10).text
        assert re.search(r'pdserve:prefill_path_total\{[^}]*path="remote"[^}]*\} [1-9]',
                         metrics), "the prompt was not prefilled on the other node"
