"""A CPU pair channel's transport: one authenticated TCP connection per pair.

The pair's bytes between two workers whose payloads are host memory (CPU caches, or a
CUDA cache staged through pinned memory) move over one TCP connection that pdserve opens
and authenticates itself (``torch.distributed``'s gloo pairs accept any TCP client).

Rendezvous: the decode side (rank 1) listens on an ephemeral port of its KV host and
writes the port under ``sock/1`` in the pair's prefix of its authenticated store
(``store.KVStoreServer``); the prefill side (rank 0) reads it and connects to the host
it reached the store on.

Handshake (``pdkv-pair/1``), before any byte of a payload is accepted, mutual: the
listener sends ``MAGIC`` and a 16-byte nonce ``Ns``; the client answers its nonce ``Nc``
and ``HMAC-SHA256(Kp, "client" | Ns | Nc)``; the listener checks it and proves the key in
turn with ``HMAC-SHA256(Kp, "server" | Nc | Ns)``. ``Kp`` is the pair's key
(``auth.pair_key``: the cluster's KV key and the pair's prefix, unique per pair and
generation). A client that fails (or takes over ``HANDSHAKE_TIMEOUT_S``) is dropped and
counted (``refused_total``); the listener keeps serving until the pair is aborted (a
client that proves the key once the pair is up is closed: the pair is taken).

Frames, prefill to decode only: ``u64 tag | u64 length | bytes``; a transfer is its
header frame, its block records' frame, its chunks' frames and its GMAC trailer's frame,
in a row (the sender holds the connection for the whole transfer). The receiver reads each
``PIECE_BYTES`` piece straight into the posted buffer (``recvmsg_into`` on the tensor's
memory) and hands it to the caller's check right after (``auth.BlockVerifier``), while it
is in cache. Transfers on one pair may overlap: a receiver that reads
another tag's header frame leaves it for that tag's receiver and waits its turn. Every
wait is bounded by the caller's deadline; ``close`` shuts the connection down, which wakes
every blocked read and write, and the turn's waiters.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time

import torch

from pdserve.kvtransfer.protocol import KVTransferError

logger = logging.getLogger(__name__)

MAGIC = b"pdkv-pair/1\n"
HANDSHAKE_TIMEOUT_S = 5.0
"""Seconds a client of a pair listener has to prove the pair key."""
MAX_HANDSHAKES = 16
"""Handshakes under way at once on one listener; more clients are dropped."""
PIECE_BYTES = 256 * 1024
"""Bytes read (written) at a time, each piece's blocks checked right after it lands: small
enough to still be in cache then (on the 2-core test VM the receiver's block tags ran at
~8 GB/s over 1 MiB pieces, 12-16 over 256 and 128 KiB ones; pair throughput the same)."""
PORT_KEY = "sock/1"
REFUSAL_LOG_INTERVAL_S = 10.0
_NONCE = 16
_MAC = 32
_FRAME = struct.Struct(">QQ")  # tag, length

_refusals_lock = threading.Lock()
_refusals = {"total": 0, "logged_at": -REFUSAL_LOG_INTERVAL_S}


def refused_total() -> int:
    """Clients this process's pair listeners dropped for failing the handshake."""
    with _refusals_lock:
        return _refusals["total"]


def _refused(peer, reason: str) -> None:
    now = time.monotonic()
    with _refusals_lock:
        _refusals["total"] += 1
        if now - _refusals["logged_at"] < REFUSAL_LOG_INTERVAL_S:
            return
        _refusals["logged_at"] = now
        total = _refusals["total"]
    logger.warning("KV pair listener refused a connection from %s: %s (%d refused in all)",
                   peer, reason, total)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), "sha256").digest()


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise KVTransferError(f"{what}: timed out")
    return left


