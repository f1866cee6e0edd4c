"""Structured output (issue 16, part 2): JSON schemas, JSON objects, regexes, choices and
grammars, enforced by xgrammar's token bitmask in the sampler of whichever worker samples.

The engine tests run the offline ``LLM`` on the demo model (random weights, a real BPE
tokenizer): sampled at temperature 1, every output must still match its constraint. The
served tests run the router with one prefill and one decode worker in this process (the
openai client against a real port): a long prompt is prefilled on the prefill worker,
which samples the first token under the grammar, and the decode worker goes on from it; a
short prompt is prefilled on the decode worker. Their seeded outputs equal the offline
``LLM``'s, so the grammar was handed over at the right place.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import httpx
import jsonschema
import pytest
from inproc_cluster import in_process_cluster

from pdserve.cluster.wire import sampling_params_from_proto, sampling_params_to_proto
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.demo_model import make_demo_model
from pdserve.engine.structured_output import (
    MAX_SPEC_CHARS,
    StructuredOutputSpec,
    check_spec,
    json_schema_spec,
)
from pdserve.engine.tokenizer import encode_prompt
from pdserve.proto import common_pb2
from pdserve.router.grpc_server import RouterServicer
from pdserve.router.protocol import RequestError

MAX_MODEL_LEN = 512
LOCAL_THRESHOLD = 8  # prompts under 8 tokens are prefilled on the decode worker
MAX_TOKENS = 256  # far above what the bounded schemas below need (under 80 tokens)

# Bounded schemas: strings, arrays and numbers have limits, so that random weights end every
# output well within MAX_TOKENS and "finish_reason == stop" can be asked of all of them.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                 "maxItems": 3}},
     "required": ["name", "age", "tags"]},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "kind": {"enum": ["x", "y", 3, None]}},
     "required": ["ok", "score", "kind"]},
    {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "required": ["id"], "properties": {
            "id": {"type": "integer", "minimum": -50, "maximum": 50},
            "label": {"type": "string", "minLength": 1, "maxLength": 4}}}},
    {"type": "object", "properties": {
        "point": {"type": "object", "required": ["x", "y"], "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": 9},
            "y": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
     "required": ["point", "code"]},
]
PERSON = SCHEMAS[0]
REGEX = r"\d{3}-[a-z]{2,4}"
CHOICES = ("yes", "no", "maybe so", 'a "quoted" one')
SUM_GRAMMAR = 'root ::= num (" + " num){0,3}\nnum ::= [1-9] [0-9]{0,2}'
SUM_PATTERN = re.compile(r"[1-9][0-9]{0,2}( \+ [1-9][0-9]{0,2}){0,3}")
PROMPT = "The quick brown fox jumps over the lazy dog and then it runs far away"
CHAT = [{"role": "user", "content": "Describe one person as JSON, with a name and an age."}]


def validate(text: str, schema: dict) -> None:
    """Raises unless ``text`` is JSON (Python's strict parser) valid against ``schema``."""
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("structured") / "demo")


@pytest.fixture(scope="module")
def llm(demo_model) -> LLM:
    return LLM(str(demo_model), dtype="float32", max_model_len=MAX_MODEL_LEN,
               load_progress=False)


# ---- the engine ------------------------------------------------------------------------


def test_json_schema_outputs_always_validate_over_1000_sampled_requests(llm):
    prompts = [f"Request {i}: answer in JSON." for i in range(1000)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                             structured_output=json_schema_spec(SCHEMAS[i % len(SCHEMAS)]))
              for i in range(1000)]
    outputs = llm.generate(prompts, params)
    invalid = []
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (i, completion.text)
        try:
            validate(completion.text, SCHEMAS[i % len(SCHEMAS)])
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append((i, completion.text, str(exc)[:100]))
    assert invalid == []
    assert len({o.outputs[0].text for o in outputs}) > 500  # sampled, not one answer


def test_regex_choice_and_grammar_outputs_match(llm):
    cases = [(StructuredOutputSpec("regex", REGEX), lambda t: re.fullmatch(REGEX, t)),
             (StructuredOutputSpec("choice", CHOICES), lambda t: t in CHOICES),
             (StructuredOutputSpec("grammar", SUM_GRAMMAR), SUM_PATTERN.fullmatch)]
    for spec, matches in cases:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_output=spec)
                  for i in range(48)]
        outputs = [o.outputs[0] for o in llm.generate([PROMPT] * 48, params)]
        assert all(o.finish_reason == "stop" for o in outputs), spec
        assert all(matches(o.text) for o in outputs), [o.text for o in outputs]
        assert len({o.text for o in outputs}) > 2  # the draw still chooses


