"""Every KV transfer's bytes are verified before they enter a cache.

The sender computes a GMAC tag (AES-256-GCM over the bytes as additional authenticated
data and no plaintext: NIST SP 800-38D) over the transfer's header and payload, in wire
order, and sends it after the payload; the receiver computes the same over what it
received and compares before the pull may succeed. GCM needs its (key, IV) pair never
reused, so each transfer gets a key of its own (and a fixed IV),
``HMAC-SHA256(K, fields)`` over the cluster's KV key ``K`` (``ClusterAuth.kv_key``) and
the pull's identity: both workers, the request, the receiver's incarnation, the channel's
generation, the transfer's tag and the ticket's random nonce (``Ticket.nonce``, 16 bytes
the decode side draws for each pull, and which the claim protocol lets be sent once).
Someone without the cluster secret can neither compute a tag for bytes of their own nor
reuse one, so bytes injected into or altered on a pair connection fail the check, and
the pull fails (the router retries it elsewhere). GCM's tag runs at ~7-8 GB/s a core
here (``cryptography``'s OpenSSL: carry-less multiplication) on data in memory, 17-26
GB/s on data in cache, Poly1305 at ~4-5.

The pair socket's handshake proves ``pair_key`` (the kv key and the pair's prefix) before
any byte of a payload is accepted.

Over the pair socket the blocks themselves are tagged once, when the prefill worker has
written them, not at each send (``BlockTagger``): each block's tag is AES-256-GCM's over
the block's wire bytes as additional data and its *binding* as plaintext (what the block
holds: ``engine.block_hash.block_bindings``, the chain hash of the prompt's tokens up to
and including the block), under a key of the prefill worker's (``_block_aead``: the kv key,
the worker id and a random epoch drawn per ``KVSender``) and a nonce no other block of
that key uses (a counter). The transfer then sends the tags of its blocks (a records
frame, after the header) and the receiver (``BlockVerifier``) computes each block's tag
over the bytes that landed and the binding it expects at that position of its own
prompt, and compares. The per-transfer GMAC above covers the header and the records
(bytes, not the payload), so the records cannot be moved to another pull either. A block
replayed from an earlier transfer passes only where the receiver expects the very same
tokens: it is genuine KV of that prompt. Tagging happens on the prefill worker while the
router picks a decode worker (``PrefillService``), so a transfer pays one pass over its
bytes (the receiver's) instead of two; a block without a current tag is tagged on the
send path.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import threading
from collections.abc import Callable, Sequence

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdserve.kvtransfer.protocol import Ticket

TAG_BYTES = 16
_IV = bytes(12)  # NOTE: every transfer has a key of its own
TRAILER_NUMEL = TAG_BYTES // 8  # the tag travels as int64[2] after the payload
# NOTE: a worker built in-process without a cluster secret (ClusterAuth None: no
# authentication anywhere, gRPC included; never from a command line) uses this key
UNAUTHENTICATED_KV_KEY = hashlib.sha256(b"pdserve kv transfer: no cluster secret").digest()


def transfer_key(kv_key: bytes, prefill_worker_id: str, decode_worker_id: str,
                 request_id: str, ticket: Ticket) -> bytes:
    """The 32-byte GMAC key of one transfer (see the module docstring)."""
    fields = ["pdserve kv payload v1", prefill_worker_id, decode_worker_id, request_id,
              ticket.incarnation, str(ticket.generation), str(ticket.tag), ticket.nonce]
    return hmac.new(kv_key, "\n".join(fields).encode(), hashlib.sha256).digest()


def pair_key(kv_key: bytes, prefix: str) -> bytes:
    """The 32-byte key that both ends of the pair channel ``prefix`` (unique per pair and
    generation) prove to each other before a byte of a payload moves (``socket_pair``)."""
    return hmac.new(kv_key, f"pdserve kv pair v1\n{prefix}".encode(), hashlib.sha256).digest()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy when it is contiguous."""
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class PayloadDigest:
    """The running GMAC tag of one transfer, fed the header and each chunk (CPU tensors,
    any dtype) in wire order.

    Args:
        key: ``transfer_key(...)``, 32 bytes; never reuse one for two payloads.
    """

    def __init__(self, key: bytes) -> None:
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(_IV)).encryptor()

    def update(self, tensor: torch.Tensor) -> None:
        """Feed a CPU tensor's bytes (a copy first if it is not contiguous)."""
        self._gcm.authenticate_additional_data(_bytes_of(tensor))

    def update_bytes(self, data: memoryview) -> None:
        """Feed bytes (a piece of a message; pieces may be cut anywhere: GMAC's tag is
        that of the bytes in order)."""
        self._gcm.authenticate_additional_data(data)

    def _tag(self) -> bytes:
        self._gcm.finalize()
        return self._gcm.tag

    def trailer(self) -> torch.Tensor:
        """The tag as the ``int64[TRAILER_NUMEL]`` message sent after the payload; ends
        the digest."""
        return torch.frombuffer(bytearray(self._tag()), dtype=torch.int64)

    def verify(self, trailer: torch.Tensor) -> bool:
        """True if ``trailer`` (the received ``int64[TRAILER_NUMEL]``) is this payload's
        tag; ends the digest."""
        return hmac.compare_digest(self._tag(), _bytes_of(trailer).tobytes())