_QUANTUM_S = 0.5
"""The longest one system call may block; a call that waited this long with no progress
is retried until the deadline."""


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` less their first ``n`` bytes (and any emptied view)."""
    out = []
    for view in views:
        if n >= view.nbytes:
            n -= view.nbytes
            continue
        out.append(view[n:])
        n = 0
    return out


class _Conn:
    """A blocking TCP socket whose reads and writes each take one system call per list
    of buffers (``recvmsg_into`` with ``MSG_WAITALL``, ``sendmsg``), bounded by a
    deadline through ``SO_RCVTIMEO`` / ``SO_SNDTIMEO``.

    NOTE: Python's own socket timeouts make the socket non-blocking, and a large read
    then returns in many small pieces, each a trip through Python; here the kernel fills
    the whole piece (without the GIL). The kernel timeout is set only when the value set
    last would outlast the deadline (``_QUANTUM_S`` at most), so not once per call.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._bounds = {socket.SO_RCVTIMEO: 0.0, socket.SO_SNDTIMEO: 0.0}

    def _bound(self, option: int, deadline: float, what: str) -> None:
        left = _remaining(deadline, what)
        if 0 < self._bounds[option] <= left:
            return
        bound = min(left, _QUANTUM_S)
        seconds = int(bound)
        micros = max(int((bound - seconds) * 1e6), 0 if seconds else 1)
        self.sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", seconds, micros))
        self._bounds[option] = bound

    def recv_into(self, views: list[memoryview], deadline: float, what: str) -> None:
        """Fill ``views`` in order by ``deadline`` (monotonic seconds).

        Raises:
            KVTransferError: timed out, the peer closed the connection, or it failed.
        """
        views = [view for view in views if view.nbytes]
        while views:
            self._bound(socket.SO_RCVTIMEO, deadline, what)
            try:
                n = self.sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0]
            except BlockingIOError:
                continue  # NOTE: a quantum passed; _bound checks the deadline
            except OSError as exc:
                raise KVTransferError(f"{what}: {exc}") from exc
            if n == 0:
                raise KVTransferError(f"{what}: the peer closed the connection")
            views = _advance(views, n)

    def recv_exact(self, n: int, deadline: float, what: str) -> bytes:
        """``n`` bytes, as ``recv_into``."""
        buf = bytearray(n)
        self.recv_into([memoryview(buf)], deadline, what)
        return bytes(buf)

    def send(self, views: list, deadline: float, what: str) -> None:
        """Send all of ``views`` (bytes-like) in order by ``deadline``.

        Raises:
            KVTransferError: timed out, or the connection failed or was closed.
        """
        views = [memoryview(view).cast("B") for view in views]
        views = [view for view in views if view.nbytes]
        while views:
            self._bound(socket.SO_SNDTIMEO, deadline, what)
            try:
                n = self.sock.sendmsg(views)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise KVTransferError(f"{what}: {exc}") from exc
            views = _advance(views, n)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a writable memoryview (no copy).

    Raises:
        ValueError: the tensor is not contiguous or not in host memory.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("a pair socket moves contiguous host tensors only")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class _Listener:
    """The decode side's listening socket of one pair: hands the first client that proves
    the key to ``wait``, drops (and counts) every client that does not, until closed."""

    def __init__(self, host: str, key: bytes) -> None:
        self._key = key
        self._sock = socket.create_server((host, 0), backlog=16)
        self.port = self._sock.getsockname()[1]
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._lock = threading.Lock()
        self._peer: socket.socket | None = None
        self._ready = threading.Event()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True,
                         name=f"kv-pair-listener-{self.port}").start()

    def wait(self, deadline: float) -> socket.socket:
        """The authenticated connection; raises KVTransferError past ``deadline``."""
        if not self._ready.wait(max(deadline - time.monotonic(), 0)) or self._peer is None:
            raise KVTransferError("the prefill worker did not connect to the pair socket "
                                  "in time")
        return self._peer

    def close(self) -> None:
        """Stop listening (a pending ``wait`` then fails)."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            # NOTE: wakes the accept thread (Linux); a close alone leaves it blocked, and
            # the socket listening, until the next client
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._ready.set()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            if not self._handshakes.acquire(blocking=False):
                _refused(peer, f"{MAX_HANDSHAKES} handshakes under way")
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True,
                             name=f"kv-pair-handshake-{self.port}").start()

    def _handshake(self, conn: socket.socket, peer) -> None:
        try:
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
            wire = _Conn(conn)
            server_nonce = secrets.token_bytes(_NONCE)
            wire.send([MAGIC + server_nonce], deadline, "handshake")
            answer = wire.recv_exact(_NONCE + _MAC, deadline, "handshake")
            client_nonce, proof = answer[:_NONCE], answer[_NONCE:]
            if not hmac.compare_digest(proof, _mac(self._key, b"client", server_nonce,
                                                   client_nonce)):
                raise KVTransferError("it did not prove the pair key")
            wire.send([_mac(self._key, b"server", client_nonce, server_nonce)], deadline,
                      "handshake")
        except (KVTransferError, OSError) as exc:
            _refused(peer, str(exc))
            conn.close()
            return
        finally:
            self._handshakes.release()
        with self._lock:
            taken = self._closed or self._peer is not None
            if not taken:
                self._peer = conn
        if taken:
            conn.close()  # NOTE: a member of the cluster, but the pair is up (or closed)
            return
        self._ready.set()


class SocketPair:
    """One pair's authenticated connection (see the module docstring).

    Thread-safe: ``send_frame`` callers serialise whole transfers themselves (the pair
    group's send lock); receivers take turns with ``acquire`` / ``release``.
    """

    def __init__(self, sock: socket.socket, listener: _Listener | None = None) -> None:
        self._sock = sock
        self._wire = _Conn(sock)
        self._frame = bytearray(_FRAME.size)  # NOTE: receivers' frame headers, in turn
        self._listener = listener
        self._cond = threading.Condition()
        self._owner: int | None = None  # the tag whose receiver reads the connection
        self._next_frame: tuple[int, int] | None = None  # a frame header read, body not
        self.closed = False

    @classmethod
    def connect(cls, store, rank: int, host: str, key: bytes, timeout_s: float) -> SocketPair:
        """Rendezvous through ``store`` (the pair's prefix store) and connect.

        Args:
            store: the pair's ``PrefixStore`` over the decode worker's store.
            rank: 1 (decode: listens) or 0 (prefill: connects).
            host: rank 1: the address to listen on; rank 0: the decode worker's host (the
                one its store was reached at).
            key: the pair's key (``auth.pair_key``).
            timeout_s: seconds to wait for the peer.

        Raises:
            KVTransferError: the peer did not show up or prove the key in time.
        """
        deadline = time.monotonic() + timeout_s
        if rank == 1:
            listener = _Listener(host, key)
            try:
                store.set(PORT_KEY, str(listener.port))
                sock = listener.wait(deadline)
            except BaseException:
                listener.close()
                raise
            return cls(sock, listener)
        port = int(store.get(PORT_KEY).decode())
        try:
            sock = socket.create_connection((host, port), timeout=_remaining(deadline,
                                                                             "connecting"))
        except OSError as exc:
            raise KVTransferError(f"cannot reach the pair socket {host}:{port}: {exc}") from exc
        try:
            _client_handshake(sock, key, deadline, f"{host}:{port}")
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def send_frame(self, tag: int, tensor: torch.Tensor, deadline: float, digest=None) -> int:
        """Send one frame of ``tensor``'s bytes (contiguous, host memory), feeding each
        piece to ``digest`` (``auth.PayloadDigest``, or None) right before it goes; return
        the bytes sent.

        Raises:
            KVTransferError: timed out, or the connection failed or was closed.
        """
        view = byte_view(tensor)
        n = view.nbytes
        head = [_FRAME.pack(tag, n)]  # NOTE: goes with the first piece, in one call
        for start in range(0, n, PIECE_BYTES):
            piece = view[start:start + PIECE_BYTES]
            if digest is not None:
                digest.update_bytes(piece)
            self._wire.send([*head, piece], deadline, "sending a frame")
            head = []
        return n

    def acquire(self, tag: int, deadline: float) -> None:
        """Wait until the connection's next frame is ``tag``'s and take the turn to read;
        frame headers of other tags read meanwhile are left for their receivers.

        Raises:
            KVTransferError: the deadline passed, or the connection failed or was closed.
        """
        with self._cond:
            while True:
                if self.closed:
                    raise KVTransferError("the pair socket is closed")
                if self._owner is None and self._next_frame is not None:
                    if self._next_frame[0] == tag:
                        self._owner = tag
                        return
                elif self._owner is None:
                    self._owner = tag
                    self._cond.release()
                    try:
                        frame = _FRAME.unpack(self._wire.recv_exact(
                            _FRAME.size, deadline, "receiving a frame"))
                    finally:
                        self._cond.acquire()
                        self._owner = None
                        self._cond.notify_all()
                    self._next_frame = frame
                    continue
                self._cond.wait(_remaining(deadline, f"waiting for tag {tag}'s turn"))

    def release(self) -> None:
        """End this receiver's turn (after its last frame, or a failure)."""
        with self._cond:
            self._owner = None
            self._cond.notify_all()

    def recv_frame(self, tag: int, tensor: torch.Tensor, deadline: float,
                   digest=None, on_landed=None) -> None:
        """Receive the next frame, which must be ``tag``'s and ``tensor``'s size, straight
        into ``tensor`` (contiguous, host memory), feeding each piece to ``digest`` right
        after it lands, and calling ``on_landed(view, upto)`` then (``view``: the frame's
        bytes, one object for the whole frame; ``upto``: how many are in place; e.g.
        ``auth.BlockVerifier.landed``). Call between ``acquire(tag, ...)`` and ``release``.

        Raises:
            KVTransferError: a frame of another tag or size, a timeout, or the connection
                failed or was closed.
        """
        view = byte_view(tensor)
        first = view[:PIECE_BYTES]
        frame, self._next_frame = self._next_frame, None
        if frame is None:
            # NOTE: the frame's header and first piece in one call; a frame of another
            # size or tag fails the transfer (and the pair) below, so reading ahead
            # past a short one does no harm
            self._wire.recv_into([memoryview(self._frame), first], deadline,
                                 "receiving a frame")
            frame = _FRAME.unpack(self._frame)
        else:
            self._wire.recv_into([first], deadline, "receiving a frame")
        if frame != (tag, view.nbytes):
            raise KVTransferError(f"expected a frame of tag {tag}, {view.nbytes} bytes; got "
                                  f"tag {frame[0]}, {frame[1]} bytes")
        if digest is not None:
            digest.update_bytes(first)
        if on_landed is not None:
            on_landed(view, first.nbytes)
        for start in range(PIECE_BYTES, view.nbytes, PIECE_BYTES):
            piece = view[start:start + PIECE_BYTES]
            self._wire.recv_into([piece], deadline, "receiving a frame")
            if digest is not None:
                digest.update_bytes(piece)
            if on_landed is not None:
                on_landed(view, start + piece.nbytes)

    def close(self) -> None:
        """Shut the connection (and the listener) down; wakes every waiter. Idempotent."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._listener is not None:
            self._listener.close()


def _client_handshake(sock: socket.socket, key: bytes, deadline: float, where: str) -> None:
    """Prove ``key`` to a pair listener and check its proof.

    Raises:
        KVTransferError: it is not a pair listener, refused the key, or did not prove it.
    """
    wire = _Conn(sock)
    hello = wire.recv_exact(len(MAGIC) + _NONCE, deadline, f"handshake with {where}")
    if not hello.startswith(MAGIC):
        raise KVTransferError(f"{where} is not a pdserve pair socket")
    server_nonce, client_nonce = hello[len(MAGIC):], secrets.token_bytes(_NONCE)
    wire.send([client_nonce + _mac(key, b"client", server_nonce, client_nonce)], deadline,
              f"handshake with {where}")
    proof = wire.recv_exact(_MAC, deadline, f"handshake with {where} (refused the key?)")
    if not hmac.compare_digest(proof, _mac(key, b"server", client_nonce, server_nonce)):
        raise KVTransferError(f"the pair socket {where} did not prove the pair key")


__all__ = ["HANDSHAKE_TIMEOUT_S", "MAGIC", "PIECE_BYTES", "SocketPair", "byte_view",
           "refused_total"]
