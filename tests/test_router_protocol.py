"""OpenAI protocol models: validation naming fields, vLLM's context-length errors, sampling
parameters, and responses that the official `openai` client's types accept."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai.types as oai
import openai.types.chat as oai_chat
import pytest
from pydantic import BaseModel, ValidationError
from transformers import PreTrainedTokenizerFast

from pdserve.cluster.wire import sampling_params_from_proto, sampling_params_to_proto
from pdserve.engine.demo_model import train_demo_tokenizer
from pdserve.engine.request import Logprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.http_format import ChatFormatter, CompletionFormatter
from pdserve.router.http_guard import MAX_JSON_DEPTH, parse_json
from pdserve.router.limits import INT32_MAX, MAX_NUM_SEQUENCES, SEED_LIMIT, choice_seed
from pdserve.router.logprobs import chat_logprobs, completion_logprobs
from pdserve.router.output import GenerationChunk
from pdserve.router.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    RequestError,
    UsageInfo,
    error_response,
    sse_event,
    to_sampling_params,
    validation_error_response,
)

USER = [{"role": "user", "content": "hi"}]


def param_of(cls, **body) -> str | None:
    with pytest.raises(ValidationError) as info:
        cls(**body)
    return validation_error_response(info.value).error.param


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": -1}, "seed"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"stop_token_ids": [-2]}, "stop_token_ids[0]"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_validation_names_the_field(body, param):
    assert param_of(CompletionRequest, prompt="hi", **body) == param


@pytest.mark.parametrize("prompt", [[], [[1, 2], []], [-1], [1, "a"], {"text": "hi"}, None])
def test_bad_prompts_are_refused(prompt):
    assert param_of(CompletionRequest, prompt=prompt) == "prompt"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [*USER, {"role": "user"}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_chat_validation_names_the_field(body, param):
    assert param_of(ChatCompletionRequest, **body) == param


# ---- issue 12: bodies that made the router answer 500 ---------------------------------
@pytest.mark.parametrize("body, param", [
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"stop_token_ids": [5, 2**31]}, "stop_token_ids[1]"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"min_tokens": 2**31}, "min_tokens"),
    ({"prompt": [1, 2**31]}, "prompt"),
    ({"prompt": [[1], [2**40]]}, "prompt"),
])
def test_int32_overflow_is_refused_naming_the_field(body, param):
    assert param_of(CompletionRequest, **{"prompt": "hi", **body}) == param


def test_token_ids_are_checked_against_the_vocabulary_given_in_context():
    def param(**body) -> str:
        with pytest.raises(ValidationError) as info:
            CompletionRequest.model_validate({"prompt": "hi", **body},
                                             context={"vocab_size": 320})
        error = validation_error_response(info.value).error
        assert "vocabulary (size 320)" in error.message
        return error.param

    assert param(prompt=[5, 320]) == "prompt"
    assert param(stop_token_ids=[319, 320]) == "stop_token_ids[1]"
    assert CompletionRequest.model_validate({"prompt": [319], "stop_token_ids": [0]},
                                            context={"vocab_size": 320}).prompts() == [[319]]


def test_values_at_the_limits_reach_the_wire():
    """Every field at its bound converts to protobuf without raising (2**31 did)."""
    request = CompletionRequest(prompt="x", top_k=INT32_MAX, min_tokens=4, max_tokens=INT32_MAX,
                                stop_token_ids=[INT32_MAX], seed=SEED_LIMIT - 1, logprobs=20)
    params = to_sampling_params(request, max_model_len=2**40, prompt_len=1)
    msg = sampling_params_to_proto(params)
    assert (msg.top_k, msg.max_tokens, *msg.stop_token_ids) == (INT32_MAX,) * 3
    assert sampling_params_from_proto(msg).seed == SEED_LIMIT - 1


@pytest.mark.parametrize("body", [
    b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    b"[" * 100_000,
    b'{"a": ' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
])
def test_deep_json_is_a_400(body):
    with pytest.raises(RequestError) as info:
        parse_json(body)
    assert info.value.status == 400 and "nested" in info.value.message


@pytest.mark.parametrize("body, words", [
    (b"\xff{}", "UTF-8"),
    (b'{"t": NaN}', "NaN"),
    (b'{"t": -Infinity}', "Infinity"),
    (b'{"n": ' + b"9" * 5000 + b"}", "too many digits"),
    (b'{"prompt": "hi"', "Expecting"),
])
def test_other_pathological_json_is_a_400(body, words):
    with pytest.raises(RequestError) as info:
        parse_json(body)
    assert info.value.status == 400 and words in info.value.message
    nested = b'{"a": ' * MAX_JSON_DEPTH + b"1" + b"}" * MAX_JSON_DEPTH
    assert parse_json(nested)["a"]["a"]  # the limit itself is fine


@pytest.mark.parametrize("cls, body, param", [
    (CompletionRequest, {"prompt": "hi \ud800"}, "prompt"),
    (CompletionRequest, {"prompt": ["ok", "\udfff"]}, "prompt"),
    (CompletionRequest, {"prompt": "hi", "cache_salt": "salt\udbff"}, "cache_salt"),
    (CompletionRequest, {"prompt": "hi", "stop": ["\ud800"]}, "stop"),
    (CompletionRequest, {"prompt": "hi", "user": "\ud800"}, "user"),
    (CompletionRequest, {"prompt": "hi", "model": "\ud800"}, "model"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]}, "messages[0].content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
     "messages[0].name"),
])
def test_lone_surrogates_are_refused_naming_the_field(cls, body, param):
    assert param_of(cls, **body) == param
    # The JSON escape ("\\ud800") decodes to the same lone surrogate, as the HTTP API
    # parses it, and the error still renders as JSON.
    with pytest.raises(ValidationError) as info:
        cls.model_validate(parse_json(json.dumps(body).encode()))
    error = validation_error_response(info.value)
    assert error.error.param == param and "surrogate" in error.error.message
    error.model_dump_json()


def test_seed_near_2_63_with_n_wraps_for_each_choice():
    """choice i gets (seed + i) mod 2**63: always a valid int64 seed, and seed + i as before
    wherever that fits."""
    request = CompletionRequest(prompt="hi", seed=SEED_LIMIT - 2, n=4)
    seeds = [choice_seed(request.seed, i) for i in range(request.n)]
    assert seeds == [SEED_LIMIT - 2, SEED_LIMIT - 1, 0, 1]
    for seed in seeds:
        sampling_params_to_proto(SamplingParams(seed=seed))
    assert choice_seed(1234, 1) == 1235 and choice_seed(None, 3) is None


def test_n_and_the_number_of_sequences_are_bounded():
    assert param_of(CompletionRequest, prompt="hi", n=129) == "n"
    assert param_of(ChatCompletionRequest, messages=USER, n=2**31) == "n"
    CompletionRequest(prompt=["hi"] * 2, n=128)
    with pytest.raises(RequestError) as info:
        CompletionRequest(prompt=["hi"] * 3, n=128)
    assert info.value.param == "n" and str(MAX_NUM_SEQUENCES) in info.value.message
    with pytest.raises(RequestError):
        CompletionRequest(prompt=[[1]] * (MAX_NUM_SEQUENCES + 1))


def test_stop_lists_are_bounded():
    CompletionRequest(prompt="hi", stop=["s"] * 16, stop_token_ids=list(range(1024)))
    assert param_of(CompletionRequest, prompt="hi", stop=["s"] * 17) == "stop"
    assert param_of(CompletionRequest, prompt="hi", stop="s" * 1025) == "stop"
    assert param_of(CompletionRequest, prompt="hi", stop_token_ids=[1] * 1025) == \
        "stop_token_ids"
    assert param_of(CompletionRequest, prompt="hi", temperature=float("nan")) == "temperature"
    assert param_of(CompletionRequest, prompt="hi", repetition_penalty=float("inf")) == \
        "repetition_penalty"


def test_wire_checks_stop_token_ids_against_the_vocabulary():
    msg = sampling_params_to_proto(SamplingParams(stop_token_ids=[3, 320]))
    assert sampling_params_from_proto(msg).stop_token_ids == [3, 320]
    with pytest.raises(ValueError, match="^stop_token_ids: token id 320"):
        sampling_params_from_proto(msg, vocab_size=320)
    msg = sampling_params_to_proto(SamplingParams(allowed_token_ids=[9, 320]))
    assert sampling_params_from_proto(msg).allowed_token_ids == [9, 320]
    assert sampling_params_from_proto(sampling_params_to_proto(
        SamplingParams())).allowed_token_ids is None  # empty on the wire: any token
    with pytest.raises(ValueError, match="^allowed_token_ids: token id 320") as info:
        sampling_params_from_proto(msg, vocab_size=320)
    assert info.value.param == "allowed_token_ids"
    msg = sampling_params_to_proto(SamplingParams(bad_words_token_ids=[[4], [7, 320]]))
    assert sampling_params_from_proto(msg).bad_words_token_ids == [[4], [7, 320]]
    with pytest.raises(ValueError, match="^bad_words: token id 320"):
        sampling_params_from_proto(msg, vocab_size=320)


def test_validation_error_body_is_openai_shaped():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json('{"prompt": "hi", "max_tokens": -5}')
    body = validation_error_response(info.value).model_dump()
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == 400
    assert "max_tokens" in body["error"]["message"] and "-5" in body["error"]["message"]
    # FastAPI's RequestValidationError.errors() carry a leading "body" in loc.
    errors = [{"loc": ("body", "messages", 0, "role"), "msg": "bad", "input": "x"}]
    assert validation_error_response(errors).error.param == "messages[0].role"


def test_prompt_forms_and_chat_content_parts():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]}],
        user="someone")
    assert request.messages[0].content == "line one\nline two"
    # a field pdserve would ignore is refused, naming it
    with pytest.raises(RequestError, match="guided_whitespace_pattern") as refused:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                              guided_whitespace_pattern=" ")
    assert refused.value.param == "guided_whitespace_pattern"
    stream = CompletionRequest(prompt="a", stream=True, stream_options={"include_usage": True},
                               stop="###")
    assert stream.include_usage() and stream.stop_strings() == ["###"]


def test_sampling_params_mapping():
    request = CompletionRequest(prompt="x", max_tokens=20, temperature=0, top_p=0.9, top_k=-1,
                                min_p=0.1, seed=7, n=2, presence_penalty=0.5,
                                frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=3,
                                ignore_eos=True, stop_token_ids=[5], logprobs=4)
    params = to_sampling_params(request, max_model_len=128, prompt_len=10)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (20, 0, 0.9, 0)
    assert (params.min_p, params.seed, params.n, params.logprobs) == (0.1, 7, 2, 4)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.repetition_penalty, params.min_tokens, params.ignore_eos) == (1.2, 3, True)
    assert params.stop_token_ids == [5]
    default = to_sampling_params(CompletionRequest(prompt="x"), max_model_len=128, prompt_len=10)
    assert (default.max_tokens, default.temperature, default.logprobs) == (16, 1.0, None)


def test_chat_max_tokens_default_and_precedence():
    def max_tokens(**body) -> int:
        request = ChatCompletionRequest(messages=USER, **body)
        return to_sampling_params(request, max_model_len=100, prompt_len=30).max_tokens

    assert max_tokens() == 70  # vLLM: the rest of the context
    assert max_tokens(max_tokens=5) == 5
    assert max_tokens(max_tokens=5, max_completion_tokens=9) == 9
    chat = ChatCompletionRequest(messages=USER, logprobs=True)
    assert to_sampling_params(chat, max_model_len=100, prompt_len=3).logprobs == 0
    chat = ChatCompletionRequest(messages=USER, logprobs=True, top_logprobs=5)
    assert to_sampling_params(chat, max_model_len=100, prompt_len=3).logprobs == 5


def test_context_length_errors_use_vllms_wording():
    with pytest.raises(RequestError) as info:
        to_sampling_params(CompletionRequest(prompt="x", max_tokens=100), max_model_len=128,
                           prompt_len=40)
    assert info.value.message == (
        "This model's maximum context length is 128 tokens. However, you requested 140 tokens "
        "(40 in the messages, 100 in the completion). Please reduce the length of the messages "
        "or completion.")
    assert (info.value.param, info.value.status) == ("max_tokens", 400)
    with pytest.raises(RequestError) as info:
        to_sampling_params(ChatCompletionRequest(messages=USER), max_model_len=128,
                           prompt_len=128)
    assert "your request has 128 input tokens" in info.value.message
    assert info.value.param == "messages"


def test_engine_refusals_become_request_errors():
    with pytest.raises(RequestError) as info:
        to_sampling_params(CompletionRequest(prompt="x", max_tokens=4, min_tokens=9),
                           max_model_len=64, prompt_len=2)
    assert info.value.param == "min_tokens"
    with pytest.raises(RequestError) as info:
        to_sampling_params(CompletionRequest(prompt="x", prompt_logprobs=1, stream=True),
                           max_model_len=64, prompt_len=2)
    assert info.value.param == "prompt_logprobs"


def test_responses_parse_as_openai_client_types():
    usage = UsageInfo.of(prompt_tokens=12, completion_tokens=3, cached_tokens=8)
    completion = CompletionResponse(model="demo", usage=usage, choices=[
        CompletionChoice(index=0, text="abc", finish_reason="length")])
    parsed = oai.Completion.model_validate(completion.model_dump())
    assert parsed.id.startswith("cmpl-") and parsed.usage.total_tokens == 15
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8
    # (openai's Completion type insists on a finish_reason; mid-stream chunks have none)
    chunk = CompletionStreamResponse(model="demo", choices=[
        CompletionStreamChoice(index=0, text="a", finish_reason="stop")])
    assert oai.Completion.model_validate(chunk.model_dump()).choices[0].text == "a"
    chat = ChatCompletionResponse(model="demo", usage=usage, choices=[ChatCompletionChoice(
        index=0, message=ChatResponseMessage(content="hello"), finish_reason="stop")])
    parsed = oai_chat.ChatCompletion.model_validate(chat.model_dump())
    assert parsed.id.startswith("chatcmpl-") and parsed.choices[0].message.content == "hello"
    chunk = ChatCompletionStreamResponse(model="demo", choices=[ChatCompletionStreamChoice(
        index=0, delta=DeltaMessage(role="assistant", content=""))])
    parsed = oai_chat.ChatCompletionChunk.model_validate(chunk.model_dump())
    assert parsed.object == "chat.completion.chunk" and parsed.choices[0].delta.role == "assistant"
    models_list = ModelList(data=[ModelCard(id="demo", max_model_len=2048)])
    assert oai.Model.model_validate(models_list.model_dump()["data"][0]).id == "demo"


def test_error_response_shape():
    body = error_response(404, "The model `x` does not exist.", "model").model_dump()
    assert body == {"error": {"message": "The model `x` does not exist.",
                              "type": "not_found_error", "param": "model", "code": 404}}
    assert error_response(503, "no workers").error.type == "service_unavailable"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=train_demo_tokenizer())


def test_logprobs_in_both_formats(tokenizer):
    the, cache = tokenizer.encode("The cache", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens([the, cache]) == ["The", "Ġcache"]
    steps = [Logprob(the, -0.5, 1, {the: -0.5, cache: -1.5}),
             Logprob(cache, -float("inf"), 3, {the: -0.1})]

    def decode_token(token_id: int) -> str:
        return tokenizer.decode([token_id])

    out = completion_logprobs(steps, decode_token, text_offset=4)
    assert out.tokens == ["The", " cache"]
    assert out.text_offset == [4, 7]
    assert out.token_logprobs == [-0.5, None]  # -inf has no JSON form
    assert out.top_logprobs == [{"The": -0.5, " cache": -1.5},
                                {"The": -0.1, " cache": -9999.0}]
    chat = chat_logprobs(steps, decode_token, num_top=1)
    first = chat.content[0]
    assert (first.token, first.logprob, first.bytes) == ("The", -0.5, list(b"The"))
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("The", -0.5)]
    assert chat.content[1].logprob == -9999.0
    choice = {"index": 0, "finish_reason": "stop", "logprobs": chat.model_dump(),
              "message": {"role": "assistant", "content": "The cache"}}
    assert oai_chat.chat_completion.Choice.model_validate(choice).logprobs.content[1].token == \
        " cache"


# ---- stream chunks: dicts written by orjson, checked against the models -----------------


def assert_event_is_model(event: bytes, model: BaseModel) -> None:
    """``event`` is ``data: <model.model_dump_json()>\\n\\n``, as parsed JSON, with the
    model's field order (``created`` taken from the event: both say "now")."""
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert b"\n" not in event[:-2]
    fast = json.loads(event[6:-2])
    if "created" in fast:
        model = model.model_copy(update={"created": fast["created"]})
    reference = json.loads(model.model_dump_json())
    assert fast == reference
    assert list(fast) == list(reference)
    for fast_choice, choice in zip(fast.get("choices", []), reference.get("choices", [])):
        assert list(fast_choice) == list(choice)


