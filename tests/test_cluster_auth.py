"""Cluster authentication (issue 13), attacked as an outsider and an insider would, on real
processes: plain-process prefill and decode workers (``python -m pdserve.*_worker``), a
private Redis with a password, and the router in this process.

- Every worker RPC without the cluster's credentials (none, another secret's, an expired
  token, a token for another method) gets UNAUTHENTICATED at once and does nothing.
- Forged registry records (unsigned, signed with another secret, a real signature under
  another worker id) get no traffic: the attacker's decode worker sees no call.
- ``SendKV`` abuse (unknown request ids toward a dead address, a live lease toward
  another decode worker) is refused at once and does not delay real requests.
- With certificates, the workers and router talk mutual TLS.

The parts that need no worker (the private Redis's password, the nonce cache) are
``test_cluster_credentials.py``'s.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import ipaddress
import json
import time

import grpc
import pytest
import redis
from disagg_client import (
    TEST_AUTH,
    TEST_SECRET,
    decode_stub,
    health,
    lease_for,
    prefill_stub,
    start_worker_process,
)

from pdserve.cluster.auth import TOKEN_WINDOW_S, ClusterAuth, ClusterTLS
from pdserve.cluster.registry import WORKERS_KEY, WorkerRecord, heartbeat_key, record_key
from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.demo_model import make_demo_model
from pdserve.engine.tokenizer import encode_prompt, load_tokenizer
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.generate_request import GenerateRequest
from pdserve.router.model_service import ModelService

MAX_MODEL_LEN = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FAST_S = 1.0  # "at once": a refused call ends within this, far below any timeout


def worker_args(model: str, redis_url: str, *extra: str) -> list[str]:
    return ["--model", model, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", "128", "--redis-url", redis_url, "--num-threads", "1",
            "--kv-transfer-timeout-s", "30", "--log-level", "WARNING", *extra]


class Cluster:
    """A prefill and a decode worker as plain processes, on a Redis with a password."""

    def __init__(self, model: str, redis_server: RedisServer, tmp_path, *extra: str) -> None:
        self.model = model
        self.redis = redis_server
        self.procs, self.infos = [], {}
        try:
            for role in ("prefill", "decode"):
                proc, info = start_worker_process(
                    role, worker_args(model, redis_server.url, *extra),
                    tmp_path / f"{role}.json", timeout_s=240)
                self.procs.append(proc)
                self.infos[role] = info
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_demo_model(tmp_path_factory.mktemp("auth") / "demo"))


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    with RedisServer() as redis_server:
        cluster = Cluster(model, redis_server, tmp_path_factory.mktemp("workers"))
        try:
            yield cluster
        finally:
            cluster.close()


@pytest.fixture(scope="module")
def prompts_and_expected(model):
    tokenizer = load_tokenizer(model)
    prompts = [encode_prompt(tokenizer, f"Request {i} asks about the weather in town {i}")
               for i in range(16)]
    oracle = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, load_progress=False)
    return prompts, [o.outputs[0].token_ids for o in oracle.generate(prompts, GREEDY)]


def router_for(cluster: Cluster, auth: ClusterAuth | None = TEST_AUTH, **kwargs) -> ModelService:
    return ModelService(RouterConfig(cluster.model, cluster.redis.url, max_model_len=MAX_MODEL_LEN,
                               local_prefill_threshold=0, disaggregation="always",
                               auth=auth, **kwargs))


async def run_request(router: ModelService, request_id: str, prompt: list[int]) -> list[int]:
    tokens = []
    async for chunk in router.generate(GenerateRequest(request_id, prompt, GREEDY)):
        tokens += chunk.token_ids
    return tokens


async def settled(stub, timeout_s: float = 5.0) -> common_pb2.HealthResponse:
    """The worker's Health once its ownership audit (taken every 0.5 s) shows no lease
    and every block free, or the last one after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = await health(stub)
        clean = state.num_kv_leases == 0 and state.num_free_blocks == state.num_total_blocks
        if clean or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.1)


