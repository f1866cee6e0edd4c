"""``--kv-cache-dtype`` served disaggregated: a prefill and a decode worker in this process
(``inproc_cluster``), a real Redis and router, KV over a loopback gloo pair channel.

Both workers on int8 (and with int8 weights too): the served greedy text equals the
colocated engine's in the same configuration (the same kernels store the same bytes,
which move unconverted), the router hashes prompts as
its workers do, and the prefix index leads a repeated prompt to the decode worker that
holds it. Workers of different KV dtypes: the pull is refused at pairing within seconds,
with an error naming both, and the request still completes (prefilled again on the decode
worker).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request

import pytest
from inproc_cluster import in_process_cluster

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.block_hash import hash_block_chain, root_block_hash
from pdserve.engine.demo_model import make_demo_model
from pdserve.router.generate_request import GenerateRequest

PROMPTS = ["the KV cache of a quantized worker holds one byte a value " * 4,
           "a short one " * 5, "blocks move as their bytes, with their scales " * 6]
PARAMS = {"temperature": 0.0, "max_tokens": 16}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("kvq") / "demo")


def generate(cluster, prompt: str | list[int]) -> str:
    reply = cluster.client().completions.create(model=str(cluster.model), prompt=prompt,
                                                extra_body={"ignore_eos": True}, **PARAMS)
    return reply.choices[0].text


def test_int8_workers_serve_the_colocated_int8_engines_tokens(demo, tmp_path):
    oracle = LLM(str(demo), dtype="float32", kv_cache_dtype="int8", max_model_len=256,
                 load_progress=False)
    int8 = {"kv_cache_dtype": "int8"}
    with in_process_cluster(tmp_path, 256, model=demo, oracle=oracle, prefill_engine=int8,
                            decode_engine=int8, kv_cache_dtype="int8", disaggregation="always",
                            local_prefill_threshold=4) as cluster:
        for prompt in PROMPTS:
            assert generate(cluster, prompt) == cluster.expected(prompt, ignore_eos=True,
                                                                 **PARAMS)
        assert cluster.prefill_paths().get("remote", 0) >= len(PROMPTS)
        engines = [w.runtime.engine.engine for w in (cluster.prefill, cluster.decode)]
        assert all(e.model_runner.kv_cache.dtype.itemsize == 1 for e in engines)
        for worker in (cluster.prefill, cluster.decode):  # operators see it
            with urllib.request.urlopen(
                    f"http://{worker.runtime.metrics_server.address}/metrics", timeout=10) as r:
                assert 'kv_cache_dtype="int8"' in r.read().decode()
        # the router's block hashes are its workers', which differ from a float cache's
        roots = {e.kv_cache_manager.root_hash for e in engines}
        assert roots == {cluster.router._root_hash} == {
            root_block_hash(cluster.router.served_model_name, 16, "int8")}
        assert cluster.router._root_hash != root_block_hash(cluster.router.served_model_name, 16)
        cluster.wait_all_blocks_free()
        # the prefix index holds the workers' int8 blocks of a served prompt under the
        # router's hashes
        tokens = cluster.router.tokenizer.encode(PROMPTS[2], add_special_tokens=False)
        assert generate(cluster, tokens) == cluster.expected(tokens, ignore_eos=True, **PARAMS)
        hashes, overlaps = asyncio.run_coroutine_threadsafe(cluster.router._prefix_lookup(
            GenerateRequest("lookup", tokens, SamplingParams())), cluster.loop).result(10)
        assert hashes == hash_block_chain(tokens, 16, engines[1].kv_cache_manager.root_hash)
        assert overlaps[cluster.decode.worker_id] == overlaps[cluster.prefill.worker_id] == len(
            tokens) // 16


def test_w8_with_int8_kv_disaggregated_equals_colocated(demo, tmp_path):
    """Issue 26's disaggregated check: int8 weights (``--quantization int8``) and an int8
    KV cache on both workers, every prompt prefilled remotely: the served greedy text is the
    colocated engine's in the same configuration."""
    config = {"kv_cache_dtype": "int8", "quantization": "int8"}
    oracle = LLM(str(demo), dtype="float32", max_model_len=256, load_progress=False, **config)
    with in_process_cluster(tmp_path, 256, model=demo, oracle=oracle, prefill_engine=config,
                            decode_engine=config, kv_cache_dtype="int8", disaggregation="always",
                            local_prefill_threshold=4) as cluster:
        engines = [w.runtime.engine.engine for w in (cluster.prefill, cluster.decode)]
        for engine in engines:  # both workers run the quantized linears and cache
            assert engine.model_runner.kv_cache.dtype.itemsize == 1
            layer = engine.model_runner.model.model.layers[0]
            assert type(layer.mlp.down_proj).__name__ == "QuantizedLinear"
        for prompt in PROMPTS:
            assert generate(cluster, prompt) == cluster.expected(prompt, ignore_eos=True,
                                                                 **PARAMS)
        assert cluster.prefill_paths().get("remote", 0) >= len(PROMPTS)
        cluster.wait_all_blocks_free()


def test_workers_of_different_kv_dtypes_are_refused_at_pairing(demo, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    with in_process_cluster(tmp_path, 256, model=demo, prefill_engine={"kv_cache_dtype": "int8"},
                            disaggregation="always", local_prefill_threshold=4) as cluster:
        start = time.monotonic()
        text = generate(cluster, PROMPTS[0])
        assert time.monotonic() - start < 5
        assert text == cluster.expected(PROMPTS[0], ignore_eos=True, **PARAMS)  # decode's own
        refusals = [r.getMessage() for r in caplog.records if "KV cache dtypes differ" in
                    r.getMessage()]
        assert refusals, [r.getMessage() for r in caplog.records]
        message = refusals[0]
        assert f"decode worker {cluster.decode.worker_id} holds float32" in message
        assert (f"prefill worker {cluster.prefill.worker_id} holds int8 values with fp32 "
                "scales") in message and "--kv-cache-dtype" in message
        cluster.wait_all_blocks_free()


def test_pdserve_serve_gives_its_router_and_both_pools_one_kv_cache_dtype(demo):
    from pdserve.engine.engine_config import EngineConfig
    from pdserve.entrypoints.cli import build_parser
    from pdserve.entrypoints.serve import Interrupts, _ServeRun
    from pdserve.entrypoints.serve_models import pool_engine_config

    args = build_parser().parse_args(["serve", str(demo), "--kv-cache-dtype", "int8"])
    run = _ServeRun(args, Interrupts())
    spec = run.models[0]
    assert spec.engine.kv_cache_dtype == "int8"
    for role in ("prefill", "decode"):  # what _start_workers gives each pool
        assert pool_engine_config(spec.engine, getattr(args, f"{role}_engine_args"),
                                  role).kv_cache_dtype == "int8"
    router, _ = run._make_router(spec, "redis://127.0.0.1:1", None)
    assert router.config.kv_cache_dtype == "int8"
    assert router._root_hash == root_block_hash(spec.engine.served_model_name, 16, "int8")
    with pytest.raises(ValueError, match="--decode-engine-args: --kv-cache-dtype must be the "
                                         "same in both pools"):
        pool_engine_config(EngineConfig(str(demo)), "--kv-cache-dtype fp8", "decode")


def test_the_routers_own_flag():
    from pdserve.router.__main__ import parse_args
    from pdserve.router.config import RouterConfig

    args = parse_args(["--model", "m", "--redis-url", "redis://x", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        RouterConfig("m", "redis://x", kv_cache_dtype="int4")
