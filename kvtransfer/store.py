"""The decode worker's KV store, authenticated by the cluster secret.

A pair channel's rendezvous (the gloo and NCCL groups' addresses), its tickets and claims
live in a key-value store that the decode worker hosts at its KV address
(docs/architecture.md, KV transfer). ``torch.distributed.TCPStore`` answers anyone who
reaches its port; this store answers only cluster members. It has TCPStore's semantics
for the operations the KV path uses (``set``, blocking ``get``, ``add``, ``compare_set``,
``check``, ``delete_key``, ``wait``, ``queue_push``, blocking ``queue_pop``), as a
``torch.distributed.Store`` that gloo's and NCCL's rendezvous take as they take TCPStore.

The protocol (``pdkv-store/1``), over one TCP connection per client:

1. handshake, mutual: the server sends ``MAGIC`` and a 16-byte nonce ``Ns``; the client
   answers its nonce ``Nc`` and ``HMAC-SHA256(K, "client" | Ns | Nc)``; the server checks
   it (a client without the key is dropped, ``HANDSHAKE_TIMEOUT_S`` at most) and proves
   the key in turn with ``HMAC-SHA256(K, "server" | Nc | Ns)``, so a client never talks
   to an impostor. ``K`` is ``ClusterAuth.kv_key`` (derived from the cluster secret).
2. frames: ``u32 length | body | tag``, ``tag = HMAC-SHA256(Ks, direction | u64 seq |
   body)[:16]`` under the session key ``Ks = HMAC-SHA256(K, "session" | Ns | Nc)``, with
   a counter per direction: a frame altered, replayed, reordered or injected into the
   connection ends it. Frames are not encrypted (nothing secret crosses: addresses,
   tickets, claims); bodies are at most ``MAX_FRAME_BYTES``.

Bodies are an opcode byte and length-prefixed byte strings (``_pack``); replies a status
byte (``_OK``, ``_TIMEOUT``, ``_ERROR``) and the same.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections import deque

import torch.distributed as dist

logger = logging.getLogger(__name__)

MAGIC = b"pdkv-store/1\n"
HANDSHAKE_TIMEOUT_S = 5.0  # a connection must prove the key within this
MAX_HANDSHAKES = 64  # connections still in their handshake at once; more are closed
MAX_FRAME_BYTES = 1 << 20
REFUSAL_LOG_INTERVAL_S = 10.0
_NONCE = 16
_MAC = 32
_TAG = 16
_OK, _TIMEOUT, _ERROR = 0, 1, 2
(_SET, _GET, _ADD, _CAS, _CHECK, _DELETE, _WAIT, _QPUSH, _QPOP, _NUMKEYS) = range(1, 11)
_MAX_WAIT_S = 3600.0


class StoreAuthError(dist.DistStoreError):
    """The peer did not prove the cluster's KV key (or a frame failed its tag)."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _pack(*fields: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _unpack(data: bytes, offset: int = 0) -> list[bytes]:
    fields = []
    while offset < len(data):
        if offset + 4 > len(data):
            raise ValueError("truncated field")
        (n,) = struct.unpack_from(">I", data, offset)
        offset += 4
        if offset + n > len(data):
            raise ValueError("truncated field")
        fields.append(data[offset:offset + n])
        offset += n
    return fields


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def _as_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _timedelta_s(value) -> float:
    return value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)


class _Framed:
    """One authenticated connection's frames (see the module docstring). ``send`` and
    ``recv`` are each called by one thread at a time."""

    def __init__(self, sock: socket.socket, session_key: bytes, server: bool) -> None:
        self.sock = sock
        self._key = session_key
        self._out, self._in = (b"S", b"C") if server else (b"C", b"S")
        self._send_seq = 0
        self._recv_seq = 0

    def send(self, body: bytes) -> None:
        tag = _mac(self._key, self._out, struct.pack(">Q", self._send_seq), body)[:_TAG]
        self._send_seq += 1
        self.sock.sendall(struct.pack(">I", len(body)) + body + tag)

    def recv(self) -> bytes:
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if n > MAX_FRAME_BYTES:
            raise StoreAuthError(f"a frame of {n} bytes (limit {MAX_FRAME_BYTES})")
        body = _recv_exact(self.sock, n)
        tag = _recv_exact(self.sock, _TAG)
        want = _mac(self._key, self._in, struct.pack(">Q", self._recv_seq), body)[:_TAG]
        if not hmac.compare_digest(tag, want):
            raise StoreAuthError("a frame failed its authentication tag")
        self._recv_seq += 1
        return body


