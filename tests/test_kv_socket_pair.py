"""The CPU pair channel's transport (``kvtransfer/socket_pair.py``), in one process over
loopback: the handshake refuses a client without the pair key and keeps serving,
transfers on one pair may overlap (each receiver waits its tag's turn), every wait ends at
its deadline, and closing the pair wakes its waiters."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pdserve.kvtransfer import socket_pair
from pdserve.kvtransfer.auth import PayloadDigest, pair_key
from pdserve.kvtransfer.protocol import KVTransferError
from pdserve.kvtransfer.socket_pair import MAGIC, SocketPair
from pdserve.kvtransfer.store import KVStoreServer, RemoteStore

KV_KEY = b"k" * 32


@pytest.fixture()
def server():
    server = KVStoreServer("127.0.0.1", 0, KV_KEY, timeout_s=10)
    yield server
    server.close()


def _connect(server, prefix: str, key: bytes = KV_KEY, before_client=None,
             decode_errors: list | None = None, timeout_s: float = 10):
    """Both ends of one pair (decode listening in a thread, prefill connecting); runs
    ``before_client(port)`` once the listener is up, before the prefill side connects.
    What the decode side raises goes into ``decode_errors`` (the prefill side's error
    propagates once the decode side has ended too)."""
    pairs: dict = {}
    errors = [] if decode_errors is None else decode_errors
    local = server.local()

    def listen() -> None:
        try:
            pairs[1] = SocketPair.connect(dist.PrefixStore(prefix, local), 1, "127.0.0.1",
                                          pair_key(KV_KEY, prefix), timeout_s)
        except KVTransferError as exc:
            errors.append(exc)

    decode = threading.Thread(target=listen)
    decode.start()
    try:
        remote = RemoteStore("127.0.0.1", server.port, KV_KEY, 10)
        port = int(dist.PrefixStore(prefix, remote).get(socket_pair.PORT_KEY).decode())
        if before_client is not None:
            before_client(port)
        pairs[0] = SocketPair.connect(dist.PrefixStore(prefix, remote), 0, "127.0.0.1",
                                      pair_key(key, prefix), timeout_s)
    finally:
        decode.join(timeout_s + 5)
    assert not decode.is_alive()
    assert decode_errors is not None or not errors, errors
    return pairs, port


def _forge(port: int) -> bool:
    """Connect as someone without the key; True if the listener closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        hello = sock.recv(len(MAGIC) + 16)
        assert hello.startswith(MAGIC)
        sock.sendall(os.urandom(48))
        sock.settimeout(5)
        return sock.recv(1) == b""


def test_a_client_without_the_pair_key_is_dropped_and_the_listener_keeps_serving(server):
    refused = socket_pair.refused_total()
    pairs, port = _connect(server, "pair/a", before_client=lambda port: [
        _forge(port) for _ in range(3)])
    assert socket_pair.refused_total() - refused == 3
    # NOTE: the pair works after the refusals, and the listener still refuses
    data = torch.arange(3 * 2**20 + 5, dtype=torch.uint8)
    out = torch.zeros_like(data)
    send, recv = PayloadDigest(b"d" * 32), PayloadDigest(b"d" * 32)
    thread = threading.Thread(target=pairs[0].send_frame,
                              args=(7, data, time.monotonic() + 10, send))
    thread.start()
    pairs[1].acquire(7, time.monotonic() + 10)
    pairs[1].recv_frame(7, out, time.monotonic() + 10, recv)
    pairs[1].release()
    thread.join(10)
    assert torch.equal(out, data) and recv.verify(send.trailer())
    assert _forge(port)
    assert socket_pair.refused_total() - refused == 4
    for pair in pairs.values():
        pair.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_a_peer_with_another_key_never_connects(server):
    decode_errors: list = []
    with pytest.raises(KVTransferError, match="pair key|refused"):
        _connect(server, "pair/b", key=b"x" * 32, decode_errors=decode_errors, timeout_s=2)
    # NOTE: the listening side never got a peer that proved the key, and gave up in time
    assert len(decode_errors) == 1 and "did not connect" in str(decode_errors[0])


def test_overlapping_transfers_each_wait_their_tags_turn(server):
    pairs, _ = _connect(server, "pair/c")
    payloads = {tag: torch.full((2**20 + tag,), tag, dtype=torch.uint8) for tag in (1, 2, 3)}
    received: dict = {}

    def receive(tag: int) -> None:
        out = torch.zeros_like(payloads[tag])
        pairs[1].acquire(tag, time.monotonic() + 10)
        try:
            pairs[1].recv_frame(tag, out, time.monotonic() + 10)
            pairs[1].recv_frame(tag, out[:4], time.monotonic() + 10)
        finally:
            pairs[1].release()
        received[tag] = out

    receivers = [threading.Thread(target=receive, args=(tag,)) for tag in (1, 2, 3)]
    for thread in receivers:
        thread.start()
    for tag in (3, 1, 2):  # NOTE: not the order the receivers came in
        pairs[0].send_frame(tag, payloads[tag], time.monotonic() + 10)
        pairs[0].send_frame(tag, payloads[tag][:4], time.monotonic() + 10)
    for thread in receivers:
        thread.join(10)
    assert set(received) == {1, 2, 3}
    assert all(torch.equal(received[tag], payloads[tag]) for tag in received)
    for pair in pairs.values():
        pair.close()


def test_a_wait_ends_at_its_deadline_and_close_wakes_waiters(server):
    pairs, _ = _connect(server, "pair/d")
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="timed out"):
        pairs[1].acquire(1, start + 0.3)
    assert time.monotonic() - start < 2
    errors: list = []

    def wait() -> None:
        try:
            pairs[1].acquire(2, time.monotonic() + 30)
        except KVTransferError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    start = time.monotonic()
    pairs[1].close()
    waiter.join(5)
    assert errors and time.monotonic() - start < 2
    with pytest.raises(KVTransferError):  # the peer sees the closed connection
        for _ in range(64):
            pairs[0].send_frame(1, torch.zeros(2**20, dtype=torch.uint8),
                                time.monotonic() + 5)
    pairs[0].close()