def make_formatter(tokenizer, cls, body: dict, num_prompts: int = 1,
                   echo: list[str] | None = None):
    router = SimpleNamespace(served_model_name="demo", tokenizer=tokenizer,
                             config=RouterConfig("demo", "redis://127.0.0.1:1"))
    request_cls = CompletionRequest if cls is CompletionFormatter else ChatCompletionRequest
    request = request_cls.model_validate({**body, "stream": True})
    args = (router, request, "cmpl-42", [[1, 2, 3]] * num_prompts)
    return request, cls(*args, echo) if cls is CompletionFormatter else cls(*args)


TEXTS = ["Hello", ' "quoted" \\ back\tslash\n', " 世界🙂", "", " end"]
FINISH = [(None, None), (None, None), (None, None), ("stop", "###"), ("stop", 7)]


def steps(tokenizer, with_logprobs: bool) -> list[GenerationChunk]:
    """Chunks of one choice: plain, escapes, non-ASCII, empty, finish with a stop string
    and with a stop token id; logprobs with -inf and alternatives."""
    ids = tokenizer.encode("The cache holds", add_special_tokens=False)
    chunks = []
    for i, (text, (finish, stop_reason)) in enumerate(zip(TEXTS, FINISH)):
        token = ids[i % len(ids)]
        logprobs = [Logprob(token, -float("inf") if i == 2 else -0.25 * i, 1,
                            {t: -0.1 - j for j, t in enumerate(ids)})] if with_logprobs else []
        chunks.append(GenerationChunk(text, [token], logprobs, 3, finish, stop_reason))
    return chunks


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_completion_stream_chunks_are_the_models_json(tokenizer, with_logprobs):
    body = {"prompt": ["a", "b"], "n": 2, "stream_options": {"include_usage": True}}
    if with_logprobs:
        body["logprobs"] = 2
    _, formatter = make_formatter(tokenizer, CompletionFormatter, body, num_prompts=2)
    assert formatter.stream_start() == []

    def decode(token_id: int) -> str:  # the reference: transformers' decode
        return tokenizer.decode([token_id])

    for index in (3, 0):
        offset = 0
        for chunk in steps(tokenizer, with_logprobs):
            logprobs = completion_logprobs(chunk.logprobs, decode, offset) \
                if with_logprobs else None
            expected = CompletionStreamResponse(id="cmpl-42", model="demo", choices=[
                CompletionStreamChoice(index=index, text=chunk.text, logprobs=logprobs,
                                 finish_reason=chunk.finish_reason,
                                 stop_reason=chunk.stop_reason)])
            assert_event_is_model(sse_event(formatter.stream_chunk(index, chunk)), expected)
            offset += len(chunk.text)
    usage = CompletionStreamResponse(id="cmpl-42", model="demo", choices=[],
                                     usage=UsageInfo.of(6, 10, 6))
    assert_event_is_model(sse_event(formatter.stream_usage()), usage)


