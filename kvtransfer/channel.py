"""A pair channel's group: 2 ranks, made from a store, no global init.

Rank 0 is the prefill worker, rank 1 the decode worker, which hosts the store
(``store.KVStoreServer``). The ranks first trade their devices through the store. When
both ends are on distinct CUDA devices, payloads go over NCCL and headers over gloo,
tagged per transfer. Otherwise everything goes over the pair socket
(``socket_pair.SocketPair``: one TCP connection whose ends prove ``auth.pair_key``
before any byte moves): a header, the payload's block tags (``auth.BlockTagger``'s records),
the payload, and a GMAC tag over header and records (``auth.PayloadDigest``); the receiver
checks each block's tag as it lands (``auth.BlockVerifier``). Either way transfers on one
pair may overlap.

NOTE: a socket pair, like a gloo group, that saw any error is aborted and never reused.

NOTE: a gloo wait that times out closes the whole pair (gloo signals the timeout to
every pending operation), so a group that saw any error is aborted and never reused;
the next transfer makes a new one under a new generation (see ``receiver.py``).

NOTE: an NCCL ``Work.wait`` does not block the host (it only orders the caller's CUDA
stream after NCCL's), so NCCL payloads are waited for by polling ``is_completed`` up to
the transfer's deadline, and a group whose op is past it is aborted like a gloo one. The
NCCL group's own timeout is longer than any transfer's, and its watchdog is told not to
end the process on an error (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` unless the operator set
it): a failed pair costs one pull, never the worker. Nor does it reach other pairs: every
pair of a decode worker shares its store, and ``ProcessGroupNCCL`` writes a failed
op's flight-recorder dump signal under the store's root key, which every other NCCL group
on that store (other prefill workers', a restarted one's) polls, dumps on and then ends
its process for; and the flight recorder's watchdog takes the GIL to print a failed op's
Python stack, while dropping the failed group joins that watchdog with the GIL held (a
deadlock, seen on an H100). So pair groups run without the dump, the heartbeat monitor
and the flight recorder (``TORCH_NCCL_DUMP_ON_TIMEOUT=0``,
``TORCH_NCCL_ENABLE_MONITORING=0``, ``TORCH_FR_BUFFER_SIZE=0``, always).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pdserve.kvtransfer.auth import (
    TRAILER_NUMEL,
    BlockVerifier,
    PayloadDigest,
    pair_key,
    records_numel,
)
from pdserve.kvtransfer.payload import PayloadSink, PayloadSource
from pdserve.kvtransfer.protocol import HEADER_NUMEL, KVTransferError
from pdserve.kvtransfer.socket_pair import SocketPair


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def describe_device(device: torch.device) -> str:
    """``"cpu"`` or ``"cuda:<uuid>[@<NCCL_HOSTID>]"``: what the peer needs to pick a
    backend. Two ends on distinct devices, as NCCL tells them apart, use NCCL: NCCL
    refuses two ranks on one GPU ("Duplicate GPU detected") unless their ``NCCL_HOSTID``
    differ, which makes it treat them as two hosts (its network transport)."""
    if device.type != "cuda":
        return "cpu"
    name = f"cuda:{torch.cuda.get_device_properties(device).uuid}"
    host_id = os.environ.get("NCCL_HOSTID")
    return f"{name}@{host_id}" if host_id else name


def _wait(work, deadline: float, what: str) -> None:
    """Wait for a send/recv with the time left before ``deadline`` (monotonic seconds).

    Raises:
        KVTransferError: timed out, the peer closed the connection, or the op failed.
    """
    timeout_s = deadline - time.monotonic()
    try:
        if timeout_s <= 0 or work.wait(_timedelta(timeout_s)) is False:
            raise KVTransferError(f"{what}: timed out")
    except KVTransferError:
        raise
    except Exception as exc:  # gloo/NCCL raise RuntimeError or DistError subclasses
        raise KVTransferError(f"{what}: {exc}") from exc


_FORGED = ("the payload's tag is not its sender's: its bytes were altered or injected, or "
           "the sender holds another cluster secret")
_FORGED_BLOCK = ("a block's tag is not its sender's: its bytes were altered or injected, "
                 "it holds other tokens than this prompt's, or the sender holds another "
                 "cluster secret")

CLOSE_ABORT_WAIT_S = 10.0
"""Seconds a closing sender or receiver waits for each NCCL group's abort."""