EPOCH_BYTES = 16
RECORD_NUMEL = 3  # per block: serial, then the 16-byte tag as 2 int64
_EPOCH_NUMEL = EPOCH_BYTES // 8


def records_numel(num_blocks: int) -> int:
    """Elements of the int64 records frame of ``num_blocks`` blocks: the sender's epoch
    (2), then (serial, tag) per block (3 each)."""
    return _EPOCH_NUMEL + RECORD_NUMEL * num_blocks


def request_bindings(request_id: str, num_blocks: int) -> list[bytes]:
    """Bindings for callers that have no prompt (the KV benchmark, transport tests): the
    request id and the block's position in the payload. Workers bind blocks to their
    tokens instead (``engine.block_hash.block_bindings``)."""
    rid = hashlib.sha256(f"pdserve kv request\n{request_id}".encode()).digest()[:16]
    return [rid + i.to_bytes(4, "little") for i in range(num_blocks)]


@functools.lru_cache(maxsize=256)
def _block_aead(kv_key: bytes, prefill_worker_id: str, epoch: bytes) -> AESGCM:
    """The AEAD of a prefill worker's block tags for one epoch (cached: a decode worker
    meets few)."""
    return AESGCM(hmac.new(kv_key, b"pdserve kv blocks v1\n" + prefill_worker_id.encode()
                           + b"\n" + epoch, hashlib.sha256).digest())


def _nonce(serial: int) -> bytes:
    return serial.to_bytes(12, "little")


def _block_tag(aead: AESGCM, serial: int, binding: bytes, data) -> bytes:
    """16 bytes: GCM's tag over ``binding`` (plaintext) and ``data`` (additional data)."""
    return aead.encrypt(_nonce(serial), binding, data)[-TAG_BYTES:]


class BlockTagger:
    """A prefill worker's block tags (see the module docstring): each block's latest
    (binding, serial, tag), computed by ``tag`` when the block was written and looked up
    by ``records`` at each send. Thread-safe.

    Args:
        kv_key: the cluster's KV key (``ClusterAuth.kv_key``).
        worker_id: the prefill worker's id (the receiver derives the key from it).
    """

    def __init__(self, kv_key: bytes, worker_id: str) -> None:
        self.epoch = secrets.token_bytes(EPOCH_BYTES)
        self._aead = _block_aead(kv_key, worker_id, self.epoch)
        self._lock = threading.Lock()
        self._serial = 0
        self._tags: dict[int, tuple[bytes, int, bytes]] = {}
        self.tagged_on_send = 0  # blocks that had no current tag when sent (a counter)

    def tag(self, block_ids: Sequence[int], bindings: Sequence[bytes],
            block_bytes: Callable[[int], object]) -> None:
        """Tag blocks ``block_ids`` as holding ``bindings`` (one each); ``block_bytes(i)``
        gives the i-th block's wire bytes (a buffer: ``memoryview`` or bytes), called in
        order. A block's earlier tag is replaced."""
        for i, (block_id, binding) in enumerate(zip(block_ids, bindings, strict=True)):
            with self._lock:
                self._serial += 1
                serial = self._serial
            tag = _block_tag(self._aead, serial, binding, block_bytes(i))
            with self._lock:
                self._tags[block_id] = (binding, serial, tag)

    def count_tagged_on_send(self, n: int) -> None:
        """Count ``n`` blocks that a send found without a current tag."""
        with self._lock:
            self.tagged_on_send += n

    def current(self, block_ids: Sequence[int], bindings: Sequence[bytes]) -> list[bool]:
        """Which blocks hold a tag of the binding given."""
        with self._lock:
            return [self._tags.get(b, (None,))[0] == binding
                    for b, binding in zip(block_ids, bindings, strict=True)]

    def records(self, block_ids: Sequence[int], bindings: Sequence[bytes]) -> torch.Tensor:
        """The records frame (``int64[records_numel(n)]``) of a payload of these blocks.

        Raises:
            KeyError: a block holds no tag of its binding (``tag`` it first).
        """
        out = bytearray(self.epoch)
        with self._lock:
            for block_id, binding in zip(block_ids, bindings, strict=True):
                entry = self._tags.get(block_id)
                if entry is None or entry[0] != binding:
                    raise KeyError(f"block {block_id} holds no tag of its binding")
                out += entry[1].to_bytes(8, "little") + entry[2]
        return torch.frombuffer(out, dtype=torch.int64)