def test_completion_echo_prefixes_the_first_chunk(tokenizer):
    _, formatter = make_formatter(tokenizer, CompletionFormatter, {"prompt": "Say"},
                                  echo=["Say"])
    first, second = steps(tokenizer, False)[:2]
    assert_event_is_model(sse_event(formatter.stream_chunk(0, first)), CompletionStreamResponse(
        id="cmpl-42", model="demo", choices=[CompletionStreamChoice(index=0, text="SayHello")]))
    assert_event_is_model(sse_event(formatter.stream_chunk(0, second)), CompletionStreamResponse(
        id="cmpl-42", model="demo", choices=[CompletionStreamChoice(index=0, text=second.text)]))
    assert formatter.stream_usage() is None  # no include_usage


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_chat_stream_chunks_are_the_models_json(tokenizer, with_logprobs):
    body = {"messages": USER, "n": 2, "stream_options": {"include_usage": True}}
    if with_logprobs:
        body.update(logprobs=True, top_logprobs=2)
    _, formatter = make_formatter(tokenizer, ChatFormatter, body)
    starts = formatter.stream_start()
    assert len(starts) == 2
    for i, start in enumerate(starts):
        assert_event_is_model(sse_event(start), ChatCompletionStreamResponse(
            id="cmpl-42", model="demo", choices=[ChatCompletionStreamChoice(
                index=i, delta=DeltaMessage(role="assistant", content=""))]))

    def decode(token_id: int) -> str:  # the reference: transformers' decode
        return tokenizer.decode([token_id])

    for chunk in steps(tokenizer, with_logprobs):
        logprobs = chat_logprobs(chunk.logprobs, decode, 2) if with_logprobs else None
        expected = ChatCompletionStreamResponse(id="cmpl-42", model="demo", choices=[
            ChatCompletionStreamChoice(index=1, delta=DeltaMessage(content=chunk.text),
                                       logprobs=logprobs, finish_reason=chunk.finish_reason,
                                       stop_reason=chunk.stop_reason)])
        assert_event_is_model(sse_event(formatter.stream_chunk(1, chunk)), expected)
    usage = ChatCompletionStreamResponse(id="cmpl-42", model="demo", choices=[],
                                         usage=UsageInfo.of(3, 5, 3))
    assert_event_is_model(sse_event(formatter.stream_usage()), usage)