def test_worker_rpcs_without_the_cluster_credentials_are_refused_at_once(cluster):
    """Every RPC of both workers, with no credentials, another cluster's, an expired
    token, one minted for another method, a malformed one or a valid version-1 token (the
    old format, bound to no request): UNAUTHENTICATED at once, nothing done."""
    other = ClusterAuth.generate()
    wire_params = sampling_params_to_proto(GREEDY)
    calls = {
        "prefill": {
            "Prefill": prefill_pb2.PrefillRequest(
                request_id="attack", prompt_token_ids=list(range(1, 120)),
                sampling_params=wire_params, decode_worker_id="x",
                decode_kv_address="127.0.0.1:1"),
            "SendKV": prefill_pb2.SendKVRequest(request_id="attack", decode_worker_id="x",
                                                decode_kv_address="127.0.0.1:1",
                                                block_indices=[0]),
            "GrantKV": prefill_pb2.GrantKVRequest(request_id="attack"),
            "Release": prefill_pb2.ReleaseRequest(request_id="attack"),
            "Health": common_pb2.HealthRequest()},
        "decode": {
            "Decode": decode_pb2.DecodeRequest(request_id="attack",
                                               prompt_token_ids=list(range(1, 120)),
                                               sampling_params=wire_params),
            "DecodeSession": decode_pb2.DecodeSessionRequest(decode=decode_pb2.DecodeRequest(
                request_id="attack", prompt_token_ids=list(range(1, 120)),
                sampling_params=wire_params)),
            "Abort": decode_pb2.AbortRequest(request_id="attack"),
            "Health": common_pb2.HealthRequest()},
    }
    service = {"prefill": "/pdserve.v1.PrefillWorker/", "decode": "/pdserve.v1.DecodeWorker/"}

    def forged(role: str, rpc: str, message) -> dict:
        method = service[role] + rpc
        body = None if rpc == "DecodeSession" else message
        when = str(int(time.time()))
        v1_mac = hmac.new(hmac.new(TEST_SECRET.encode(), b"pdserve rpc v1", "sha256").digest(),
                          f"{method}\n{when}".encode(), "sha256").hexdigest()
        return {"none": None, "another secret": other.rpc_metadata(method, body),
                "expired": TEST_AUTH.rpc_metadata(method, body, now=time.time() - 3600),
                "another method": TEST_AUTH.rpc_metadata(service[role] + "Health"
                                                         if rpc != "Health" else
                                                         service[role] + "Abort", body),
                "garbage": (("x-pdserve-cluster-auth", "v2:not-a-time:00"),),
                "version 1": (("x-pdserve-cluster-auth", f"v1:{when}:{v1_mac}"),)}

    async def attack(stub, rpc: str, message, metadata):
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if rpc == "DecodeSession":
                # NOTE: the worker refuses the stream before reading a request; writing one
                # races that refusal, and grpc then reports its failed write (INTERNAL)
                # in place of the worker's status
                call = stub.DecodeSession(timeout=30, metadata=metadata)
            else:
                call = getattr(stub, rpc)(message, timeout=30, metadata=metadata)
            if rpc in ("Decode", "DecodeSession"):
                async for _ in call:
                    pass
            else:
                await call
        return err.value.code(), time.monotonic() - started

    async def main():
        outcomes = {}
        stubs = {role: (prefill_stub if role == "prefill" else decode_stub)(
            cluster.infos[role]["grpc_address"], auth=None) for role in calls}
        for role, rpcs in calls.items():
            for rpc, message in rpcs.items():
                for how, metadata in forged(role, rpc, message).items():
                    outcomes[role, rpc, how] = await attack(stubs[role], rpc, message, metadata)
        states = [await health(prefill_stub(cluster.infos["prefill"]["grpc_address"])),
                  await health(decode_stub(cluster.infos["decode"]["grpc_address"]))]
        return outcomes, states

    outcomes, states = asyncio.run(main())
    assert len(outcomes) == 9 * 6
    for key, (code, elapsed) in outcomes.items():
        assert code == grpc.StatusCode.UNAUTHENTICATED, key
        assert elapsed < FAST_S, key
    for state in states:  # nothing was prefilled, decoded or leased
        assert state.num_free_blocks == state.num_total_blocks and state.num_kv_leases == 0


