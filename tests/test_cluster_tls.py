"""Mutual TLS with a certificate per member (issue 29), on a real ``pdserve serve
--cluster-tls auto`` (Ray workers): the run makes its own cluster CA, the router and every
worker get a key and certificate of their own naming their address, and a client without
a certificate from that CA gets nowhere.
"""

from __future__ import annotations

import asyncio
import ipaddress
import pickle
import re
import socket
import ssl
import tempfile
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtensionOID
from serve_process import serve_process

from pdserve.cluster.auth import ClusterTLS
from pdserve.cluster.certificates import ClusterCA
from pdserve.proto import common_pb2, prefill_pb2_grpc

READY = re.compile(r"(prefill|decode) worker \d+/\d+ ready \(gRPC ([0-9.]+):(\d+),")


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    with serve_process(tmp_path_factory, [
            "--prefill-workers", "1", "--decode-workers", "1", "--disaggregation", "always",
            "--cluster-tls", "auto"]) as serve:
        yield serve


def workers(serve) -> dict[str, tuple[str, int]]:
    """Each worker's gRPC address, as ``pdserve serve`` printed it."""
    return {role: (host, int(port))
            for role, host, port in READY.findall(serve.log.read_text())}


def server_certificate(host: str, port: int) -> x509.Certificate:
    """The certificate a worker presents, read by a TLS 1.3 client without a certificate
    of its own: the server sends its certificate before it sees the client's (and then
    refuses the connection)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=10) as raw, \
            context.wrap_socket(raw) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


def test_requests_are_served_over_mutual_tls(serve):
    """The router reaches both workers (which take TLS only) with its own certificate:
    a disaggregated completion comes back whole."""
    body = {"model": "demo", "prompt": "The weather in town is", "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True}
    reply = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    assert "a certificate per member (--cluster-tls auto)" in serve.log.read_text()


def test_each_member_has_its_own_certificate_naming_its_address(serve):
    """The prefill and decode workers present different certificates (keys, serials,
    names), both from the run's CA, each with the address it advertises as an IP SAN."""
    addresses = workers(serve)
    assert set(addresses) == {"prefill", "decode"}
    certificates = {role: server_certificate(*address) for role, address in addresses.items()}
    prefill, decode = certificates["prefill"], certificates["decode"]
    assert prefill.serial_number != decode.serial_number
    assert prefill.public_key().public_numbers() != decode.public_key().public_numbers()
    assert prefill.subject != decode.subject
    assert prefill.issuer == decode.issuer
    authority = {role: c.extensions.get_extension_for_oid(
        ExtensionOID.AUTHORITY_KEY_IDENTIFIER).value.key_identifier
        for role, c in certificates.items()}
    assert authority["prefill"] == authority["decode"]
    for role, certificate in certificates.items():
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.IPAddress) == \
            [ipaddress.ip_address(addresses[role][0])], role
        assert not certificate.extensions.get_extension_for_class(
            x509.BasicConstraints).value.ca


