"""A minimal gRPC client of the two worker services, for the integration tests: what the
router does for one request (Prefill, then Decode with the KV handle).

Every call carries the credentials of ``TEST_AUTH``, the cluster secret the tests' workers
share (plain-process workers get it from ``PDSERVE_CLUSTER_SECRET``)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc

from pdserve.cluster.auth import SECRET_ENV, ClusterAuth
from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str
    num_cached_tokens_prefill: int
    num_cached_tokens_decode: int = 0
    num_transferred_blocks: int = 0
    num_transferred_bytes: int = 0
    logprobs: list = field(default_factory=list)


TEST_SECRET = secrets.token_hex(32)
TEST_AUTH = ClusterAuth(TEST_SECRET.encode())


class _Credentials:
    """Adds ``auth``'s cluster credentials to every call of a channel (the router and the
    workers pass them per call; a test client does it once here). NOTE: grpc.aio files an
    interceptor under its first interceptor type only, hence one class per call type."""

    def __init__(self, auth: ClusterAuth) -> None:
        self.auth = auth

    def _with_credentials(self, details: grpc.aio.ClientCallDetails,
                          request) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in self.auth.rpc_metadata(method, request):
            metadata.add(key, value)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _UnaryUnaryCredentials(_Credentials, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_credentials(client_call_details, request),
                                  request)


class _UnaryStreamCredentials(_Credentials, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_credentials(client_call_details, request),
                                  request)


def channel(address: str, auth: ClusterAuth | None = TEST_AUTH) -> grpc.aio.Channel:
    """A channel to a worker whose calls carry ``auth``'s credentials (None: none)."""
    interceptors = [_UnaryUnaryCredentials(auth), _UnaryStreamCredentials(auth)] \
        if auth is not None else None
    return grpc.aio.insecure_channel(address, interceptors=interceptors)


def prefill_stub(address: str, auth: ClusterAuth | None = TEST_AUTH
                 ) -> prefill_pb2_grpc.PrefillWorkerStub:
    return prefill_pb2_grpc.PrefillWorkerStub(channel(address, auth))


def decode_stub(address: str, auth: ClusterAuth | None = TEST_AUTH
                ) -> decode_pb2_grpc.DecodeWorkerStub:
    return decode_pb2_grpc.DecodeWorkerStub(channel(address, auth))


async def health(stub) -> common_pb2.HealthResponse:
    return await stub.Health(common_pb2.HealthRequest(), timeout=10)


async def lease_for(decode) -> dict:
    """``PrefillRequest`` fields naming the decode worker behind the stub ``decode`` as the
    one its KV lease is for."""
    state = await health(decode)
    return {"decode_worker_id": state.worker_id, "decode_kv_address": state.kv_address}


async def generate(prefill, decode, request_id: str, prompt: list[int], params,
                   timeout_s: float = 60) -> Result:
    wire_params = sampling_params_to_proto(params)
    first = await prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=wire_params,
        **await lease_for(decode)), timeout=timeout_s)
    result = Result([first.first_token_id], first.finish_reason, first.num_cached_tokens)
    if first.finish_reason:
        return result
    request = decode_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, first_token_id=first.first_token_id,
        sampling_params=wire_params, kv_handle=first.kv_handle)
    async for message in decode.Decode(request, timeout=timeout_s):
        result.tokens += list(message.token_ids)
        result.num_cached_tokens_decode = max(result.num_cached_tokens_decode,
                                              message.num_cached_tokens)
        result.num_transferred_blocks += message.num_transferred_blocks
        result.num_transferred_bytes += message.num_transferred_bytes
        if message.finish_reason:
            result.finish_reason = message.finish_reason
    return result


def start_worker_process(role: str, args: list[str], ready_file, timeout_s: float = 120,
                         secret_in_env: bool = True, cpus: set[int] | None = None
                         ) -> tuple[subprocess.Popen, dict]:
    """``python -m pdserve.<role>_worker *args`` as a plain process of the tests' cluster
    (``TEST_SECRET``); waits (``timeout_s`` at most) for its ready file and returns the
    process and its addresses. ``secret_in_env=False``: ``args`` must say where the
    secret is. ``cpus``: the CPUs the process may run on (all when None)."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    if secret_in_env:
        env[SECRET_ENV] = TEST_SECRET
    proc = subprocess.Popen([sys.executable, "-m", f"pdserve.{role}_worker", *args,
                             "--ready-file", str(ready_file)], stdout=subprocess.DEVNULL,
                            env=env)
    if cpus is not None:  # before the interpreter starts a thread: they all inherit it
        os.sched_setaffinity(proc.pid, cpus)
    deadline = time.monotonic() + timeout_s
    while not ready_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{role} worker did not start (exit code {proc.poll()})")
        time.sleep(0.1)
    return proc, json.loads(ready_file.read_text())
