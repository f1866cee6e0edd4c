"""A pair channel's process group: 2 ranks, made from a store, no global init.

Rank 0 is the prefill worker, rank 1 the decode worker, which hosts the ``TCPStore``.
Headers always go over gloo, tagged per transfer, so transfers on one pair may overlap.
Payloads go over NCCL when both ends are on distinct CUDA devices, else over gloo.

NOTE: a gloo wait that times out closes the whole pair (gloo signals the timeout to
every pending operation), so a group that saw any error is aborted and never reused;
the next transfer makes a new one under a new generation (see ``receiver.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.kvtransfer.payload import PayloadSink
from pdserve.kvtransfer.protocol import HEADER_NUMEL, KVTransferError


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def describe_device(device: torch.device) -> str:
    """``"cpu"`` or ``"cuda:<uuid>"``: what the peer needs to pick a backend."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


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


def _wait_all(works: list[tuple[str, object]], deadline: float, verb: str) -> None:
    """Wait for all ``(what, work)``, the last first.

    NOTE: the ops of one pair complete in posting order (one stream), so after the last
    one the others return at once: one sleep and wake-up in all instead of one per op.
    Each wake-up costs CPU that, on 2 cores, the copying threads of gloo need (24 per
    side for a 12-layer payload). A gloo send/recv must be waited exactly once (its wait
    consumes the completion; a second one blocks until the timeout).
    Raises KVTransferError as ``_wait``.
    """
    if works:
        works = [works[-1], *works[:-1]]
    for what, work in works:
        _wait(work, deadline, f"{verb} {what}")


@dataclass(slots=True)
class PostedRecv:
    """Receives posted ahead of a transfer (``PairGroup.post_recv``): the int64 header
    buffer and the gloo works of the header and of each plane."""

    header: torch.Tensor
    header_work: object
    plane_works: list