def refused_by_server(host: str, port: int, member: ClusterTLS | None) -> str:
    """How the worker answers a TLS 1.3 client presenting ``member``'s certificate and key
    (None: none), which itself trusts any server: "accepted" when the worker then speaks
    HTTP/2 (a gRPC server sends its SETTINGS first), else the worker's refusal."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.set_alpn_protocols(["h2"])
    if member is not None:
        directory = tempfile.mkdtemp()
        cert, key = Path(directory, "cert.pem"), Path(directory, "key.pem")
        cert.write_bytes(member.certificate_chain)
        key.write_bytes(member.private_key)
        context.load_cert_chain(cert, key)
    with socket.create_connection((host, port), timeout=10) as raw, \
            context.wrap_socket(raw) as tls:
        try:
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            data = tls.recv(1024)
        except (ssl.SSLError, ConnectionError) as exc:
            return f"refused: {exc}"
        return "accepted" if data else "refused: closed"


def test_clients_without_a_certificate_of_the_cluster_ca_are_refused(serve):
    """Plain TCP, TLS without a client certificate, and TLS with a certificate from
    another CA (for the right address): the worker refuses the connection before any
    RPC (checked on the wire, and with grpc's own client)."""
    host, port = workers(serve)["prefill"]
    other = ClusterCA.generate("another CA").issue("intruder", [host])
    probes = {"no certificate": refused_by_server(host, port, None),
              "another CA's": refused_by_server(host, port, other)}
    for how, outcome in probes.items():
        assert outcome.startswith("refused"), how

    async def attempt(channel) -> grpc.StatusCode:
        async with channel:
            try:
                await prefill_pb2_grpc.PrefillWorkerStub(channel).Health(
                    common_pb2.HealthRequest(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    async def main():
        address = f"{host}:{port}"
        return [await attempt(grpc.aio.insecure_channel(address)),
                await attempt(grpc.aio.secure_channel(address, grpc.ssl_channel_credentials())),
                await attempt(grpc.aio.secure_channel(address, other.channel_credentials()))]

    assert asyncio.run(main()) == [grpc.StatusCode.UNAVAILABLE] * 3


def test_the_ca_key_never_leaves_the_issuing_process():
    """A ClusterCA cannot be pickled (Ray would have to, to send it anywhere); what a
    member gets, its ClusterTLS, holds the CA's certificate and no key of the CA's."""
    ca = ClusterCA.generate()
    with pytest.raises(TypeError, match="never leaves"):
        pickle.dumps(ca)
    member = pickle.loads(pickle.dumps(ca.issue("worker", ["10.0.0.7", "worker-0.pdserve"])))
    certificate = x509.load_pem_x509_certificate(member.certificate_chain)
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    assert names.get_values_for_type(x509.DNSName) == ["worker-0.pdserve"]
    assert member.root_certificates == ca.certificate_pem
    assert b"PRIVATE KEY" in member.private_key and b"PRIVATE KEY" not in \
        member.root_certificates + member.certificate_chain
    ca.certificate.public_key().verify(  # signed by the CA (raises if not)
        certificate.signature, certificate.tbs_certificate_bytes,
        ec.ECDSA(certificate.signature_hash_algorithm))


def test_a_worker_takes_up_renewed_certificate_files_without_a_restart(tmp_path):
    """A plain-process worker given --cluster-ssl-* files (as cert-manager's csi-driver
    writes them per pod) serves its certificate; when the files are replaced by a renewed
    one, the next connection gets the new certificate, and calls with a certificate of the
    same CA keep working."""
    from disagg_client import TEST_AUTH, start_worker_process

    from pdserve.engine.demo_model import make_demo_model
    from pdserve.entrypoints.redis_server import RedisServer

    ca = ClusterCA.generate()
    files = {"cert": tmp_path / "tls.crt", "key": tmp_path / "tls.key",
             "ca": tmp_path / "ca.crt"}

    def install(member: ClusterTLS) -> None:
        for name, data in (("cert", member.certificate_chain), ("key", member.private_key),
                           ("ca", member.root_certificates)):
            staged = files[name].with_suffix(".new")
            staged.write_bytes(data)
            staged.replace(files[name])  # NOTE: atomic, as the csi-driver writes

    first = ca.issue("worker", ["127.0.0.1"])
    install(first)
    router = TEST_AUTH.with_tls(ca.issue("router", ["127.0.0.1"]))
    model = make_demo_model(tmp_path / "demo")

    async def health(address: str) -> str:
        async with router.channel(address) as channel:
            request = common_pb2.HealthRequest()
            reply = await prefill_pb2_grpc.PrefillWorkerStub(channel).Health(
                request, timeout=10, metadata=router.rpc_metadata(
                    "/pdserve.v1.PrefillWorker/Health", request))
            return reply.status

    with RedisServer() as redis_server:
        proc, info = start_worker_process(
            "prefill", ["--model", str(model), "--dtype", "float32", "--max-model-len", "256",
                        "--num-gpu-blocks-override", "64", "--redis-url", redis_server.url,
                        "--num-threads", "1", "--log-level", "WARNING",
                        "--cluster-ssl-certfile", str(files["cert"]),
                        "--cluster-ssl-keyfile", str(files["key"]),
                        "--cluster-ssl-ca-certs", str(files["ca"])],
            tmp_path / "ready.json", timeout_s=240)
        try:
            host, port = info["grpc_address"].rsplit(":", 1)
            before = server_certificate(host, int(port))
            status_before = asyncio.run(health(info["grpc_address"]))
            renewed = ca.issue("worker", ["127.0.0.1"])
            install(renewed)
            after = server_certificate(host, int(port))
            status_after = asyncio.run(health(info["grpc_address"]))
        finally:
            proc.kill()
            proc.wait(timeout=30)
    serial = {which: x509.load_pem_x509_certificate(m.certificate_chain).serial_number
              for which, m in (("first", first), ("renewed", renewed))}
    assert before.serial_number == serial["first"]
    assert after.serial_number == serial["renewed"]
    assert status_before == status_after == "ok"


def test_auto_and_operator_certificates_exclude_each_other(tmp_path):
    """``--cluster-tls auto`` beside ``--cluster-ssl-*`` files is refused before anything
    starts, naming the flags."""
    import subprocess
    import sys

    member = ClusterCA.generate().issue("member", ["127.0.0.1"])
    files = []
    for name, data in (("cert.pem", member.certificate_chain), ("key.pem", member.private_key),
                       ("ca.pem", member.root_certificates)):
        (tmp_path / name).write_bytes(data)
        files.append(str(tmp_path / name))
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.entrypoints.cli", "serve", "--cluster-tls", "auto",
         "--cluster-ssl-certfile", files[0], "--cluster-ssl-keyfile", files[1],
         "--cluster-ssl-ca-certs", files[2]],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0
    assert "--cluster-tls auto makes its own certificates" in out.stderr
    assert "Ray" not in out.stderr and "Redis at" not in out.stdout + out.stderr


def test_workers_added_by_scaling_get_certificates_of_their_own(serve):
    """``/admin/scale`` adds a decode worker: the launcher issues it a certificate of its
    own (another key and serial than every other member's, its address as the SAN), and
    requests keep being served over mutual TLS."""
    import json

    import redis

    from pdserve.cluster.registry import WORKERS_KEY, WorkerRecord, record_key

    reply = httpx.post(f"{serve.url}/admin/scale", json={"decode_workers": 2}, timeout=300)
    assert reply.status_code == 200, reply.text
    try:
        client = redis.Redis.from_url(serve.redis.url)
        records = []
        for worker_id in client.smembers(WORKERS_KEY):
            stored = client.get(record_key(worker_id.decode()))
            if stored is not None:
                records.append(WorkerRecord.from_json(json.loads(stored)["record"]))
        client.close()
        assert sorted(r.role for r in records) == ["decode", "decode", "prefill"]
        certificates = {}
        for record in records:
            host, port = record.grpc_address.rsplit(":", 1)
            certificates[record.worker_id] = server_certificate(host, int(port))
            names = certificates[record.worker_id].extensions.get_extension_for_class(
                x509.SubjectAlternativeName).value
            assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(host)]
        assert len({c.serial_number for c in certificates.values()}) == 3
        assert len({c.public_key().public_numbers() for c in certificates.values()}) == 3
        body = {"model": "demo", "prompt": "Scaled up, still", "max_tokens": 4,
                "temperature": 0.0, "ignore_eos": True}
        for _ in range(4):  # served after the pool grew, new worker or not
            completion = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=120)
            assert completion.status_code == 200, completion.text
    finally:
        httpx.post(f"{serve.url}/admin/scale", json={"decode_workers": 1}, timeout=300)