class BlockVerifier:
    """The receiver's side of ``BlockTagger``: checks each block of a payload as it lands
    against the records frame the sender sent. Feed it with ``landed`` (the socket calls
    it after each piece of a frame); ``ok()`` once every block arrived.

    Args:
        kv_key: the cluster's KV key.
        prefill_worker_id: the sender, whose key the tags are under.
        records: the received ``int64[records_numel(n)]``.
        bindings: what the receiver expects each block of the payload to hold (``n``).
        block_bytes: bytes of one block on the wire (``KVGeometry.block_bytes``).
    """

    def __init__(self, kv_key: bytes, prefill_worker_id: str, records: torch.Tensor,
                 bindings: Sequence[bytes], block_bytes: int) -> None:
        raw = _bytes_of(records).tobytes()
        n = len(bindings)
        if len(raw) != 8 * records_numel(n):
            raise ValueError(f"records of {len(raw)} bytes for {n} blocks")
        self._aead = _block_aead(kv_key, prefill_worker_id, raw[:EPOCH_BYTES])
        body = raw[EPOCH_BYTES:]
        # NOTE: (nonce, tag) per block, the nonce as GCM takes it (a block's serial)
        self._records = [(body[24 * i:24 * i + 8] + bytes(4), body[24 * i + 8:24 * i + 24])
                         for i in range(n)]
        self._bindings = list(bindings)
        self._block_bytes = block_bytes
        self._next = 0  # the next block of the payload to check
        self._view: memoryview | None = None  # the frame being received
        self._done = 0  # bytes of it checked (whole blocks)
        self._landed = 0  # bytes of it in place
        self._bad = False

    def landed(self, view: memoryview, upto: int) -> None:
        """The first ``upto`` bytes of frame ``view`` (whole blocks, in payload order;
        a new frame starts with a new view) are in place: check the blocks now whole,
        one call each (measured: checking a 2 MiB block piece by piece as it lands cost
        the same)."""
        if view is not self._view:
            if self._landed != self._done:  # NOTE: a frame ended inside a block
                self._bad = True
            self._view, self._done = view, 0
        self._landed = upto
        size = self._block_bytes
        while not self._bad and self._done + size <= upto:
            i = self._next
            if i >= len(self._records):
                self._bad = True
                return
            nonce, tag = self._records[i]
            data = view[self._done:self._done + size]
            if not hmac.compare_digest(
                    self._aead.encrypt(nonce, self._bindings[i], data)[-TAG_BYTES:], tag):
                self._bad = True
                return
            self._next += 1
            self._done += size

    def ok(self) -> bool:
        """True if every block arrived whole and each tag was its sender's."""
        return (not self._bad and self._landed == self._done
                and self._next == len(self._records))


__all__ = ["EPOCH_BYTES", "TAG_BYTES", "TRAILER_NUMEL", "UNAUTHENTICATED_KV_KEY",
           "BlockTagger", "BlockVerifier", "PayloadDigest", "pair_key", "records_numel",
           "request_bindings", "transfer_key"]
