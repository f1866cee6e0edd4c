"""The KV path under attack from the same network: someone who reaches the workers' ports
and knows their ids (``/metrics`` shows them) but not the cluster secret.

While a disaggregated cluster (every prompt prefilled remotely, its KV pulled by the
decode worker) serves requests, an attacker in a thread of this process, for real over
loopback:

- connects to the decode worker's KV store as a ``torch.distributed.TCPStore`` client
  (what worked before the store was authenticated) to read tickets, steal claims
  (``compare_set`` "S" on every pull's claim key) and write fake ones (``"F ..."``), and
  as a pdserve store client holding another cluster's key;
- races every pair rendezvous: connects to every listening port of the workers (the pair
  channel's listener among them) and sends forged bytes: gloo-style sequence numbers
  followed by KV-sized garbage, over and over; the pair listener must drop each one
  (``socket_pair.refused_total``) and keep serving.

Every request must still return the oracle's tokens, the store must have refused the
attacker each time, and nothing forged may be cached: the same prompts asked again, their
prefixes now served from the decode worker's prefix cache, still equal the oracle's.
"""

from __future__ import annotations

import datetime
import os
import socket
import struct
import threading
import time

import psutil
import pytest
import torch.distributed as dist
from inproc_cluster import in_process_cluster

from pdserve.cluster.auth import ClusterAuth
from pdserve.kvtransfer import socket_pair
from pdserve.kvtransfer.protocol import CLAIM_QUEUE_KEY, pair_prefix, split_address
from pdserve.kvtransfer.store import RemoteStore, StoreAuthError

MAX_MODEL_LEN = 256
PROMPTS = [f"Request {i}: the decode worker pulls this prompt's KV cache from the prefill "
           f"worker, block by block, and caches it under the prompt's block hashes."
           for i in range(6)]


class Attacker:
    """Attacks until stopped; counts what it tried and what got through."""

    def __init__(self, kv_address: str, prefill_id: str, decode_id: str,
                 gloo_ports: list[int]) -> None:
        self.host, self.port = split_address(kv_address)
        self.prefix = pair_prefix(prefill_id, decode_id)
        self.gloo_ports = gloo_ports
        self.stop = threading.Event()
        self.store_attempts = 0
        self.store_breaches: list[str] = []
        self.forged_connections = 0
        self.rounds = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _tcpstore(self) -> None:
        """TCPStore's client: reads the tickets, claims every pull it can name."""
        self.store_attempts += 1
        try:
            store = dist.TCPStore(self.host, self.port, None, False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=1))
            for i in range(64):
                rid = f"chatcmpl-{i}"
                for gen in range(4):
                    for tag in range(8):
                        key = f"{self.prefix}/req/{rid}/claim/{gen}/{tag}"
                        store.compare_set(key, "", "S" if tag % 2 else "F forged")
            store.queue_push(CLAIM_QUEUE_KEY, f"S\nprefill\n{rid}")
            self.store_breaches.append("TCPStore client got in")
        except (RuntimeError, OSError):
            pass  # refused: the store is not TCPStore's and wants the key

    def _wrong_key(self) -> None:
        self.store_attempts += 1
        try:
            store = RemoteStore(self.host, self.port, os.urandom(32), 1.0)
            store.compare_set(f"{self.prefix}/gen", "", "999")
            self.store_breaches.append("a client with another key got in")
        except StoreAuthError:
            pass

    def _forge(self, port: int) -> None:
        """Gloo-style: an 8-byte sequence number (its pair handshake), then KV-sized
        garbage, as a peer that won the rendezvous race would send."""
        for seq in range(4):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                    self.forged_connections += 1
                    sock.sendall(struct.pack("<Q", seq) + os.urandom(64 * 1024))
            except OSError:
                pass

    def _run(self) -> None:
        while not self.stop.is_set():
            self._tcpstore()
            self._wrong_key()
            for port in self.gloo_ports:
                self._forge(port)
            self.rounds += 1
            time.sleep(0.05)


def listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with in_process_cluster(tmp_path_factory.mktemp("kv_attacks"), MAX_MODEL_LEN,
                            auth=ClusterAuth.generate(), disaggregation="always",
                            local_prefill_threshold=0) as c:
        yield c


def test_the_kv_path_refuses_an_attacker_and_caches_nothing_forged(cluster):
    before = listening_ports()
    client = cluster.client()
    expected = {p: cluster.expected(p, max_tokens=8, temperature=0.0) for p in PROMPTS}
    # NOTE: one request first, so the pair channel (and its listener) exists
    first = client.completions.create(model=str(cluster.model), prompt=PROMPTS[0],
                                      max_tokens=8, temperature=0.0)
    assert first.choices[0].text == expected[PROMPTS[0]]
    gloo_ports = sorted(listening_ports() - before)
    store = cluster.decode.receiver._server
    attacker = Attacker(cluster.decode.kv_address, cluster.prefill.worker_id,
                        cluster.decode.worker_id, gloo_ports)
    rejected, pair_refused = store.rejected, socket_pair.refused_total()
    counted = cluster.decode.receiver.counters().num_refused  # pdserve:kv_connections_refused
    attacker.thread.start()
    deadline = time.monotonic() + 180
    rounds = 0
    try:
        # NOTE: from the second round on, prefixes come from the decode worker's cache
        while rounds < 2 or (attacker.rounds < 3 and time.monotonic() < deadline):
            for prompt in PROMPTS:
                reply = client.completions.create(model=str(cluster.model), prompt=prompt,
                                                  max_tokens=8, temperature=0.0)
                assert reply.choices[0].text == expected[prompt], prompt
            rounds += 1
    finally:
        attacker.stop.set()
        attacker.thread.join(30)
    assert attacker.store_breaches == []
    assert attacker.rounds >= 3 and attacker.store_attempts >= 6
    assert store.rejected - rejected >= attacker.store_attempts  # each one refused
    assert gloo_ports and attacker.forged_connections > 0
    # the pair listener dropped every forged client that reached its handshake
    assert socket_pair.refused_total() - pair_refused >= attacker.rounds
    # and the decode worker's metric counts both listeners' refusals
    assert cluster.decode.receiver.counters().num_refused - counted >= \
        attacker.store_attempts + attacker.rounds
    # every block sent was tagged when prefill wrote it, not on the transfer
    assert cluster.prefill.service.sender.tagger.tagged_on_send == 0
    # nothing forged was cached: every prompt again, from the caches, is the oracle's
    for prompt in PROMPTS:
        reply = client.completions.create(model=str(cluster.model), prompt=prompt,
                                          max_tokens=8, temperature=0.0)
        assert reply.choices[0].text == expected[prompt], prompt
    cluster.wait_all_blocks_free()