class PairGroup:
    """The 2-rank group of one (prefill, decode) pair at one generation.

    Thread-safe: several transfers may be in flight (each with its own gloo tag). With a
    CUDA cache, call ``send`` / ``recv`` under ``torch.cuda.device(cache.device)``.
    """

    def __init__(self, rank: int, gloo, nccl=None) -> None:
        self.rank = rank
        self.peer = 1 - rank
        self._gloo = gloo
        self._nccl = nccl
        self._send_lock = threading.Lock()
        self._next_send_seq = 0
        self._turn = threading.Condition()
        self._next_recv_seq = 0
        self.broken = False

    @property
    def device_payload(self) -> bool:
        """True when payloads move as CUDA tensors (NCCL)."""
        return self._nccl is not None

    @classmethod
    def make(cls, store: dist.Store, prefix: str, rank: int, host: str,
             device: torch.device, timeout_s: float) -> PairGroup:
        """Rendezvous with the peer through ``store`` under ``prefix`` and connect.

        Args:
            store: a client of the decode worker's store that this call may block
                (the TCPStore client serialises its operations).
            prefix: unique per pair and generation.
            rank: 0 (prefill) or 1 (decode).
            host: the local address gloo binds to.
            device: the local KV cache's device.
            timeout_s: seconds to wait for the peer.

        Raises:
            KVTransferError: the peer did not show up in time, or connecting failed.
        """
        pstore = dist.PrefixStore(prefix, store)
        try:
            store.set_timeout(_timedelta(timeout_s))
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = _timedelta(timeout_s)
            gloo = dist.ProcessGroupGloo(pstore, rank, 2, opts)
            pstore.set(f"device/{rank}", describe_device(device))
            peer_device = pstore.get(f"device/{1 - rank}").decode()
            nccl = None
            mine = describe_device(device)
            if mine.startswith("cuda:") and peer_device.startswith("cuda:") and mine != peer_device:
                nccl = _make_nccl(pstore, rank, device, timeout_s)
        except Exception as exc:
            raise KVTransferError(f"making the pair group {prefix} (rank {rank}) failed: "
                                  f"{exc}") from exc
        return cls(rank, gloo, nccl)

    def send(self, make_header: Callable[[int], torch.Tensor], planes: Iterable[torch.Tensor],
             tag: int, deadline: float) -> int:
        """Send a header, then the payload planes; return the payload bytes.

        Args:
            make_header: seq -> int64[HEADER_NUMEL]; seq numbers this group's payloads
                (NCCL receivers take them in that order).
            planes: the payload's planes in order (see ``payload.iter_send_planes``).
            tag: the transfer's gloo tag, from the receiver's ticket.
            deadline: ``time.monotonic()`` seconds by which everything must be sent.

        Raises:
            KVTransferError: posting or waiting failed, or the deadline passed.
        """
        works, num_bytes = [], 0
        try:
            with self._send_lock:  # NOTE: payloads are posted in seq order
                header = make_header(self._next_send_seq)
                self._next_send_seq += 1
                works.append(("header", self._gloo.send([header], self.peer, tag)))
                payload_group = self._nccl or self._gloo
                for p, plane in enumerate(planes):
                    wire = plane if self._nccl else plane.view(torch.uint8)
                    works.append((f"plane {p}", payload_group.send([wire], self.peer, tag)))
                    num_bytes += plane.numel() * plane.element_size()
        except Exception as exc:
            raise KVTransferError(f"posting a send failed: {exc}") from exc
        _wait_all(works, deadline, "sending")
        if self._nccl is not None:
            # NOTE: NCCL waits only order streams; the planes may be views of blocks the
            # caller releases once this returns.
            torch.cuda.current_stream().synchronize()
        return num_bytes

    def post_recv(self, sink: PayloadSink, tag: int) -> PostedRecv | None:
        """Post the header's and all planes' receives now, before the sender starts (gloo
        only; None over NCCL, whose payloads are posted in the sender's seq order).

        Gloo pairs a send with its receive by a rendezvous (send-ready, receive-ready
        notes); a receive posted before the sender posts its send saves that round trip,
        about 1 ms per transfer on a busy 2-core host. Safe to leave pending for good on
        a tag the sender never sends on (the claim protocol's give-up): drop the returned
        object and gloo forgets the buffers (it holds only weak references).

        Raises:
            KVTransferError: posting failed (the group is closed).
        """
        if self._nccl is not None:
            return None
        header = torch.zeros(HEADER_NUMEL, dtype=torch.int64)
        header_work = self._post(self._gloo, [header], tag)[0]
        plane_works = self._post(self._gloo, [b.view(torch.uint8) for b in sink.buffers], tag)
        return PostedRecv(header, header_work, plane_works)

    def recv(self, sink: PayloadSink, tag: int, deadline: float,
             check_header: Callable[[torch.Tensor], int],
             posted: PostedRecv | None = None) -> None:
        """Receive a header, then the payload planes into ``sink.buffers`` (scattering
        each as it lands).

        Args:
            sink: where the planes go; its sizes come from the receiver's ticket.
            tag: the transfer's gloo tag.
            deadline: ``time.monotonic()`` seconds by which everything must arrive.
            check_header: validates the int64[HEADER_NUMEL] header (raising
                KVTransferError) and returns its seq.
            posted: what ``post_recv(sink, tag)`` returned, if called before.

        Over gloo the plane receives are posted together with the header's (now, unless
        ``posted``), which saves a round trip per plane; over NCCL they are posted after
        the header, in the sender's seq order.

        Raises:
            KVTransferError: a bad header, a failed or timed-out receive.
        """
        if posted is None:
            posted = self.post_recv(sink, tag)
        if posted is None:  # NCCL: header over gloo, then the planes in turn
            header = torch.zeros(HEADER_NUMEL, dtype=torch.int64)
            header_work = self._post(self._gloo, [header], tag)[0]
            _wait(header_work, deadline, "receiving the header")
            plane_works = self._post_in_turn(sink, tag, check_header(header), deadline)
        else:
            _wait(posted.header_work, deadline, "receiving the header")
            check_header(posted.header)
            plane_works = posted.plane_works
        if not sink.copies_planes:
            _wait_all([(f"plane {p}", w) for p, w in enumerate(plane_works)], deadline,
                      "receiving")
            return
        for p, work in enumerate(plane_works):
            _wait(work, deadline, f"receiving plane {p}")
            sink.plane_done(p)

    def _post_in_turn(self, sink: PayloadSink, tag: int, seq: int, deadline: float) -> list:
        with self._turn:
            if not self._turn.wait_for(lambda: self._next_recv_seq == seq or self.broken,
                                       max(deadline - time.monotonic(), 0)):
                raise KVTransferError(f"payload {seq} never got its turn")
            try:
                return self._post(self._nccl, sink.buffers, tag)
            finally:
                self._next_recv_seq += 1
                self._turn.notify_all()

    def _post(self, group, buffers: list[torch.Tensor], tag: int) -> list:
        try:
            return [group.recv([buffer], self.peer, tag) for buffer in buffers]
        except Exception as exc:
            raise KVTransferError(f"posting receives failed: {exc}") from exc

    def abort(self) -> None:
        """Mark broken and close the connections; the peer's pending ops then fail."""
        self.broken = True
        with self._turn:
            self._turn.notify_all()
        for group in (self._nccl, self._gloo):
            if group is not None:
                with contextlib.suppress(RuntimeError):  # best effort on a group already failing
                    group.abort()


def _make_nccl(pstore: dist.Store, rank: int, device: torch.device, timeout_s: float):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _timedelta(timeout_s)
    with torch.cuda.device(device):
        return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", pstore), rank, 2, opts)