def test_stream_chunks_parse_as_openai_chunk_types(tokenizer):
    _, formatter = make_formatter(tokenizer, ChatFormatter, {"messages": USER})
    chunk = json.loads(sse_event(formatter.stream_chunk(0, steps(tokenizer, False)[4]))[6:])
    parsed = oai_chat.ChatCompletionChunk.model_validate(chunk)
    assert parsed.choices[0].delta.content == " end"
    assert parsed.choices[0].finish_reason == "stop"
    _, formatter = make_formatter(tokenizer, CompletionFormatter, {"prompt": "x"})
    chunk = json.loads(sse_event(formatter.stream_chunk(0, steps(tokenizer, True)[4]))[6:])
    assert oai.Completion.model_validate(chunk).choices[0].text == " end"


def test_error_event_is_the_error_models_json():
    model = error_response(503, "no workers", "model")
    assert_event_is_model(sse_event(model.model_dump()), model)


def test_only_a_decode_worker_prefilling_from_the_start_computes_prompt_logprobs():
    """Once the first token is out (with a leased KV, or resuming after tokens sent), the
    client has the prompt's logprobs: asking again would cost a resumed prefill its
    prefix-cache hit and compute logprobs of tokens that are not the prompt's."""
    from pdserve.proto import common_pb2, prefill_pb2
    from pdserve.router.attempt import LeasedKV, Progress, WorkerCalls
    from pdserve.router.generate_request import GenerateRequest

    calls = WorkerCalls(None, None, None)  # decode_request uses neither
    request = GenerateRequest("r", [3, 4, 5], SamplingParams(max_tokens=4, prompt_logprobs=2))
    fresh = calls.decode_request(request, Progress(num_attempts=1))
    assert fresh.sampling_params.prompt_logprobs == 2 and not fresh.resume_token_ids
    resumed = calls.decode_request(request, Progress(generated=[7], num_attempts=2))
    assert not resumed.sampling_params.HasField("prompt_logprobs")
    assert list(resumed.resume_token_ids) == [7] and resumed.request_id == "r.1"
    reply = prefill_pb2.PrefillResponse(first_token_id=7, kv_handle=common_pb2.KVHandle())
    leased = calls.decode_request(request, Progress(generated=[7], num_attempts=1,
                                                    kv=LeasedKV(None, reply, "d")))
    assert leased.HasField("kv_handle") and leased.first_token_id == 7
    assert not leased.sampling_params.HasField("prompt_logprobs")
    assert request.params.prompt_logprobs == 2  # the request's own params untouched