class _State:
    """The store's keys and queues, shared by the server's connections and local
    clients; every blocking operation waits on one condition with a deadline."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.keys: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}
        self.closed = False

    def _wait_for(self, predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + min(timeout_s, _MAX_WAIT_S)
        while not predicate():
            remaining = deadline - time.monotonic()
            if self.closed or remaining <= 0:
                return False
            self.cond.wait(remaining)
        return True

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.keys[key] = value
            self.cond.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes | None:
        with self.cond:
            if not self._wait_for(lambda: key in self.keys, timeout_s):
                return None
            return self.keys[key]

    def add(self, key: str, amount: int) -> int:
        with self.cond:
            value = int(self.keys.get(key, b"0")) + amount
            self.keys[key] = str(value).encode()
            self.cond.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's: set ``desired`` if the value is ``expected`` (a missing key
        matches ``b""``); return the value now held (``expected`` for a missing key
        that did not match)."""
        with self.cond:
            current = self.keys.get(key)
            if (current is None and expected == b"") or current == expected:
                self.keys[key] = desired
                self.cond.notify_all()
                return desired
            return expected if current is None else current

    def check(self, keys: list[str]) -> bool:
        with self.cond:
            return all(k in self.keys for k in keys)

    def delete(self, key: str) -> bool:
        with self.cond:
            return self.keys.pop(key, None) is not None

    def wait(self, keys: list[str], timeout_s: float) -> bool:
        with self.cond:
            return self._wait_for(lambda: all(k in self.keys for k in keys), timeout_s)

    def queue_push(self, key: str, value: bytes) -> None:
        with self.cond:
            self.queues.setdefault(key, deque()).append(value)
            self.cond.notify_all()

    def queue_pop(self, key: str, timeout_s: float) -> bytes | None:
        with self.cond:
            if not self._wait_for(lambda: bool(self.queues.get(key)), timeout_s):
                return None
            queue = self.queues[key]
            value = queue.popleft()
            if not queue:
                del self.queues[key]
            return value

    def num_keys(self) -> int:
        with self.cond:
            return len(self.keys)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class _StoreClient(dist.Store):
    """The ``torch.distributed.Store`` interface over ``_call``; errors as TCPStore's
    (``DistStoreError``, a RuntimeError, for a timeout)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s

    def set_timeout(self, timeout) -> None:
        self._timeout_s = _timedelta_s(timeout)

    def _call(self, op: int, *fields: bytes, timeout_s: float | None = None,
              what: str = "") -> list[bytes]:
        """Run ``op``; its reply's fields. Raises DistStoreError (a timeout: ``what``)."""
        raise NotImplementedError

    def _timeout(self, what: str) -> dist.DistStoreError:
        return dist.DistStoreError(f"KV store: {what} timed out after {self._timeout_s} s")

    def set(self, key, value) -> None:
        self._call(_SET, _as_bytes(key), _as_bytes(value))

    def get(self, key) -> bytes:
        (value,) = self._call(_GET, _as_bytes(key), what=f"get({key})")
        return value

    def add(self, key, amount) -> int:
        (value,) = self._call(_ADD, _as_bytes(key), str(int(amount)).encode())
        return int(value)

    def compare_set(self, key, expected, desired) -> bytes:
        (value,) = self._call(_CAS, _as_bytes(key), _as_bytes(expected), _as_bytes(desired))
        return value

    def check(self, keys) -> bool:
        (value,) = self._call(_CHECK, *(_as_bytes(k) for k in keys))
        return value == b"1"

    def delete_key(self, key) -> bool:
        (value,) = self._call(_DELETE, _as_bytes(key))
        return value == b"1"

    def wait(self, keys, timeout=None) -> None:
        timeout_s = self._timeout_s if timeout is None else _timedelta_s(timeout)
        self._call(_WAIT, *(_as_bytes(k) for k in keys), timeout_s=timeout_s,
                   what=f"wait({list(keys)})")

    def queue_push(self, key, value) -> None:
        self._call(_QPUSH, _as_bytes(key), _as_bytes(value))

    def queue_pop(self, key, block: bool = True) -> bytes:
        (value,) = self._call(_QPOP, _as_bytes(key), timeout_s=self._timeout_s if block else 0,
                              what=f"queue_pop({key})")
        return value

    def num_keys(self) -> int:
        (value,) = self._call(_NUMKEYS)
        return int(value)