_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


def _wait_device(work, deadline: float, what: str) -> None:
    """Wait for an NCCL send/recv until ``deadline`` (monotonic seconds) by polling its
    completion (an NCCL ``wait`` returns at once on the host), then order the current
    CUDA stream after it.

    Raises:
        KVTransferError: timed out, or the op failed (the peer died, the group aborted).
    """
    delay = _POLL_MIN_S
    try:
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise KVTransferError(f"{what}: timed out")
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
        work.wait()  # NOTE: raises the op's error, if it failed
    except KVTransferError:
        raise
    except Exception as exc:
        raise KVTransferError(f"{what}: {exc}") from exc


@dataclass(slots=True)
class PostedRecv:
    """What ``PairGroup.post_recv`` returns over the pair socket (which posts nothing:
    the kernel buffers what arrives first): the int64 header buffer. The other fields
    are unused (they were gloo's posted receives)."""

    header: torch.Tensor
    header_work: object
    chunk_works: list = field(default_factory=list)
    busy_slots: set = field(default_factory=set)


class PairGroup:
    """The 2-rank group of one (prefill, decode) pair at one generation.

    Thread-safe: several transfers may be in flight (each with its own tag). With a
    CUDA cache, call ``send`` / ``recv`` under ``torch.cuda.device(cache.device)``.
    """

    def __init__(self, rank: int, gloo, nccl=None, sock: SocketPair | None = None) -> None:
        self.rank = rank
        self.peer = 1 - rank
        self._gloo = gloo
        self._nccl = nccl
        self._sock = sock
        self._send_lock = threading.Lock()
        self._next_send_seq = 0
        self._turn = threading.Condition()
        self._next_recv_seq = 0
        self._nccl_abort: threading.Thread | None = None
        self.broken = False

    @property
    def device_payload(self) -> bool:
        """True when payloads move as CUDA tensors (NCCL)."""
        return self._nccl is not None

    @classmethod
    def make(cls, store: dist.Store, prefix: str, rank: int, host: str,
             device: torch.device, timeout_s: float, *, kv_key: bytes) -> PairGroup:
        """Rendezvous with the peer through ``store`` under ``prefix`` and connect.

        Args:
            store: a client of the decode worker's store that this call may block
                (a store client serialises its operations).
            prefix: unique per pair and generation.
            rank: 0 (prefill) or 1 (decode).
            host: the local address to listen on (decode; gloo binds to it too).
            device: the local KV cache's device.
            timeout_s: seconds to wait for the peer.
            kv_key: the cluster's KV key (``ClusterAuth.kv_key``): the pair socket's
                handshake proves its ``auth.pair_key``.

        Raises:
            KVTransferError: the peer did not show up in time, or connecting failed.
        """
        pstore = dist.PrefixStore(prefix, store)
        try:
            store.set_timeout(_timedelta(timeout_s))
            mine = describe_device(device)
            pstore.set(f"device/{rank}", mine)
            peer_device = pstore.get(f"device/{1 - rank}").decode()
            if not (mine.startswith("cuda:") and peer_device.startswith("cuda:")
                    and mine != peer_device):
                # NOTE: the decode side's host as the prefill side reached its store
                peer_host = host if rank == 1 else getattr(store, "host", host)
                sock = SocketPair.connect(pstore, rank, peer_host,
                                          pair_key(kv_key, prefix), timeout_s)
                return cls(rank, None, sock=sock)
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = _timedelta(timeout_s)
            gloo = dist.ProcessGroupGloo(pstore, rank, 2, opts)
            nccl = _make_nccl(pstore, rank, device, timeout_s)
        except Exception as exc:
            raise KVTransferError(f"making the pair group {prefix} (rank {rank}) failed: "
                                  f"{exc}") from exc
        return cls(rank, gloo, nccl)

    def send(self, make_header: Callable[[int], torch.Tensor], source: PayloadSource,
             tag: int, deadline: float, digest: PayloadDigest,
             records: Callable[[], torch.Tensor] | None = None) -> int:
        """Send a header, then (pair socket) the payload's block tags (``records()``, the
        ``auth.BlockTagger`` records frame), the payload's chunks, and the GMAC tag of
        header and records (``digest``); return the payload bytes.

        Args:
            make_header: seq -> int64[HEADER_NUMEL]; seq numbers this group's payloads
                (NCCL receivers take them in that order).
            source: the payload (``payload.PayloadSource``); over the socket a staged
                chunk is gathered once the chunk before it was sent.
            tag: the transfer's tag, from the receiver's ticket.
            deadline: ``time.monotonic()`` seconds by which everything must be sent.
            digest: this transfer's, fresh (socket only; NOTE: payloads over NCCL are not
                tagged yet).
            records: the payload's records frame, ``int64[auth.records_numel(n)]``
                (socket only; called once the send's turn on the pair has come).

        Raises:
            KVTransferError: sending failed, or the deadline passed.
        """
        if self._sock is not None:
            if records is None:
                raise ValueError("a send over the pair socket needs its block records")
            return self._send_socket(make_header, source, tag, deadline, digest, records)
        try:
            # NOTE: over NCCL the payload is gathered before the header goes: the receiver
            # posts its NCCL receive on the header, and a receive whose send never comes
            # holds a kernel on its GPU until the group is aborted
            gathered = [source.chunk(c) for c in range(source.num_chunks)]
            with self._send_lock:  # NOTE: payloads are posted in seq order
                header = make_header(self._next_send_seq)
                self._next_send_seq += 1
                header_work = self._gloo.send([header], self.peer, tag)
                works = [self._nccl.send([wire], self.peer, tag) for wire in gathered]
        except KVTransferError:
            raise
        except Exception as exc:
            raise KVTransferError(f"posting a send failed: {exc}") from exc
        # NOTE: two streams: the header's (gloo) and NCCL's
        _wait(header_work, deadline, "sending the header")
        # NOTE: complete on the GPU before returning: the chunks may be views of blocks the
        # caller releases once this returns
        _wait_device(works[-1], deadline, "sending the payload")
        return sum(wire.numel() for wire in gathered)

    def post_recv(self, sink: PayloadSink, tag: int,
                  max_chunks: int | None = None) -> PostedRecv | None:
        """Before the sender starts: a ``PostedRecv`` over the pair socket, which needs
        nothing posted (the kernel buffers what arrives first, until ``recv`` reads it
        straight into the sink); None over NCCL, whose payloads are posted in the
        sender's seq order. Safe to drop for good on a tag the sender never sends on (the
        claim protocol's give-up). ``sink`` and ``max_chunks`` are unused.

        Raises:
            KVTransferError: the group is closed.
        """
        if self._nccl is not None:
            return None
        if self._sock.closed:
            raise KVTransferError("posting receives failed: the pair socket is closed")
        return PostedRecv(torch.zeros(HEADER_NUMEL, dtype=torch.int64), None)

    def post_more(self, sink: PayloadSink, tag: int, posted: PostedRecv,
                  max_chunks: int | None = None) -> None:
        """Nothing to post over the pair socket (see ``post_recv``); kept so that the
        pull's transitions stay the same whatever the transport."""

    def recv(self, sink: PayloadSink, tag: int, deadline: float,
             check_header: Callable[[torch.Tensor], int],
             posted: PostedRecv | None = None, digest: PayloadDigest | None = None,
             verifier: Callable[[torch.Tensor], BlockVerifier] | None = None) -> None:
        """Receive a header, then (pair socket) the payload's block records, the payload's
        chunks into the sink (scattering each staged one as it lands), each block checked
        as it lands by ``verifier(records)``, and the sender's GMAC tag of header and
        records, which must equal ``digest``'s.

        Args:
            sink: where the chunks go; its sizes come from the receiver's ticket.
            tag: the transfer's tag.
            deadline: ``time.monotonic()`` seconds by which everything must arrive.
            check_header: validates the int64[HEADER_NUMEL] header (raising
                KVTransferError) and returns its seq.
            posted: what ``post_recv(sink, tag)`` returned, if called before (unused).
            digest: this transfer's, fresh; None receives the tag without checking it
                (a drained payload, discarded anyway).
            verifier: makes the payload's ``auth.BlockVerifier`` from the records frame;
                None (with ``digest`` None: a drain) checks no block.

        Over NCCL the header comes over gloo and the payload (one chunk) is posted after
        it, in the sender's seq order, and carries no tag yet.

        Raises:
            KVTransferError: a bad header, a failed or timed-out receive, or a payload
                whose tag is not the sender's (then nothing of it may be used).
        """
        if self._sock is not None:
            self._recv_socket(sink, tag, deadline, check_header, digest, verifier)
            return
        header = torch.zeros(HEADER_NUMEL, dtype=torch.int64)
        header_work = self._post(self._gloo, [header], tag)[0]
        _wait(header_work, deadline, "receiving the header")
        works = self._post_in_turn(sink, tag, check_header(header), deadline)
        _wait_device(works[-1], deadline, "receiving the payload")

    def _send_socket(self, make_header: Callable[[int], torch.Tensor], source: PayloadSource,
                     tag: int, deadline: float, digest: PayloadDigest,
                     records: Callable[[], torch.Tensor]) -> int:
        """``send`` over the pair socket: the transfer's frames in a row (header, records,
        chunks, trailer); ``digest`` covers header and records."""
        if not self._send_lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise KVTransferError("sending: timed out waiting for the pair's earlier sends")
        try:
            header = make_header(self._next_send_seq)
            self._next_send_seq += 1
            self._sock.send_frame(tag, header, deadline, digest)
            self._sock.send_frame(tag, records(), deadline, digest)
            num_bytes = 0
            for c in range(source.num_chunks):
                # NOTE: each frame is sent whole before the next chunk is gathered, so a
                # ring slot is free again at once
                num_bytes += self._sock.send_frame(tag, source.chunk(c), deadline)
            self._sock.send_frame(tag, digest.trailer(), deadline)
            return num_bytes
        except KVTransferError:
            raise
        except Exception as exc:
            raise KVTransferError(f"sending failed: {exc}") from exc
        finally:
            self._send_lock.release()

    def _recv_socket(self, sink: PayloadSink, tag: int, deadline: float,
                     check_header: Callable[[torch.Tensor], int],
                     digest: PayloadDigest | None,
                     verifier: Callable[[torch.Tensor], BlockVerifier] | None) -> None:
        """``recv`` over the pair socket: waits for the transfer's turn on the
        connection, then reads each frame straight into its buffer, checking each block
        as it lands; checks the trailer (``PayloadDigest.verify``) and the blocks' tags
        (``BlockVerifier.ok``)."""
        header = torch.zeros(HEADER_NUMEL, dtype=torch.int64)
        trailer = torch.zeros(TRAILER_NUMEL, dtype=torch.int64)
        self._sock.acquire(tag, deadline)
        try:
            self._sock.recv_frame(tag, header, deadline, digest)
            check_header(header)
            records = torch.zeros(records_numel(len(sink.block_ids)), dtype=torch.int64)
            self._sock.recv_frame(tag, records, deadline, digest)
            checker = None
            if verifier is not None:
                try:
                    checker = verifier(records)
                except ValueError as exc:
                    raise KVTransferError(f"bad block records: {exc}") from exc
            landed = checker.landed if checker is not None else None
            for c in range(sink.num_chunks):
                self._sock.recv_frame(tag, sink.buffer(c), deadline, on_landed=landed)
                sink.chunk_done(c)
            self._sock.recv_frame(tag, trailer, deadline)
        finally:
            self._sock.release()
        if digest is not None and not digest.verify(trailer):
            raise KVTransferError(_FORGED)
        if checker is not None and not checker.ok():
            raise KVTransferError(_FORGED_BLOCK)

    def _post_in_turn(self, sink: PayloadSink, tag: int, seq: int, deadline: float) -> list:
        with self._turn:
            if not self._turn.wait_for(lambda: self._next_recv_seq == seq or self.broken,
                                       max(deadline - time.monotonic(), 0)):
                raise KVTransferError(f"payload {seq} never got its turn")
            try:
                return self._post(self._nccl, [sink.buffer(c) for c in range(sink.num_chunks)],
                                  tag)
            finally:
                self._next_recv_seq += 1
                self._turn.notify_all()

    def _post(self, group, buffers: list[torch.Tensor], tag: int) -> list:
        try:
            return [group.recv([buffer], self.peer, tag) for buffer in buffers]
        except Exception as exc:
            raise KVTransferError(f"posting receives failed: {exc}") from exc

    def abort(self, wait_s: float = 0.0) -> None:
        """Mark broken and close the connections; the peer's pending ops then fail.

        NCCL's abort runs on a thread of its own, waited for ``wait_s`` seconds at most
        (0 on a transfer's failure; a few seconds when the process closes its channels,
        so that it does not exit with the abort still running, which ends a process with
        SIGABRT)."""
        self.broken = True
        with self._turn:
            self._turn.notify_all()
        if self._sock is not None:
            self._sock.close()
        if self._gloo is not None:
            _abort_quietly(self._gloo)
        if self._nccl is not None and self._nccl_abort is None:
            # NOTE: ncclCommAbort can block for long (its proxy thread waiting on a dead
            # peer's socket, its frees on a receive kernel still spinning), so it never
            # runs on a transfer's or the caller's thread
            self._nccl_abort = threading.Thread(target=_abort_quietly, args=(self._nccl,),
                                                daemon=True, name="nccl-abort")
            self._nccl_abort.start()
        if self._nccl_abort is not None and wait_s > 0:
            self._nccl_abort.join(wait_s)