def test_json_object_outputs_are_json_objects(llm):
    # NOTE: "any JSON object" bounds nothing, and random weights rarely close a string; a
    # bias towards '"' and '}' tokens ends the objects early (the mask still decides).
    tokenizer = llm.get_tokenizer()
    closers = {t: 8.0 for t in range(len(tokenizer))
               if tokenizer.decode([t]).strip() in ('"', "}", '"}', '",', '":')}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, logit_bias=closers,
                             structured_output=StructuredOutputSpec("json_object"))
              for i in range(32)]
    outputs = [o.outputs[0] for o in llm.generate([PROMPT] * 32, params)]
    assert all(o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
    assert all(isinstance(json.loads(o.text), dict) for o in outputs)


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [PROMPT, "Hello there", "Paged attention is"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    constrained = [SamplingParams(temperature=t, seed=i, max_tokens=MAX_TOKENS,
                                  structured_output=json_schema_spec(PERSON))
                   for i, t in enumerate((0.0, 1.0, 1.0))]
    mixed = llm.generate(prompts + prompts, [plain] * 3 + constrained)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for output in mixed[3:]:
        validate(output.outputs[0].text, PERSON)


def test_the_grammar_resumes_after_tokens_generated_elsewhere(llm):
    """What a decode worker does with the prefill worker's first token, and a migrated
    request with its tokens: the matcher is advanced over them before sampling goes on,
    and per-position seeds give the same continuation."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                            structured_output=json_schema_spec(PERSON))
    prompt = encode_prompt(llm.get_tokenizer(), PROMPT)
    whole = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    engine = llm.engine
    for k in (1, 4):
        engine.add_request(f"resumed-{k}", prompt, params, resume_token_ids=whole[:k])
        tokens = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens += output.new_token_ids
        assert whole[:k] + tokens == whole
    assert engine.is_idle_and_clean()


def test_tokens_the_grammar_forbids_are_refused(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(structured_output=StructuredOutputSpec("choice", ("yes", "no")))
    bad = tokenizer.encode("maybe", add_special_tokens=False)
    with pytest.raises(ValueError, match="structured output grammar"):
        llm.engine.make_request("r", [1, 2, 3], params, resume_token_ids=bad)


def test_ignore_eos_still_ends_when_the_grammar_is_complete(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=64, ignore_eos=True,
                            structured_output=StructuredOutputSpec("choice", CHOICES))
    output = llm.generate([PROMPT], params)[0].outputs[0]
    assert output.finish_reason == "stop" and output.text in CHOICES


def test_specs_are_checked_and_cross_the_wire():
    with pytest.raises(ValueError, match="kind"):
        StructuredOutputSpec("xml", "<a/>")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputSpec("choice", ())
    with pytest.raises(ValueError, match="at most"):
        StructuredOutputSpec("regex", "a" * (MAX_SPEC_CHARS + 1))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_output=StructuredOutputSpec("json_object"))
    for spec, words in [(json_schema_spec({"type": "foo"}), 'Unsupported type "foo"'),
                        (json_schema_spec("{not json"), "JSON schema"),
                        (StructuredOutputSpec("regex", "[a-"), "Unclosed '['"),
                        (StructuredOutputSpec("grammar", "root ::= foo"), '"foo" is not defined')]:
        with pytest.raises(ValueError, match=re.escape(words)):
            check_spec(spec)
    for spec in [json_schema_spec(PERSON), StructuredOutputSpec("json_object"),
                 StructuredOutputSpec("regex", REGEX), StructuredOutputSpec("choice", CHOICES),
                 StructuredOutputSpec("grammar", SUM_GRAMMAR)]:
        wire = sampling_params_to_proto(SamplingParams(structured_output=spec))
        assert sampling_params_from_proto(wire).structured_output == spec
    assert sampling_params_from_proto(common_pb2.SamplingParams()).structured_output is None


def test_the_grpc_api_checks_the_constraint():
    router = types.SimpleNamespace(vocab_size=2048, generation_defaults=None)
    ok = common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(regex=REGEX))
    assert RouterServicer._sampling_params(ok, router).structured_output == \
        StructuredOutputSpec("regex", REGEX)
    for bad in [common_pb2.StructuredOutput(regex="[a-"), common_pb2.StructuredOutput(),
                common_pb2.StructuredOutput(json_object=False)]:
        with pytest.raises(RequestError) as refused:
            RouterServicer._sampling_params(common_pb2.SamplingParams(structured_output=bad),
                                            router)
        assert refused.value.param == "structured_output"


# ---- served: router, prefill worker, decode worker ---------------------------------------


@pytest.fixture(scope="module")
def cluster(demo_model, llm, tmp_path_factory):
    with in_process_cluster(tmp_path_factory.mktemp("so"), MAX_MODEL_LEN, model=demo_model,
                            oracle=llm, num_gpu_blocks=128,
                            local_prefill_threshold=LOCAL_THRESHOLD,
                            disaggregation="always") as c:
        yield c


def test_served_json_schema_disaggregated_equals_offline(cluster):
    """The prefill worker samples the first token under the grammar; the decode worker
    advances its own matcher over it and samples the rest."""
    before = cluster.prefill_paths().get("remote", 0)
    for seed in (1, 2, 3):
        reply = cluster.client().chat.completions.create(
            model=str(cluster.model), messages=CHAT, temperature=1.0, seed=seed,
            max_tokens=MAX_TOKENS, response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        validate(choice.message.content, PERSON)
        expected = cluster.oracle.chat(CHAT, SamplingParams(
            temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
            structured_output=json_schema_spec(PERSON)))[0].outputs[0].text
        assert choice.message.content == expected
    assert cluster.prefill_paths()["remote"] == before + 3


def test_served_colocated_short_prompt_equals_offline(cluster):
    prompt = "Hi"
    assert len(encode_prompt(cluster.router.tokenizer, prompt)) < LOCAL_THRESHOLD
    before = cluster.prefill_paths().get("local", 0)
    reply = cluster.client().completions.create(
        model=str(cluster.model), prompt=prompt, temperature=1.0, seed=5, max_tokens=64,
        extra_body={"structured_outputs": {"regex": REGEX}})
    assert reply.choices[0].finish_reason == "stop"
    assert re.fullmatch(REGEX, reply.choices[0].text)
    expected = cluster.oracle.generate([prompt], SamplingParams(
        temperature=1.0, seed=5, max_tokens=64,
        structured_output=StructuredOutputSpec("regex", REGEX)))[0].outputs[0].text
    assert reply.choices[0].text == expected
    assert cluster.prefill_paths()["local"] == before + 1


def test_served_streams_and_every_field_form(cluster):
    client = cluster.client()
    stream = client.chat.completions.create(
        model=str(cluster.model), messages=CHAT, temperature=1.0, seed=11,
        max_tokens=MAX_TOKENS, stream=True, extra_body={"guided_json": PERSON})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    validate(text, PERSON)
    full = client.chat.completions.create(
        model=str(cluster.model), messages=CHAT, temperature=1.0, seed=11,
        max_tokens=MAX_TOKENS, extra_body={"structured_outputs": {"json": PERSON}})
    assert full.choices[0].message.content == text
    reply = client.completions.create(model=str(cluster.model), prompt=PROMPT, n=3, seed=2,
                                      max_tokens=32, extra_body={"guided_choice": list(CHOICES)})
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in reply.choices)
    reply = client.completions.create(model=str(cluster.model), prompt=PROMPT, seed=4,
                                      max_tokens=64, extra_body={"guided_grammar": SUM_GRAMMAR})
    assert SUM_PATTERN.fullmatch(reply.choices[0].text)
    reply = client.completions.create(model=str(cluster.model), prompt=PROMPT, temperature=0,
                                      max_tokens=MAX_TOKENS,
                                      extra_body={"response_format": {"type": "json_object"}})
    if reply.choices[0].finish_reason == "stop":  # unbounded: greedy may run to the limit
        assert isinstance(json.loads(reply.choices[0].text), dict)
    reply = client.completions.create(model=str(cluster.model), prompt=PROMPT, max_tokens=4,
                                      temperature=0,
                                      extra_body={"response_format": {"type": "text"}})
    assert reply.usage.completion_tokens == 4 or reply.choices[0].finish_reason == "stop"


CHAT_BODY = {"messages": [{"role": "user", "content": "x"}]}
BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format.json_schema.schema",
     'Unsupported type "foo"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_regex": "[a-"}, "guided_regex", "Unclosed '['"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "regex"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", '"foo" is not defined'),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex",
     "guided_json, guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs.choice", "response_format, structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice",
     "at most one"),
    ({"guided_json": {"type": "object", "description": "x" * MAX_SPEC_CHARS}}, "guided_json",
     f"at most {MAX_SPEC_CHARS}"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not permitted"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "structured output"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_constraints_get_a_400_naming_the_field(cluster, path):
    base = CHAT_BODY if "chat" in path else {"prompt": "x"}
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        for extra, param, words in BAD_REQUESTS:
            reply = http.post(path, json={**base, "max_tokens": 4, **extra})
            assert reply.status_code == 400, (extra, reply.text)
            error = reply.json()["error"]
            assert error["param"] == param, (extra, error)
            assert words in error["message"], (extra, error)