def _serve(state: _State, op: int, fields: list[bytes], timeout_s: float
           ) -> tuple[int, list[bytes]]:
    """Run one operation on ``state``: (status, reply fields)."""
    key = fields[0].decode() if fields else ""
    if op == _SET:
        state.set(key, fields[1])
    elif op == _GET:
        value = state.get(key, timeout_s)
        return (_TIMEOUT, []) if value is None else (_OK, [value])
    elif op == _ADD:
        return _OK, [str(state.add(key, int(fields[1]))).encode()]
    elif op == _CAS:
        return _OK, [state.compare_set(key, fields[1], fields[2])]
    elif op == _CHECK:
        return _OK, [b"1" if state.check([f.decode() for f in fields]) else b"0"]
    elif op == _DELETE:
        return _OK, [b"1" if state.delete(key) else b"0"]
    elif op == _WAIT:
        ok = state.wait([f.decode() for f in fields], timeout_s)
        return (_OK, []) if ok else (_TIMEOUT, [])
    elif op == _QPUSH:
        state.queue_push(key, fields[1])
    elif op == _QPOP:
        value = state.queue_pop(key, timeout_s)
        return (_TIMEOUT, []) if value is None else (_OK, [value])
    elif op == _NUMKEYS:
        return _OK, [str(state.num_keys()).encode()]
    else:
        return _ERROR, [f"unknown operation {op}".encode()]
    return _OK, [b""] if op in (_SET, _QPUSH) else []