def _abort_quietly(group) -> None:
    with contextlib.suppress(RuntimeError):  # best effort on a group already failing
        group.abort()


_NCCL_WATCHDOG_S = 600.0
"""The NCCL group's own op timeout: past every transfer's deadline, so that pdserve's
polling (``_wait_device``) times an op out and aborts the group first."""


def _make_nccl(pstore: dist.Store, rank: int, device: torch.device, timeout_s: float):
    # NOTE: read when the group is made; 0 leaves errors to the ops' waits, where the
    # default (3) would end this process when the peer dies or an op times out
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    # NOTE: forced, not defaults (module docstring): no dump signal through the shared
    # store, no heartbeat monitor to end the process, no flight recorder whose watchdog
    # takes the GIL (dropping a failed group joins that watchdog with the GIL held)
    os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "0"
    os.environ["TORCH_NCCL_ENABLE_MONITORING"] = "0"
    os.environ["TORCH_FR_BUFFER_SIZE"] = "0"  # NOTE: its newer name
    os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "0"  # ... and before
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _timedelta(max(timeout_s, _NCCL_WATCHDOG_S))
    with torch.cuda.device(device):
        group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", pstore), rank, 2, opts)
        # NOTE: NCCL makes its communicator at a pair's first op and waits there for the
        # peer with no timeout of its own: one element now, while both ends are making
        # the pair, keeps that out of the first transfer
        probe = torch.zeros(1, device=device)
        work = (group.send if rank == 0 else group.recv)([probe], 1 - rank, 0)
        _wait_device(work, time.monotonic() + timeout_s, "connecting NCCL")
    return group