def test_forged_registry_records_get_no_traffic(cluster, prompts_and_expected):
    """An attacker who can write to Redis registers decode workers of its own, pointing
    at a decode service it runs: the router verifies each record's signature and sends
    that service nothing; every request is served, right, by the real workers."""
    prompts, expected = prompts_and_expected
    seen = []

    class FakeDecodeWorker(decode_pb2_grpc.DecodeWorkerServicer):
        async def Health(self, request, context):
            seen.append("Health")
            return common_pb2.HealthResponse(worker_id="evil", role="decode", status="ok",
                                             num_free_blocks=10**6, num_total_blocks=10**6)

        async def Decode(self, request, context):
            seen.append(list(request.prompt_token_ids))
            yield decode_pb2.DecodeResponse(token_ids=[1] * 8, finish_reason="length")

    async def main():
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(FakeDecodeWorker(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = redis.Redis.from_url(cluster.redis.url)
        real_id = cluster.infos["decode"]["worker_id"]
        forged = {}
        plain = WorkerRecord.new("evil-unsigned", "decode", f"127.0.0.1:{port}",
                                 "127.0.0.1:1", cluster.model)
        forged[plain.worker_id] = plain.to_json()
        other = ClusterAuth.generate()
        signed = WorkerRecord.new("evil-other-secret", "decode", f"127.0.0.1:{port}",
                                  "127.0.0.1:1", cluster.model)
        forged[signed.worker_id] = json.dumps(
            {"record": signed.to_json(), "signature": other.sign_record(signed.to_json())})
        forged["evil-copied"] = client.get(record_key(real_id))  # a real signature
        for worker_id, value in forged.items():
            client.set(record_key(worker_id), value)
            client.set(heartbeat_key(worker_id), 1, px=60_000)
            client.sadd(WORKERS_KEY, worker_id)
        router = router_for(cluster)
        await router.start()
        try:
            results = await asyncio.gather(*(run_request(router, f"forged-{i}", prompts[i])
                                              for i in range(10)))
            await asyncio.sleep(1.5)  # a registry refresh and Health polls go by
            live = {w.worker_id for role in ("prefill", "decode")
                    for w in router.pool.live(role)}
            rejected = router.metrics.registry_rejected_records._value.get()
        finally:
            await router.stop()
            for worker_id in forged:
                client.delete(record_key(worker_id), heartbeat_key(worker_id))
                client.srem(WORKERS_KEY, worker_id)
            client.close()
            await server.stop(0)
        return results, live, rejected

    results, live, rejected = asyncio.run(main())
    assert results == expected[:10]
    assert seen == []  # not even a Health call reached the attacker
    assert live == {cluster.infos["prefill"]["worker_id"], cluster.infos["decode"]["worker_id"]}
    assert rejected == 3


def test_send_kv_abuse_is_refused_at_once_and_real_requests_go_on(cluster,
                                                                   prompts_and_expected):
    """SendKV for unknown request ids toward a dead address (127.0.0.1:1), with and
    without credentials, 8 at a time in a loop, while 16 real requests run: each abusive
    call ends at once, no request fails or changes. A live lease cannot be sent to another
    decode worker than the one it names, and stays usable by that one."""
    prompts, expected = prompts_and_expected
    prefill_address = cluster.infos["prefill"]["grpc_address"]

    async def abuse(stub, latencies: list, codes: set, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            started = time.monotonic()
            try:
                await stub.SendKV(prefill_pb2.SendKVRequest(
                    request_id=f"unknown-{n}", decode_worker_id="evil",
                    decode_kv_address="127.0.0.1:1", block_indices=[0, 1, 2]), timeout=60)
            except grpc.aio.AioRpcError as exc:
                codes.add(exc.code())
            latencies.append(time.monotonic() - started)

    async def main():
        insider, outsider = prefill_stub(prefill_address), prefill_stub(prefill_address,
                                                                         auth=None)
        decode = decode_stub(cluster.infos["decode"]["grpc_address"])
        # a live lease, named for the real decode worker, asked toward another one
        first = await insider.Prefill(prefill_pb2.PrefillRequest(
            request_id="leased", prompt_token_ids=prompts[0],
            sampling_params=sampling_params_to_proto(GREEDY), **await lease_for(decode)),
            timeout=30)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as redirected:
            await insider.SendKV(prefill_pb2.SendKVRequest(
                request_id="leased", decode_worker_id="evil", decode_kv_address="127.0.0.1:1",
                block_indices=[0]), timeout=30)
        redirect_s = time.monotonic() - started
        tokens, transferred = [], 0  # the named decode worker still pulls it
        async for reply in decode.Decode(decode_pb2.DecodeRequest(
                request_id="leased", prompt_token_ids=prompts[0],
                first_token_id=first.first_token_id,
                sampling_params=sampling_params_to_proto(GREEDY), kv_handle=first.kv_handle),
                timeout=30):
            tokens += reply.token_ids
            transferred += reply.num_transferred_blocks
        pulled = [first.first_token_id] + tokens

        router = router_for(cluster)
        await router.start()
        stop, latencies, codes = asyncio.Event(), [], set()
        abusers = [asyncio.ensure_future(abuse(stub, latencies, codes, stop))
                   for stub in [insider, outsider] * 4]
        try:
            results = await asyncio.gather(*(run_request(router, f"real-{i}", prompts[i])
                                              for i in range(16)))
        finally:
            stop.set()
            await asyncio.gather(*abusers)
            await router.stop()
        return (redirected.value.code(), redirect_s, transferred, pulled, results,
                latencies, codes, await settled(insider))

    code, redirect_s, transferred, pulled, results, latencies, codes, after = \
        asyncio.run(main())
    assert code == grpc.StatusCode.PERMISSION_DENIED and redirect_s < FAST_S
    assert transferred > 0 and pulled == expected[0]
    assert results == expected
    assert codes == {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED}
    assert len(latencies) >= 16 and max(latencies) < FAST_S
    assert after.num_kv_leases == 0 and after.num_free_blocks == after.num_total_blocks


def make_certificates(directory) -> dict[str, str]:
    """A CA, and one member certificate it signs for 127.0.0.1 / localhost (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, member_key = ec.generate_private_key(ec.SECP256R1()), \
        ec.generate_private_key(ec.SECP256R1())
    ca = certificate("pdserve test CA", ca_key, "pdserve test CA", ca_key, ca=True)
    member = certificate("pdserve member", member_key, "pdserve test CA", ca_key, ca=False)
    files = {"ca": directory / "ca.pem", "cert": directory / "member.pem",
             "key": directory / "member.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(member.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(member_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    files["key"].chmod(0o600)
    return {name: str(path) for name, path in files.items()}


def test_mutual_tls_between_router_and_workers(model, prompts_and_expected, tmp_path):
    """Workers started with --cluster-ssl-*: the router (same CA, a client certificate)
    serves right tokens, the KV moving on the decode worker's SendKV over TLS too; a
    plain-TCP client, and a TLS client without a certificate, get nowhere."""
    prompts, expected = prompts_and_expected
    files = make_certificates(tmp_path)
    tls = ClusterTLS.from_files(files["cert"], files["key"], files["ca"])
    auth = ClusterAuth(TEST_SECRET.encode(), tls)
    with RedisServer() as redis_server:
        cluster = Cluster(model, redis_server, tmp_path, "--cluster-ssl-certfile", files["cert"],
                          "--cluster-ssl-keyfile", files["key"], "--cluster-ssl-ca-certs",
                          files["ca"])
        try:
            async def main():
                router = router_for(cluster, auth=auth)
                await router.start()
                try:
                    results = await asyncio.gather(*(run_request(router, f"tls-{i}", prompts[i])
                                                      for i in range(4)))
                finally:
                    await router.stop()
                address = cluster.infos["prefill"]["grpc_address"]
                failures = []
                for channel in (grpc.aio.insecure_channel(address),
                                grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(
                                    root_certificates=tls.root_certificates))):
                    async with channel:
                        stub = prefill_pb2_grpc.PrefillWorkerStub(channel)
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await stub.Health(common_pb2.HealthRequest(), timeout=5,
                                              metadata=auth.rpc_metadata(
                                                  "/pdserve.v1.PrefillWorker/Health",
                                                  common_pb2.HealthRequest()))
                        failures.append(err.value.code())
                return results, failures

            results, failures = asyncio.run(main())
        finally:
            cluster.close()
    assert results == expected[:4]
    assert failures == [grpc.StatusCode.UNAVAILABLE] * 2


def test_grant_kv_moves_a_lease_to_another_decode_worker(cluster, prompts_and_expected):
    """The router's retry on another decode worker: a lease named for decode worker A
    cannot be sent to B (PERMISSION_DENIED, and the lease stands) until GrantKV names B;
    then B pulls it and decodes the right tokens. GrantKV of an unknown lease is
    refused."""
    prompts, expected = prompts_and_expected
    params = sampling_params_to_proto(GREEDY)

    async def decode_all(stub, request_id, first):
        tokens = []
        async for reply in stub.Decode(decode_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompts[1],
                first_token_id=first.first_token_id, sampling_params=params,
                kv_handle=first.kv_handle), timeout=30):
            tokens += reply.token_ids
        return [first.first_token_id] + tokens

    async def main():
        prefill = prefill_stub(cluster.infos["prefill"]["grpc_address"])
        decode = decode_stub(cluster.infos["decode"]["grpc_address"])
        real = await lease_for(decode)
        first = await prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="moved", prompt_token_ids=prompts[1], sampling_params=params,
            decode_worker_id="decode-a", decode_kv_address="127.0.0.1:1"), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await prefill.SendKV(prefill_pb2.SendKVRequest(
                request_id="moved", decode_worker_id=real["decode_worker_id"],
                decode_kv_address=real["decode_kv_address"], block_indices=[0]), timeout=10)
        granted = await prefill.GrantKV(prefill_pb2.GrantKVRequest(
            request_id="moved", **real), timeout=10)
        tokens = await decode_all(decode, "moved", first)
        unknown = await prefill.GrantKV(prefill_pb2.GrantKVRequest(
            request_id="no-such-lease", **real), timeout=10)
        return refused.value, granted.granted, tokens, unknown.granted, await settled(prefill)

    refused, granted, tokens, unknown, after = asyncio.run(main())
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "another decode worker" in refused.details()
    assert granted and tokens == expected[1] and not unknown
    assert after.num_kv_leases == 0 and after.num_free_blocks == after.num_total_blocks


async def call(stub, rpc: str, message, metadata):
    """The status code of one unary call of ``rpc`` (OK when it succeeds)."""
    try:
        await getattr(stub, rpc)(message, timeout=10, metadata=metadata)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_token_is_bound_to_its_request_and_used_once(cluster):
    """A sniffed token is worth nothing: replayed with the same body or another it is
    refused; a token minted for one body does not pass with another (and stays usable
    with its own, which the sniffer cannot change); SendKV and Abort, the calls the issue
    names, included."""
    decode_address = cluster.infos["decode"]["grpc_address"]
    prefill_address = cluster.infos["prefill"]["grpc_address"]
    abort_method = "/pdserve.v1.DecodeWorker/Abort"
    send_kv_method = "/pdserve.v1.PrefillWorker/SendKV"

    async def main():
        decode, prefill = decode_stub(decode_address, auth=None), \
            prefill_stub(prefill_address, auth=None)
        mine = decode_pb2.AbortRequest(request_id="mine")
        theirs = decode_pb2.AbortRequest(request_id="theirs")
        token = TEST_AUTH.rpc_metadata(abort_method, mine)
        outcomes = {"valid": await call(decode, "Abort", mine, token),
                    "replayed, same body": await call(decode, "Abort", mine, token),
                    "replayed, other body": await call(decode, "Abort", theirs, token)}
        fresh = TEST_AUTH.rpc_metadata(abort_method, mine)
        outcomes["fresh, other body"] = await call(decode, "Abort", theirs, fresh)
        outcomes["fresh, own body after"] = await call(decode, "Abort", mine, fresh)
        outcomes["bytes, same message"] = await call(
            decode, "Abort", mine, TEST_AUTH.rpc_metadata(abort_method,
                                                          mine.SerializeToString()))
        send = prefill_pb2.SendKVRequest(request_id="unknown", decode_worker_id="x",
                                         decode_kv_address="127.0.0.1:1", block_indices=[0])
        redirected = prefill_pb2.SendKVRequest(
            request_id="unknown", decode_worker_id="evil", decode_kv_address="10.0.0.1:1",
            block_indices=[0])
        token = TEST_AUTH.rpc_metadata(send_kv_method, send)
        outcomes["SendKV valid"] = await call(prefill, "SendKV", send, token)
        outcomes["SendKV replayed, same body"] = await call(prefill, "SendKV", send, token)
        outcomes["SendKV replayed, other body"] = await call(prefill, "SendKV", redirected,
                                                             token)
        return outcomes

    outcomes = asyncio.run(main())
    assert outcomes == {
        "valid": grpc.StatusCode.OK,
        "replayed, same body": grpc.StatusCode.UNAUTHENTICATED,
        "replayed, other body": grpc.StatusCode.UNAUTHENTICATED,
        "fresh, other body": grpc.StatusCode.UNAUTHENTICATED,
        "fresh, own body after": grpc.StatusCode.OK,
        "bytes, same message": grpc.StatusCode.OK,
        "SendKV valid": grpc.StatusCode.NOT_FOUND,  # authenticated: the worker looked
        "SendKV replayed, same body": grpc.StatusCode.UNAUTHENTICATED,
        "SendKV replayed, other body": grpc.StatusCode.UNAUTHENTICATED}


def test_a_token_is_accepted_only_within_the_window(cluster):
    """Tokens dated just inside ``TOKEN_WINDOW_S`` either side of the worker's clock
    pass; just outside, either side, they are refused."""
    prefill = cluster.infos["prefill"]["grpc_address"]
    method = "/pdserve.v1.PrefillWorker/Health"
    request = common_pb2.HealthRequest()
    margin_s = 5  # the call's own latency, far below it
    dates = {"inside, past": -(TOKEN_WINDOW_S - margin_s),
             "inside, future": TOKEN_WINDOW_S - margin_s,
             "outside, past": -(TOKEN_WINDOW_S + margin_s),
             "outside, future": TOKEN_WINDOW_S + margin_s}

    async def main():
        stub = prefill_stub(prefill, auth=None)
        return {how: await call(stub, "Health", request, TEST_AUTH.rpc_metadata(
                    method, request, now=time.time() + offset_s))
                for how, offset_s in dates.items()}

    assert asyncio.run(main()) == {
        "inside, past": grpc.StatusCode.OK, "inside, future": grpc.StatusCode.OK,
        "outside, past": grpc.StatusCode.UNAUTHENTICATED,
        "outside, future": grpc.StatusCode.UNAUTHENTICATED}


def test_a_stream_token_binds_the_method_and_is_used_once(cluster):
    """DecodeSession (a stream of requests) takes a token bound to the method and a
    nonce: it opens once; replayed, or a token bound to one request message, is refused
    before the stream is read; and a stream token does not pass on a unary method."""
    address = cluster.infos["decode"]["grpc_address"]
    session_method = "/pdserve.v1.DecodeWorker/DecodeSession"

    async def open_session(stub, metadata):
        call = stub.DecodeSession(timeout=10, metadata=metadata)
        try:
            # NOTE: an accepted stream waits for requests; ending ours ends it cleanly
            await call.done_writing()
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def main():
        stub = decode_stub(address, auth=None)
        token = TEST_AUTH.rpc_metadata(session_method, None)
        request = decode_pb2.AbortRequest(request_id="x")
        return {
            "valid": await open_session(stub, token),
            "replayed": await open_session(stub, token),
            "bound to a message": await open_session(stub, TEST_AUTH.rpc_metadata(
                session_method, decode_pb2.DecodeSessionRequest())),
            "stream token on Abort": await call(stub, "Abort", request, TEST_AUTH.rpc_metadata(
                "/pdserve.v1.DecodeWorker/Abort", None))}

    assert asyncio.run(main()) == {
        "valid": grpc.StatusCode.OK, "replayed": grpc.StatusCode.UNAUTHENTICATED,
        "bound to a message": grpc.StatusCode.UNAUTHENTICATED,
        "stream token on Abort": grpc.StatusCode.UNAUTHENTICATED}
