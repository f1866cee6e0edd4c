"""Every worker serves its own Prometheus metrics, and the router lists them for
Prometheus's HTTP service discovery: in-process workers (real gRPC, gloo, Redis), a real
disaggregated request, a real scrape over HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request

import pytest
from conftest import random_prompts
from disagg_client import TEST_AUTH, decode_stub, generate, health, prefill_stub
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.decode_worker.server import DecodeWorker
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.demo_model import make_demo_model
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.kvtransfer import socket_pair
from pdserve.prefill_worker.server import PrefillWorker
from pdserve.router.config import RouterConfig
from pdserve.router.model_service import ModelService

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
MAX_MODEL_LEN = 256


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` at ``address``: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The one sample named ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(found) == 1, f"{name} {labels}: {len(found)} samples"
    return found[0]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """Run a disaggregated request twice (the second hits the prefill worker's prefix
    cache), then scrape both workers and ask a router for its discovery targets."""
    model = str(make_demo_model(tmp_path_factory.mktemp("demo") / "model"))  # the router
    # needs its tokenizer
    engine = EngineConfig(model, dtype="float32", max_model_len=MAX_MODEL_LEN,
                          load_progress=False, num_gpu_blocks_override=64)
    prompt = random_prompts([70], seed=5)[0]

    async def main(redis_url):
        prefill = PrefillWorker(WorkerConfig("prefill", engine, redis_url=redis_url,
                                             kv_transfer_timeout_s=5.0, auth=TEST_AUTH))
        decode = DecodeWorker(WorkerConfig("decode", dataclasses.replace(engine),
                                           redis_url=redis_url, kv_transfer_timeout_s=5.0,
                                           auth=TEST_AUTH))
        await prefill.start()
        await decode.start()
        try:
            p, d = prefill_stub(prefill.grpc_address), decode_stub(decode.grpc_address)
            for i in range(2):
                result = await generate(p, d, f"metrics-{i}", prompt, GREEDY)
                assert len(result.tokens) == GREEDY.max_tokens
            await asyncio.sleep(1.0)  # NOTE: the engine threads' audits refresh every 0.5 s
            leases = (await health(p)).num_kv_leases
            addresses = {w.config.role: w.runtime.metrics_server.address
                         for w in (prefill, decode)}
            samples = {role: await asyncio.to_thread(scrape, address)
                       for role, address in addresses.items()}
            records = {r.role: r for r in WorkerRegistry(redis_url, auth=TEST_AUTH).list_live()}
            router = ModelService(RouterConfig(model, redis_url, max_model_len=MAX_MODEL_LEN,
                                         auth=TEST_AUTH))
            await router.start()
            try:
                targets = router.pool.metrics_targets(router.served_model_name)
                pool = router.metrics.exposition().decode()
            finally:
                await router.stop()
            ids = {w.config.role: w.worker_id for w in (prefill, decode)}
            return addresses, samples, records, targets, pool, ids, prompt, leases
        finally:
            await prefill.stop()
            await decode.stop()

    with RedisServer() as redis:
        return asyncio.run(main(redis.url))


def test_each_worker_exports_vllm_metrics_with_worker_and_role(scraped):
    _, samples, _, _, _, ids, prompt, _ = scraped
    for role in ("prefill", "decode"):
        s, labels = samples[role], {"worker": ids[role], "role": role}
        assert value(s, "vllm:num_requests_running", **labels) == 0
        assert value(s, "vllm:num_requests_waiting", **labels) == 0
        assert 0 <= value(s, "vllm:kv_cache_usage_perc", **labels) <= 1
        assert value(s, "vllm:num_preemptions_total", **labels) == 0
        assert value(s, "vllm:prefix_cache_queries_total", **labels) == 2 * len(prompt)
        steps = value(s, "vllm:iteration_tokens_total_count", **labels)
        assert steps > 0
        assert value(s, "vllm:iteration_tokens_total_bucket", le="+Inf", **labels) == steps
        assert value(s, "pdserve:unowned_blocks", **labels) == 0
        assert value(s, "pdserve:worker_draining", **labels) == 0
        assert all(dict(ls).get("model_name") for (_, ls) in s if dict(ls).get("worker"))
    # the second prefill reuses the first one's 4 full blocks (64 tokens)
    assert value(samples["prefill"], "vllm:prefix_cache_hits_total") == 64
    # the prefill worker ran 2 x 70 prompt tokens; the decode worker, 5 decode steps each
    prefill_tokens = value(samples["prefill"], "vllm:iteration_tokens_total_sum")
    assert prefill_tokens == 70 + (70 - 64)
    assert value(samples["decode"], "vllm:iteration_tokens_total_bucket", le="1") >= 10


def test_kv_transfer_metrics_agree_on_both_sides(scraped):
    _, samples, _, _, _, _, _, leases = scraped
    sent = value(samples["prefill"], "pdserve:kv_transfer_bytes_total")
    pulled = value(samples["decode"], "pdserve:kv_transfer_bytes_total")
    assert sent == pulled > 0
    for role in ("prefill", "decode"):
        assert value(samples[role], "pdserve:kv_transfers_total", result="failed") == 0
        assert value(samples[role], "pdserve:kv_transfers_in_flight") == 0
        assert value(samples[role], "pdserve:kv_transfer_seconds_total") > 0
    assert value(samples["decode"], "pdserve:kv_transfers_total", result="ok") >= 1
    # no connection refused: the decode worker's store refused none, and its pair listeners
    # count in a process-wide total (one worker per process when deployed; here earlier
    # tests' in-process workers were refused attackers' connections too)
    assert value(samples["prefill"], "pdserve:kv_connections_refused_total") == 0
    assert value(samples["decode"], "pdserve:kv_connections_refused_total") == \
        socket_pair.refused_total()
    # every lease ended (pulled or released), as the prefill worker's Health says too
    assert value(samples["prefill"], "pdserve:kv_leases") == leases == 0


def test_router_lists_every_worker_for_prometheus_discovery(scraped):
    addresses, _, records, targets, pool, ids, _, _ = scraped
    assert {r: records[r].metrics_address for r in records} == addresses
    assert sorted(targets, key=lambda g: g["labels"]["__meta_pdserve_role"]) == [
        {"targets": [addresses[role]],
         "labels": {"__meta_pdserve_worker": ids[role], "__meta_pdserve_role": role,
                    "__meta_pdserve_model_name": records[role].model}}
        for role in ("decode", "prefill")]
    assert 'pdserve:pool_size{model_name=' in pool and 'role="prefill",state="known"} 1.0' in pool
