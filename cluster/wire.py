"""Conversions between the engine's dataclasses and the ``pdserve.v1`` protobuf messages,
shared by the workers and the router (one place, so both sides read the wire alike)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.generation_config import SAMPLING_DEFAULT_FIELDS, GenerationDefaults
from pdserve.engine.request import Logprob
from pdserve.engine.sampling_params import SamplingParamError, SamplingParams
from pdserve.engine.structured_output import StructuredOutputSpec
from pdserve.proto import common_pb2


@dataclass(slots=True)
class KVHandle:
    """Where a prefilled prompt's KV lives: docs/architecture.md's KV handle, self-contained (a
    decode worker pulls with it and nothing else: no registry lookup). Times in seconds;
    addresses ``host:port``."""

    prefill_worker_id: str
    kv_address: str
    request_id: str
    num_tokens: int
    block_hashes: list[bytes]
    block_size: int
    lease_expiry_unix_s: float
    prefill_grpc_address: str = ""


_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
             "max_tokens", "logprobs", "prompt_logprobs")
_PLAIN = ("presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos")


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(stop_token_ids=params.stop_token_ids,
                                    logit_bias=params.logit_bias or {})
    for name in _PLAIN:
        setattr(msg, name, getattr(params, name))
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
    if params.allowed_token_ids:
        msg.allowed_token_ids.extend(params.allowed_token_ids)
    for sequence in params.bad_words_token_ids or ():
        msg.bad_words.add(token_ids=sequence)
    return msg


def structured_output_to_proto(spec: StructuredOutputSpec) -> common_pb2.StructuredOutput:
    if spec.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if spec.kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=spec.value))
    return common_pb2.StructuredOutput(**{spec.kind: spec.value})


def structured_output_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutputSpec:
    """Raises ValueError (``structured_output: ...``): no kind set, ``json_object`` false,
    or a value ``StructuredOutputSpec`` refuses."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        raise ValueError("structured_output: set one of json, json_object (true), regex, "
                         "choice, grammar")
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    if kind == "choice":
        return StructuredOutputSpec("choice", tuple(msg.choice.choices))
    return StructuredOutputSpec(kind, getattr(msg, kind))


def sampling_params_from_proto(msg: common_pb2.SamplingParams, *,
                               vocab_size: int | None = None,
                               defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The engine's ``SamplingParams`` of ``msg``. With ``vocab_size`` (the router's gRPC
    API passes it), ``stop_token_ids``, ``logit_bias``'s, ``allowed_token_ids`` and
    ``bad_words``' token ids must be in ``[0, vocab_size)``; protobuf itself
    bounds the int32 and int64 fields. ``defaults`` (the router's: the model's generation
    config) fill the sampling fields ``msg`` leaves absent, as the HTTP API does; the
    router sends workers every field set.

    Raises:
        SamplingParamError: an out-of-range value (a ValueError), its ``param`` the
            field's name, which also starts the message (``top_k=-5 is invalid: ...``,
            ``stop_token_ids: token id ...``, ``structured_output: ...``). Whether a
            structured output compiles is not checked here
            (``engine.structured_output.check_spec``).
    """
    bad = [t for t in msg.stop_token_ids if vocab_size is not None and not 0 <= t < vocab_size]
    if bad:
        raise SamplingParamError(f"stop_token_ids: token id {bad[0]} is out of the "
                                 f"vocabulary (size {vocab_size})", "stop_token_ids")
    bad_words = [list(s.token_ids) for s in msg.bad_words]
    for name, ids in (("logit_bias", msg.logit_bias),
                      ("allowed_token_ids", msg.allowed_token_ids),
                      ("bad_words", [t for s in bad_words for t in s])):
        bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
        if bad:
            raise SamplingParamError(f"{name}: token id {bad[0]} is out of the "
                                     f"vocabulary (size {vocab_size})", name)
    kwargs = {name: getattr(msg, name) for name in _PLAIN}
    kwargs.update({name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)})
    if defaults is not None:
        kwargs.update(defaults.sampling_kwargs(**{
            name: kwargs.get(name) for name in SAMPLING_DEFAULT_FIELDS}))
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = None  # absent: up to max_model_len
    if msg.HasField("structured_output"):
        try:
            kwargs["structured_output"] = structured_output_from_proto(msg.structured_output)
        except ValueError as exc:  # "structured_output: ..."
            raise SamplingParamError(str(exc), "structured_output") from exc
    return SamplingParams(stop_token_ids=list(msg.stop_token_ids),
                          logit_bias=dict(msg.logit_bias) or None,
                          allowed_token_ids=list(msg.allowed_token_ids) or None,
                          bad_words_token_ids=bad_words or None, **kwargs)


def logprob_to_proto(lp: Logprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()])


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> Logprob:
    return Logprob(msg.token_id, msg.logprob, msg.rank, {t.token_id: t.logprob for t in msg.top})


def prompt_logprobs_to_proto(logprobs: list[Logprob | None]) -> list[common_pb2.TokenLogprob]:
    """The engine's ``prompt_logprobs`` (one per prompt token, the first None: nothing
    predicts it) as the wire's repeated ``TokenLogprob``, prompt tokens 1.. only."""
    return [logprob_to_proto(lp) for lp in logprobs[1:]]


def prompt_logprobs_from_proto(messages) -> list[Logprob | None]:
    """``prompt_logprobs_to_proto``'s inverse: None for the first prompt token, then one
    ``Logprob`` a message."""
    return [None, *(logprob_from_proto(m) for m in messages)]


def kv_handle_to_proto(handle: KVHandle) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        prefill_worker_id=handle.prefill_worker_id, kv_address=handle.kv_address,
        request_id=handle.request_id, num_tokens=handle.num_tokens,
        block_hashes=handle.block_hashes, block_size=handle.block_size,
        lease_expiry_unix_s=handle.lease_expiry_unix_s,
        prefill_grpc_address=handle.prefill_grpc_address)


def kv_handle_from_proto(msg: common_pb2.KVHandle) -> KVHandle:
    return KVHandle(msg.prefill_worker_id, msg.kv_address, msg.request_id, msg.num_tokens,
                    list(msg.block_hashes), msg.block_size, msg.lease_expiry_unix_s,
                    msg.prefill_grpc_address)