def test_prompt_logprobs_past_one_replys_bound_are_refused_naming_the_field():
    from pdserve.router.protocol import CompletionRequest, to_sampling_params
    from pdserve.router.protocol.errors import RequestError
    from pdserve.router.protocol.validation import MAX_PROMPT_LOGPROB_ENTRIES

    fits = MAX_PROMPT_LOGPROB_ENTRIES // 21
    params = to_sampling_params(CompletionRequest(prompt="x", prompt_logprobs=20),
                                max_model_len=1 << 20, prompt_len=fits)
    assert params.prompt_logprobs == 20
    with pytest.raises(RequestError, match="at most 131072") as error:
        to_sampling_params(CompletionRequest(prompt="x", prompt_logprobs=20),
                           max_model_len=1 << 20, prompt_len=fits + 1)
    assert error.value.param == "prompt_logprobs"
    echo = CompletionRequest(prompt="x", echo=True, logprobs=3, prompt_logprobs=1)
    assert to_sampling_params(echo, max_model_len=1 << 20, prompt_len=9).prompt_logprobs == 3
    with pytest.raises(RequestError) as error:
        to_sampling_params(echo, max_model_len=1 << 20, prompt_len=MAX_PROMPT_LOGPROB_ENTRIES)
    assert error.value.param == "logprobs"
    assert to_sampling_params(CompletionRequest(prompt="x", logprobs=3), max_model_len=64,
                              prompt_len=9).prompt_logprobs is None


