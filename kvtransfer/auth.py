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
the pull fails (the router retries it elsewhere). GMAC runs at ~7-8 GB/s a core here
(``cryptography``'s OpenSSL: carry-less multiplication) on data in memory, 17-26 GB/s on
data in cache, Poly1305 at ~4-5; the pair socket (``socket_pair``) feeds it each 1 MiB
piece right before sending it and right after receiving it, while it is in cache.

The pair socket's handshake proves ``pair_key`` (the kv key and the pair's prefix) before
any byte of a payload is accepted.
"""

from __future__ import annotations

import hashlib
import hmac

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

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


__all__ = ["TAG_BYTES", "TRAILER_NUMEL", "UNAUTHENTICATED_KV_KEY", "PayloadDigest",
           "pair_key", "transfer_key"]
