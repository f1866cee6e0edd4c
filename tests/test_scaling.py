"""``pdserve scale`` resizes both pools of a running ``pdserve serve`` (a real local Ray,
Redis, router and workers) while requests stream, and no request fails: new workers take
traffic as soon as they serve, removed ones drain first. Also the admin API's refusals,
and per-pool engine flags."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_process import serve_process

from pdserve.entrypoints.redis_server import free_port

PROMPT = " ".join(["the decode worker streams tokens back"] * 12)  # > 16 tokens: the pool
MAX_TOKENS = 12


def cli(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def start_serve(tmp_path_factory, extra_args: list[str]):
    """``pdserve serve`` (1 prefill + 1 decode worker, every long prompt through the
    prefill pool) with ``extra_args``, until the generator is closed; yields (URL, log)."""
    with serve_process(tmp_path_factory, [
            "--grpc-port", "0", "--prefill-workers", "1", "--decode-workers", "1",
            "--disaggregation", "always", "--drain-grace-s", "20", *extra_args]) as serve:
        yield serve.url, serve.log


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """With a larger step budget for prefill and fewer sequences for decode."""
    yield from start_serve(tmp_path_factory, [
        "--prefill-engine-args", "--max-num-batched-tokens 2048",
        "--decode-engine-args", "--max-num-seqs 64"])


class Load:
    """``concurrency`` threads streaming completions in a loop until ``stop()``; every
    outcome is kept (status, tokens received, error)."""

    def __init__(self, url: str, concurrency: int = 4) -> None:
        self.url = url
        self.outcomes: list[tuple[int, int, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True)
                         for _ in range(concurrency)]
        for thread in self._threads:
            thread.start()

    def _loop(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                self.outcomes.append(self._one(http))

    def _one(self, http: httpx.Client) -> tuple[int, int, str]:
        body = {"model": "demo", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                "temperature": 0.8, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with http.stream("POST", f"{self.url}/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    return reply.status_code, 0, reply.read().decode()[:300]
                tokens = 0
                for line in reply.iter_lines():
                    match = re.search(r'"completion_tokens":\s*(\d+)', line)
                    if match:
                        tokens = int(match.group(1))
                return 200, tokens, ""
        except httpx.HTTPError as exc:
            return 0, 0, repr(exc)

    def stop(self) -> list[tuple[int, int, str]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)
        return self.outcomes


def routed_workers(url: str, role: str) -> dict[str, float]:
    """``pdserve:routing_decisions_total`` per worker of ``role``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = (rf'pdserve:routing_decisions_total\{{[^}}]*role="{role}"[^}}]*'
               rf'worker="([^"]+)"[^}}]*\}} ([0-9.e+]+)')
    return {worker: float(n) for worker, n in re.findall(pattern, text)}


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def test_scale_both_pools_up_and_down_under_load(cluster):
    url, _ = cluster
    assert cli("scale", "--url", url).stdout.strip() == \
        '{"prefill_workers": 1, "decode_workers": 1}'
    load = Load(url)
    try:
        time.sleep(3)
        before = {role: routed_workers(url, role) for role in ("prefill", "decode")}
        up = cli("scale", "--url", url, "--prefill", "2", "--decode", "2")
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == '{"prefill_workers": 2, "decode_workers": 2}'
        state = health(url)
        # the new workers take traffic the moment they serve: no registry poll to wait for
        assert (state["num_prefill_workers"], state["num_decode_workers"]) == (2, 2)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            after = {role: routed_workers(url, role) for role in ("prefill", "decode")}
            new = {role: set(after[role]) - set(before[role]) for role in after}
            if all(new[role] for role in new):
                break
            time.sleep(0.5)
        assert all(new[role] for role in new), f"no traffic to the new workers: {after}"
        down = cli("scale", "--url", url, "--prefill", "1", "--decode", "1")
        assert down.returncode == 0, down.stderr
        assert down.stdout.strip() == '{"prefill_workers": 1, "decode_workers": 1}'
        time.sleep(3)  # the remaining workers keep serving
    finally:
        outcomes = load.stop()
    failed = [o for o in outcomes if o[0] != 200 or o[1] != MAX_TOKENS]
    assert len(outcomes) > 20 and not failed, f"{len(failed)} of {len(outcomes)}: {failed[:3]}"
    state = health(url)
    assert (state["num_prefill_workers"], state["num_decode_workers"]) == (1, 1)
    assert 'pdserve:pool_size{model_name="demo",role="decode",state="healthy"} 1.0' in \
        httpx.get(f"{url}/metrics", timeout=10).text


@pytest.mark.parametrize(("body", "param"), [
    ({"decode_workers": 0}, "decode_workers"),
    ({"prefill_workers": 65}, "prefill_workers"),
    ({"prefill_workers": -1}, "prefill_workers"),
    ({"prefill_workers": "2"}, "prefill_workers"),
    ({"decode_workers": 1.5}, "decode_workers"),
    ({"replicas": 2}, "replicas"),
])
def test_bad_scale_requests_get_a_400_naming_the_field(cluster, body, param):
    url, _ = cluster
    reply = httpx.post(f"{url}/admin/scale", json=body, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param
    assert httpx.get(f"{url}/admin/pools", timeout=10).json() == \
        {"prefill_workers": 1, "decode_workers": 1}


def test_each_pool_has_its_own_engine_flags(cluster):
    """Found through the router's service discovery, each worker reports its settings."""
    url, _ = cluster
    targets = httpx.get(f"{url}/metrics/targets", timeout=10).json()
    seen = {}
    for group in targets:
        role = group["labels"]["__meta_pdserve_role"]
        text = httpx.get(f"http://{group['targets'][0]}/metrics", timeout=10).text
        match = re.search(r"pdserve:engine_config_info\{([^}]*)\} 1\.0", text)
        assert match, text[:500]
        seen[role] = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
    assert seen["prefill"]["max_num_batched_tokens"] == "2048"
    assert seen["prefill"]["max_num_seqs"] == "256"
    assert seen["decode"]["max_num_seqs"] == "64"
    assert seen["decode"]["max_num_batched_tokens"] != "2048"
    assert seen["prefill"]["block_size"] == seen["decode"]["block_size"] == "16"


def test_bad_pool_engine_flags_stop_serve_before_it_starts():
    for flags, words in (("--max-num-seqs many", "--decode-engine-args"),
                         ("--block-size 32", "must be the same in both pools"),
                         ("--port 9", "is not an engine flag")):
        done = cli("serve", "--decode-engine-args", flags, "--port", str(free_port()),
                   timeout_s=120)
        assert done.returncode == 2, done.stderr
        assert words in done.stderr and "--decode-engine-args" in done.stderr

