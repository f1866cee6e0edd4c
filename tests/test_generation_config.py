"""The model's own defaults (engine/generation_config.py): a request that leaves a sampling
field unset samples with generation_config.json's value, over HTTP and gRPC alike, and its
eos_token_id list ends generation; several --served-model-name; --chat-template."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
from decode_only_cluster import decode_only_cluster

from pdserve.engine.demo_model import make_demo_model
from pdserve.engine.generation_config import GenerationDefaults
from pdserve.engine.tokenizer import eos_token_ids, load_tokenizer, read_chat_template
from pdserve.proto import router_pb2, router_pb2_grpc

DEFAULTS = {"temperature": 0.6, "top_p": 0.85, "top_k": 7, "min_p": 0.05,
            "repetition_penalty": 1.15}
EOS_IDS = [5, 6]  # two ordinary tokens of the demo vocabulary, made end-of-sequence


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_demo_model(tmp_path_factory.mktemp("gen") / "demo")
    (path / "generation_config.json").write_text(json.dumps({**DEFAULTS,
                                                             "eos_token_id": EOS_IDS}))
    return path


@pytest.fixture(scope="module")
def served(model):
    with decode_only_cluster(model, 128, engine={"served_model_name": "main"}, router={
            "served_model_name": "main", "served_model_aliases": ("alias", "other")}) as s:
        seen: list = []
        sampler = s.engine.model_runner.sampler
        sample = sampler.sample

        def spy(logits, requests):  # NOTE: records what the real sampler is given
            seen.extend((r.request_id, r.sampling_params, r.eos_token_ids) for r in requests)
            return sample(logits, requests)

        sampler.sample = spy
        s.seen = seen
        yield s


def sampled_with(served, request_id_part: str) -> dict:
    """The sampling fields of the last request whose id holds ``request_id_part``."""
    _rid, params, eos = next(x for x in reversed(served.seen) if request_id_part in x[0])
    return {name: getattr(params, name) for name in DEFAULTS} | {"eos": eos}


def grpc_generate(served, sampling_params: dict, request_id: str) -> list:
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return list(stub.Generate(router_pb2.GenerateRequest(
            request_id=request_id, model="alias", text="the sea",
            sampling_params=sampling_params), timeout=60))


def test_unset_fields_take_the_models_defaults_over_http_and_grpc(served):
    reply = served.client().completions.create(model="main", prompt="the sea", max_tokens=3)
    http = sampled_with(served, reply.id)
    grpc_generate(served, {"max_tokens": 3}, "grpc-defaults")
    from_grpc = sampled_with(served, "grpc-defaults")
    for seen in (http, from_grpc):
        assert {k: seen[k] for k in DEFAULTS} == pytest.approx(DEFAULTS)
        assert set(EOS_IDS) <= seen["eos"]


def test_fields_the_request_sets_win_even_at_vllms_defaults(served):
    given = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
             "repetition_penalty": 1.0}
    reply = served.client().completions.create(
        model="main", prompt="the sea", max_tokens=3, temperature=0.0, top_p=1.0,
        extra_body={"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0})
    grpc_generate(served, {"max_tokens": 3, **given}, "grpc-given")
    for seen in (sampled_with(served, reply.id), sampled_with(served, "grpc-given")):
        assert {k: seen[k] for k in DEFAULTS} == given


def test_the_generation_configs_eos_ids_stop_generation(served):
    reply = served.client().completions.create(
        model="main", prompt="the sea", max_tokens=8, temperature=0.0,
        logit_bias={str(EOS_IDS[1]): 100})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and reply.usage.completion_tokens == 1


def test_every_served_name_is_accepted_and_listed(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == ["main", "alias", "other"]
    reply = client.completions.create(model="other", prompt="the sea", max_tokens=2)
    assert reply.model == "main"  # vLLM: responses name the first
    with grpc.insecure_channel(served.grpc_address) as channel:
        listed = router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest())
    assert list(listed.models) == ["main", "alias", "other"]


def test_generation_config_modes(model, tmp_path):
    assert GenerationDefaults.load(model).as_dict() == DEFAULTS
    assert GenerationDefaults.load(model, "vllm").as_dict() == {}
    assert set(EOS_IDS) <= eos_token_ids(model, None, "auto")
    assert not set(EOS_IDS) & eos_token_ids(model, None, "vllm")  # config.json's alone
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"top_p": 0.5, "eos_token_id": 9}')
    assert GenerationDefaults.load(model, str(other)).as_dict() == {"top_p": 0.5}
    assert eos_token_ids(model, None, str(other)) == {9}
    with pytest.raises(ValueError, match="--generation-config"):
        GenerationDefaults.load(model, str(tmp_path / "missing"))
    (other / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ValueError, match="top_p=0"):
        GenerationDefaults.load(model, str(other))


def test_chat_template_from_a_file_or_inline(model, tmp_path):
    inline = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    file = tmp_path / "template.jinja"
    file.write_text(inline)
    assert read_chat_template(str(file)) == inline == read_chat_template(inline)
    with pytest.raises(ValueError, match="--chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    copy = shutil.copytree(model, tmp_path / "copy")
    tokenizer = load_tokenizer(copy, chat_template=inline)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         tokenize=False) == "[hi]"
