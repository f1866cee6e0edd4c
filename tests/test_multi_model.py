"""Several models from one ``pdserve serve`` (``--models-config``): each with its own
prefill and decode pools, the router routing by the request's ``model``, ``/v1/models``
listing every model, and metrics labelled per model."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest
from serve_process import serve_process

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.demo_model import make_demo_model
from pdserve.entrypoints.redis_server import free_port
from pdserve.proto import router_pb2, router_pb2_grpc

PROMPT = "The ships sailed north past the lighthouse and the harbour walls at dawn"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Model "sea" (1 prefill + 1 decode worker) and model "sky" (other weights: 0 + 1)."""
    root = tmp_path_factory.mktemp("models")
    sea = make_demo_model(root / "sea", seed=1)
    sky = make_demo_model(root / "sky", seed=2)
    config = root / "models.yaml"
    config.write_text(json.dumps({"models": [
        {"model": str(sea), "served_model_name": "sea", "prefill_workers": 1,
         "decode_workers": 1},
        {"model": str(sky), "served_model_name": "sky", "prefill_workers": 0,
         "decode_workers": 1, "engine_args": "--max-num-seqs 8"}]}))
    with serve_process(tmp_path_factory, ["--grpc-port", str(free_port())],
                       models=["--models-config", str(config)]) as serve:
        yield serve, {"sea": sea, "sky": sky}


def expected(model_dir, prompt: str) -> str:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, load_progress=False)
    return llm.generate([prompt], GREEDY)[0].outputs[0].text


def test_each_request_goes_to_its_models_workers(two_models):
    serve, dirs = two_models
    want = {name: expected(path, PROMPT) for name, path in dirs.items()}
    assert want["sea"] != want["sky"]  # other weights: a wrong route would show
    with httpx.Client(base_url=serve.url, timeout=120) as http:
        listed = http.get("/v1/models").json()["data"]
        assert {(m["id"], m["root"]) for m in listed} == {
            ("sea", str(dirs["sea"])), ("sky", str(dirs["sky"]))}
        for name in ("sea", "sky", "sea", "sky"):
            reply = http.post("/v1/completions", json={
                "model": name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == want[name], name
        chat = http.post("/v1/chat/completions", json={
            "model": "sky", "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["model"] == "sky", chat.text
        missing = http.post("/v1/completions", json={"model": "moon", "prompt": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        health = http.get("/health").json()
        assert set(health["models"]) == {"sea", "sky"} and health["status"] == "ok", health
        assert http.get("/ready").status_code == 200
        metrics = http.get("/metrics").text
        for name in ("sea", "sky"):
            assert re.search(rf'vllm:request_success_total{{[^}}]*model_name="{name}"'
                             rf'[^}}]*}} [1-9]', metrics), name
        assert metrics.count("# TYPE vllm:request_success_total counter") == 1
        sizes = http.get("/admin/pools", params={"model": "sky"}).json()
        assert sizes == {"prefill_workers": 0, "decode_workers": 1}, sizes
        unnamed = http.get("/admin/pools")
        assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"
        targets = http.get("/metrics/targets").json()
        assert {t["labels"]["__meta_pdserve_model_name"] for t in targets} == {"sea", "sky"}
        assert len(targets) == 3  # sea's two workers and sky's one


def test_the_grpc_api_lists_and_routes_both(two_models):
    serve, dirs = two_models
    port = int(re.search(r"pdserve serving .*gRPC 127\.0\.0\.1:(\d+)",
                         serve.log.read_text()).group(1))  # the router's, not a worker's
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        models = stub.ListModels(router_pb2.ListModelsRequest(), timeout=30)
        assert list(models.models) == ["sea", "sky"]
        for name in ("sky", "sea"):
            text = "".join(r.text for r in stub.Generate(router_pb2.GenerateRequest(
                model=name, text=PROMPT, sampling_params={
                    "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}), timeout=120))
            assert text == expected(dirs[name], PROMPT), name


@pytest.mark.parametrize("config, extra, words", [
    ({"models": [{"model": "/m/a", "colour": "red"}]}, [], "unknown key 'colour'"),
    ({"models": [{"served_model_name": "a"}]}, [], "needs 'model'"),
    ({"models": [{"model": "/m/a", "served_model_name": "x"},
                 {"model": "/m/b", "served_model_name": "x"}]}, [], "two models are served"),
    ({"models": [{"model": "/m/a", "decode_workers": 0}]}, [], "decode_workers"),
    ({"models": [{"model": "/m/a", "engine_args": "--model /m/b"}]}, [], "engine_args"),
    ({"models": []}, [], "non-empty list"),
    ({"models": [{"model": "/m/a"}]}, ["--model", "/m/a"], "exclude each other"),
])
def test_a_bad_models_config_stops_serve_before_it_starts(tmp_path, config, extra, words):
    import subprocess
    import sys

    path = tmp_path / "models.yaml"
    path.write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "pdserve.entrypoints.cli", "serve",
                           "--models-config", str(path), "--port", str(free_port()), *extra],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert words in done.stderr, done.stderr[-2000:]