class LocalStore(_StoreClient):
    """The hosting process's own client of a ``KVStoreServer`` (no socket)."""

    def __init__(self, state: _State, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self._state = state

    def clone(self) -> LocalStore:
        return LocalStore(self._state, self._timeout_s)

    def _call(self, op: int, *fields: bytes, timeout_s: float | None = None,
              what: str = "") -> list[bytes]:
        status, reply = _serve(self._state, op, list(fields),
                               self._timeout_s if timeout_s is None else timeout_s)
        if status == _TIMEOUT:
            raise self._timeout(what)
        if status != _OK:
            raise dist.DistStoreError(f"KV store: {reply[0].decode(errors='replace')}")
        return reply


class RemoteStore(_StoreClient):
    """A client of a ``KVStoreServer`` at ``host:port`` that proves ``key``. Operations
    are serialised (one connection); ``clone`` opens another connection.

    Args:
        host, port: the server's address.
        key: the cluster's KV key (``ClusterAuth.kv_key``).
        timeout_s: seconds to connect and authenticate, and each blocking operation's
            default wait.

    Raises:
        StoreAuthError: the server did not prove the key.
        ConnectionError, OSError: it could not be reached.
    """

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.host, self.port, self._key = host, port, key
        self._lock = threading.Lock()
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise dist.DistNetworkError(f"cannot reach the KV store at {host}:{port}: "
                                        f"{exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _recv_exact(sock, len(MAGIC) + _NONCE)
            if not hello.startswith(MAGIC):
                raise StoreAuthError(f"{host}:{port} is not a pdserve KV store")
            server_nonce, client_nonce = hello[len(MAGIC):], secrets.token_bytes(_NONCE)
            sock.sendall(client_nonce + _mac(key, b"client", server_nonce, client_nonce))
            try:
                proof = _recv_exact(sock, _MAC)
            except ConnectionError:
                raise StoreAuthError(f"the KV store at {host}:{port} refused this cluster's "
                                     "key (another cluster secret?)") from None
            if not hmac.compare_digest(proof, _mac(key, b"server", client_nonce, server_nonce)):
                raise StoreAuthError(f"the KV store at {host}:{port} did not prove the "
                                     "cluster secret")
        except OSError as exc:
            sock.close()
            raise dist.DistNetworkError(f"KV store at {host}:{port}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        self._conn = _Framed(sock, _mac(key, b"session", server_nonce, client_nonce),
                             server=False)

    def clone(self) -> RemoteStore:
        return RemoteStore(self.host, self.port, self._key, self._timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        self._conn.sock.close()

    def _call(self, op: int, *fields: bytes, timeout_s: float | None = None,
              what: str = "") -> list[bytes]:
        wait_s = self._timeout_s if timeout_s is None else timeout_s
        body = bytes([op]) + struct.pack(">d", wait_s) + _pack(*fields)
        with self._lock:
            try:
                # NOTE: a blocking op is bounded by the server; the socket waits a little more
                self._conn.sock.settimeout(wait_s + HANDSHAKE_TIMEOUT_S)
                self._conn.send(body)
                reply = self._conn.recv()
            except (OSError, ValueError) as exc:
                raise dist.DistStoreError(f"KV store at {self.host}:{self.port}: {exc}") from exc
        status, fields_out = reply[0], _unpack(reply, 1)
        if status == _TIMEOUT:
            raise self._timeout(what)
        if status != _OK:
            raise dist.DistStoreError(
                f"KV store: {fields_out[0].decode(errors='replace') if fields_out else status}")
        return fields_out


class KVStoreServer:
    """Serves a ``_State`` at ``host:port`` to clients that prove ``key``.

    Args:
        host: the address to bind (only it).
        port: 0 picks a free one; ``self.port`` is the bound one.
        key: the cluster's KV key (``ClusterAuth.kv_key``), 32 bytes.
        timeout_s: the default wait of ``local()`` clients' blocking operations.

    Raises:
        RuntimeError: the address cannot be bound (taken, or not this machine's).

    A connection that does not complete the handshake within ``HANDSHAKE_TIMEOUT_S`` is
    closed; at most ``MAX_HANDSHAKES`` are in their handshake at once (more are closed at
    once). ``rejected`` counts connections refused; they are logged at most once per
    ``REFUSAL_LOG_INTERVAL_S`` (with how many were refused since), so a flood of them
    cannot flood the log.
    """

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float = 30.0) -> None:
        self.state = _State()
        self._key = key
        self._timeout_s = timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(512)
        except OSError as exc:
            self._sock.close()
            raise RuntimeError(f"cannot listen on {host}:{port} for the KV store: "
                               f"{exc.strerror or exc}") from None
        self.host, self.port = host, self._sock.getsockname()[1]
        self.rejected = 0
        self._last_report = (-REFUSAL_LOG_INTERVAL_S, 0)  # (monotonic s, rejected then)
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True,
                                        name=f"kv-store-{self.port}")
        self._thread.start()

    def local(self) -> LocalStore:
        """A client for this process (no socket, no handshake)."""
        return LocalStore(self.state, self._timeout_s)

    def close(self) -> None:
        """Stop accepting, drop every connection, wake every blocked operation."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        self.state.close()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5.0)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            if not self._handshakes.acquire(blocking=False):
                self._refused(peer, f"{MAX_HANDSHAKES} handshakes under way")
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve_conn, args=(conn, peer), daemon=True,
                             name=f"kv-store-conn-{self.port}").start()

    def _refused(self, peer, reason: str) -> None:
        """Count a refused connection; log it unless one was logged in the last
        ``REFUSAL_LOG_INTERVAL_S``."""
        now = time.monotonic()
        with self._lock:
            self.rejected += 1
            last_s, last_count = self._last_report
            if now - last_s < REFUSAL_LOG_INTERVAL_S:
                return
            self._last_report = (now, self.rejected)
            since = self.rejected - last_count - 1
        logger.warning("KV store %s:%d refused a connection from %s: %s%s", self.host,
                       self.port, peer, reason,
                       f" ({since} more refused since the last report)" if since else "")

    def _handshake(self, conn: socket.socket, peer) -> _Framed:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_nonce = secrets.token_bytes(_NONCE)
            conn.sendall(MAGIC + server_nonce)
            answer = _recv_exact(conn, _NONCE + _MAC)
            client_nonce, proof = answer[:_NONCE], answer[_NONCE:]
            if not hmac.compare_digest(proof, _mac(self._key, b"client", server_nonce,
                                                   client_nonce)):
                raise StoreAuthError("wrong key")
            conn.sendall(_mac(self._key, b"server", client_nonce, server_nonce))
            conn.settimeout(None)
            return _Framed(conn, _mac(self._key, b"session", server_nonce, client_nonce),
                           server=True)
        finally:
            self._handshakes.release()

    def _serve_conn(self, conn: socket.socket, peer) -> None:
        try:
            try:
                framed = self._handshake(conn, peer)
            except (OSError, StoreAuthError) as exc:
                self._refused(peer, str(exc) or type(exc).__name__)
                return
            while True:
                body = framed.recv()
                if len(body) < 9:
                    raise StoreAuthError("a malformed request")
                (timeout_s,) = struct.unpack_from(">d", body, 1)
                try:
                    status, reply = _serve(self.state, body[0], _unpack(body, 9),
                                           max(0.0, timeout_s))
                except (ValueError, IndexError, UnicodeDecodeError) as exc:
                    status, reply = _ERROR, [f"malformed request: {exc}".encode()]
                framed.send(bytes([status]) + _pack(*reply))
        except (OSError, StoreAuthError):
            pass  # the client left, or broke the protocol: drop it
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()


__all__ = ["HANDSHAKE_TIMEOUT_S", "KVStoreServer", "LocalStore", "RemoteStore",
           "StoreAuthError"]