def test_return_token_ids_chunks_are_the_models_json(tokenizer):
    """vLLM's ``return_token_ids``: each chunk's ids, and the prompt's in a completion
    choice's first chunk and in the chat's role chunks; left out when not asked."""
    chunks = steps(tokenizer, False)[:2]
    _, formatter = make_formatter(tokenizer, CompletionFormatter,
                                  {"prompt": "x", "return_token_ids": True})
    for i, chunk in enumerate(chunks):
        assert_event_is_model(sse_event(formatter.stream_chunk(0, chunk)),
                              CompletionStreamResponse(id="cmpl-42", model="demo", choices=[
                                  CompletionStreamChoice(index=0, text=chunk.text,
                                                         token_ids=chunk.token_ids,
                                                         prompt_token_ids=None if i else
                                                         [1, 2, 3])]))
    _, formatter = make_formatter(tokenizer, ChatFormatter,
                                  {"messages": USER, "return_token_ids": True})
    assert_event_is_model(sse_event(formatter.stream_start()[0]), ChatCompletionStreamResponse(
        id="cmpl-42", model="demo", prompt_token_ids=[1, 2, 3], choices=[
            ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant",
                                                                   content=""))]))
    assert_event_is_model(sse_event(formatter.stream_chunk(0, chunks[0])),
                          ChatCompletionStreamResponse(id="cmpl-42", model="demo", choices=[
                              ChatCompletionStreamChoice(
                                  index=0, delta=DeltaMessage(content=chunks[0].text),
                                  token_ids=chunks[0].token_ids)]))
    _, plain = make_formatter(tokenizer, ChatFormatter, {"messages": USER})
    assert "prompt_token_ids" not in plain.stream_start()[0]
    assert "token_ids" not in plain.stream_chunk(0, chunks[0])["choices"][0]


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_vllm_fields_at_their_default_are_served_and_refused_otherwise(model):
    """Clients that send every vLLM field send beam search off and the like: served, as
    their defaults are what pdserve does; another value is refused naming the field."""
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": USER}
    defaults = {"use_beam_search": False, "length_penalty": 1,
                "spaces_between_special_tokens": True}
    assert model.model_validate(base | defaults).n == 1
    for name, value in [("use_beam_search", True), ("use_beam_search", 0),
                        ("length_penalty", 1.5), ("spaces_between_special_tokens", False)]:
        with pytest.raises(RequestError) as error:
            model.model_validate(base | defaults | {name: value})
        assert error.value.param == name and "only its default" in error.value.message
