"""The KV-transfer wire protocol: poll states, errors, the header tensor, store keys.

A transfer moves the KV of some of a prompt's blocks from a prefill worker (rank 0) to a
decode worker (rank 1) over their pair channel (docs/architecture.md, KV transfer). What crosses the
wire, per transfer:

1. store (the decode worker's ``store.KVStoreServer``, cluster members only): the decode
   side writes a ``Ticket`` under
   ``{pair}/req/{request_id}/ticket``; the prefill side claims the transfer by
   ``compare_set`` on ``.../claim/{generation}/{tag}`` (``"S"`` = sending, ``"F <reason>"``
   = cannot send) and wakes the decode side through the queue ``CLAIM_QUEUE_KEY``; the
   decode side gives up the same way (``"X"``), so exactly one of them wins.
2. group: a fixed-size ``int64[HEADER_NUMEL]`` header, then the payload block-major,
   ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``, as messages of whole
   blocks, cut as the decode side's ticket says (``payload.plan_chunks``). A quantized
   cache's blocks go as their bytes, ``[n, block_bytes]``: values and scales together.

Both carry the ``KVGeometry``; a sender whose geometry differs from its ticket's (another
KV cache dtype, model or block size) refuses the pull before any channel is made, naming
both sides.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import threading
from dataclasses import dataclass

import torch

HEADER_NUMEL = 16
_MAGIC = 0x70645F6B76  # "pd_kv"
# 5: block tags (a records frame after the header, kvtransfer/auth.py); 4: a GMAC tag
# after the payload; 3: geometry with scales and block bytes; 2: block-major chunks;
# 1: planes
_VERSION = 5

# NOTE: codes are part of the wire format; append, never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
    torch.uint8: 5, torch.int8: 6,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
for _name, _code in (("float8_e4m3fn", 7), ("float8_e5m2", 8)):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code
        _CODE_DTYPES[_code] = getattr(torch, _name)


class KVPollState(enum.Enum):
    """Where a transfer is (SGLang's ``KVPoll``): the channel is being made, the peer has
    not started sending, bytes are moving, or it ended."""

    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (KVPollState.SUCCESS, KVPollState.FAILED)


class KVTransferError(RuntimeError):
    """A transfer failed: timed out, the peer went away, or the two sides disagree on
    what to move. It fails that request alone; the channel is remade on next use."""


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What one block of a worker's KV cache is, as bytes: ``[num_layers, 2, block_size,
    num_kv_heads, head_dim]`` values of ``dtype``; for a quantized cache (int8, fp8) its
    fp32 scales ``[num_layers, 2, num_kv_heads]`` from byte ``scales_offset`` (0: a float
    cache, no scales); ``block_bytes`` the whole block (values, scales and padding). The
    transfer moves blocks as these bytes and never reads them."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scales_offset: int
    block_bytes: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> KVGeometry:
        """The geometry of ``kv_cache`` (and of a quantized cache's ``kv_scales``).

        Raises ValueError unless ``kv_cache`` is a 6-d KV cache, contiguous or the
        layer-major view of block-major storage (``block_major``), or, with ``kv_scales``
        (``[num_layers, 2, num_blocks, num_kv_heads]`` fp32), the values view of
        block storage whose blocks hold their scales (``engine/kv_cache_layout.py``), or a
        tensor-parallel worker's ``KVShards`` (all its ranks' heads, ``kernels/kv_shards.py``)."""
        if not isinstance(kv_cache, torch.Tensor):  # KVShards: a float cache of all heads
            num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
            values = (num_layers * 2 * block_size * num_kv_heads * head_dim
                      * kv_cache.element_size())
            return cls(num_layers, block_size, num_kv_heads, head_dim, kv_cache.dtype, 0,
                       values)
        if (kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or not (
                kv_cache.is_contiguous() or block_major(kv_cache) or kv_scales is not None)):
            raise ValueError("kv_cache must be [num_layers, 2, num_blocks, block_size, "
                             "num_kv_heads, head_dim], contiguous or over block-major storage "
                             f"[num_blocks, num_layers, 2, ...], got shape "
                             f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
        if kv_cache.dtype not in DTYPE_CODES:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} has no wire code")
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        values = num_layers * 2 * block_size * num_kv_heads * head_dim * kv_cache.element_size()
        if kv_scales is None:
            return cls(num_layers, block_size, num_kv_heads, head_dim, kv_cache.dtype, 0, values)
        block_bytes, scales_offset = _scaled_block_layout(kv_cache, kv_scales)
        return cls(num_layers, block_size, num_kv_heads, head_dim, kv_cache.dtype,
                   scales_offset, block_bytes)

    @property
    def scaled(self) -> bool:
        """Whether each block holds scales (a quantized cache)."""
        return self.scales_offset > 0

    def describe(self) -> str:
        """The geometry in words, for errors."""
        dtype = str(self.dtype).removeprefix("torch.")
        values = f"{dtype} values with fp32 scales" if self.scaled else dtype
        return (f"{values} ({self.num_layers} layers, {self.block_size} tokens, "
                f"{self.num_kv_heads} kv heads of {self.head_dim}; {self.block_bytes} bytes "
                "a block)")

    def fields(self) -> list[int]:
        return [self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                DTYPE_CODES[self.dtype], self.scales_offset, self.block_bytes]

    @classmethod
    def from_fields(cls, fields: list[int]) -> KVGeometry:
        num_layers, block_size, num_kv_heads, head_dim, code, scales_offset, block_bytes = fields
        if code not in _CODE_DTYPES:
            raise KVTransferError(f"unknown dtype code {code} on the wire")
        return cls(num_layers, block_size, num_kv_heads, head_dim, _CODE_DTYPES[code],
                   scales_offset, block_bytes)


GEOMETRY_FIELDS = 7
"""``KVGeometry.fields()``'s length on the wire."""


def _scaled_block_layout(kv_cache: torch.Tensor, kv_scales: torch.Tensor) -> tuple[int, int]:
    """``(block_bytes, scales_offset)`` of a quantized cache whose every block (a run of
    ``block_bytes``) holds its values, then its scales; raises ValueError otherwise."""
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    row = num_kv_heads * head_dim
    block_bytes = kv_cache.stride(2)
    values = num_layers * 2 * block_size * row
    scales_offset = kv_scales.data_ptr() - kv_cache.data_ptr()
    fits = (
        kv_cache.element_size() == 1 and kv_scales.dtype == torch.float32
        and tuple(kv_scales.shape) == (num_layers, 2, num_blocks, num_kv_heads)
        and kv_cache.permute(2, 0, 1, 3, 4, 5).stride() == (
            block_bytes, 2 * block_size * row, block_size * row, row, head_dim, 1)
        and kv_scales.permute(2, 0, 1, 3).stride() == (
            block_bytes // 4, 2 * num_kv_heads, num_kv_heads, 1)
        and block_bytes % 4 == 0
        and kv_scales.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
        and values <= scales_offset <= block_bytes - num_layers * 2 * num_kv_heads * 4)
    if not fits:
        raise ValueError("a quantized kv_cache and its kv_scales must be views of block "
                         "storage [num_blocks, block_bytes] holding each block's values, then "
                         f"its scales; got values {tuple(kv_cache.shape)} {kv_cache.dtype} "
                         f"strides {kv_cache.stride()}, scales {tuple(kv_scales.shape)} "
                         f"{kv_scales.dtype} strides {kv_scales.stride()} at byte "
                         f"{scales_offset}")
    return block_bytes, scales_offset


def geometry_mismatch(decode_worker_id: str, decode: KVGeometry, prefill_worker_id: str,
                      prefill: KVGeometry) -> str:
    """The refusal of a pull between caches of different geometries, naming both."""
    what = ("KV cache dtypes differ" if (decode.dtype, decode.scaled) != (
        prefill.dtype, prefill.scaled) else "KV cache geometries differ")
    return (f"{what}: decode worker {decode_worker_id} holds {decode.describe()}, prefill "
            f"worker {prefill_worker_id} holds {prefill.describe()}; start both with the same "
            "--kv-cache-dtype (and model and --block-size)")


@dataclass(frozen=True, slots=True)
class Header:
    """What precedes a payload: which request, how many blocks, of what geometry, and
    the sender's per-channel sequence number (payload order on NCCL)."""

    request_hash: int
    num_blocks: int
    geometry: KVGeometry
    seq: int

    def encode(self) -> torch.Tensor:
        """``int64[HEADER_NUMEL]`` on the CPU."""
        values = [_MAGIC, _VERSION, self.request_hash, self.num_blocks, self.seq,
                  *self.geometry.fields()]
        header = torch.zeros(HEADER_NUMEL, dtype=torch.int64)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        return header

    @classmethod
    def decode(cls, header: torch.Tensor) -> Header:
        """Raises KVTransferError on a wrong magic number or version."""
        values = header.tolist()
        if values[0] != _MAGIC or values[1] != _VERSION:
            raise KVTransferError(f"bad KV header (magic {values[0]:#x}, version {values[1]})")
        return cls(values[2], values[3], KVGeometry.from_fields(values[5:5 + GEOMETRY_FIELDS]),
                   values[4])


def block_major(kv_cache: torch.Tensor) -> bool:
    """Whether a 6-d ``kv_cache`` (``[num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim]``) is the layer-major view of block-major storage ``[num_blocks,
    num_layers, 2, block_size, num_kv_heads, head_dim]``, as ``ModelRunner`` allocates
    it: blocks ``b .. b + k - 1`` of all layers are then one contiguous region. Never for
    a tensor-parallel worker's ``KVShards`` (its chunks are always staged)."""
    if not isinstance(kv_cache, torch.Tensor):
        return False
    return kv_cache.permute(2, 0, 1, 3, 4, 5).is_contiguous()


def check_block_ids(block_ids, num_blocks: int) -> list[int]:
    """``block_ids`` as a list of ints; raises ValueError unless they are at least one,
    distinct, and in ``[0, num_blocks)``."""
    ids = list(map(int, block_ids))
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= num_blocks:
        raise ValueError(f"block_ids must be distinct ids in [0, {num_blocks}), got {ids}")
    return ids


def request_hash(request_id: str) -> int:
    """Stable signed 64-bit hash of a request id (SHA-256, first 8 bytes)."""
    digest = hashlib.sha256(request_id.encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


@dataclass(frozen=True, slots=True)
class Ticket:
    """The decode side's offer for one pull: which channel (``incarnation`` of the
    receiver, ``generation`` of the pair's group), the gloo ``tag``, how many blocks and
    of what geometry it expects, and ``nonce``, 32 hex digits drawn for this pull alone,
    which keys the payload's tag (``auth.transfer_key``)."""

    incarnation: str
    generation: int
    tag: int
    num_blocks: int
    geometry: KVGeometry
    chunks: tuple[int, ...] = ()
    """The gloo payload's cut into messages, in blocks (``payload.plan_chunks``): sums to
    ``num_blocks``. Encoded run-length: ``"10*102 4 1*3"`` is 102 tens, a four, 3 ones."""
    nonce: str = ""

    def __post_init__(self) -> None:
        if len(self.nonce) != 32 or any(c not in "0123456789abcdef" for c in self.nonce):
            raise ValueError(f"ticket nonce {self.nonce!r} is not 32 hex digits")

    def encode(self) -> str:
        fields = [self.incarnation, self.nonce, self.generation, self.tag, self.num_blocks,
                  *self.geometry.fields()]
        runs: list[list[int]] = []
        for size in self.chunks:
            if runs and runs[-1][0] == size:
                runs[-1][1] += 1
            else:
                runs.append([size, 1])
        chunks = [f"{size}*{count}" if count > 1 else str(size) for size, count in runs]
        return " ".join([*(str(f) for f in fields), *chunks])

    @classmethod
    def decode(cls, text: str | bytes) -> Ticket:
        """Raises ValueError (or KVTransferError for an unknown dtype) on a malformed
        ticket, including chunks that are not positive or do not sum to the block count."""
        parts = (text.decode() if isinstance(text, bytes) else text).split()
        first_chunk = 5 + GEOMETRY_FIELDS
        numbers = [int(p) for p in parts[2:first_chunk]]
        if len(numbers) != first_chunk - 2:
            raise ValueError(f"ticket {parts} is too short")
        chunks: list[int] = []
        for token in parts[first_chunk:]:
            size, _, count = token.partition("*")
            chunks.extend([int(size)] * (int(count) if count else 1))
        if any(c <= 0 for c in chunks) or sum(chunks) != numbers[2]:
            raise ValueError(f"ticket chunks {parts[first_chunk:]} do not cut {numbers[2]} blocks")
        return cls(parts[0], numbers[0], numbers[1], numbers[2],
                   KVGeometry.from_fields(numbers[3:]), tuple(chunks), parts[1])


def pair_prefix(prefill_worker_id: str, decode_worker_id: str) -> str:
    """Store key prefix of one (prefill, decode) pair."""
    return f"pdkv/{prefill_worker_id}/{decode_worker_id}"


def established_key(group_name: str) -> str:
    """Set by the decode side once a group is up: a prefill side that has no such group
    (it restarted) must not try to join it again."""
    return f"{group_name}/established"


def ticket_key(prefix: str, request_id: str) -> str:
    return f"{prefix}/req/{request_id}/ticket"


def claim_key(prefix: str, request_id: str, ticket: Ticket) -> str:
    """Unique per pull (generation and tag), so a late claim never hits a later pull."""
    return f"{prefix}/req/{request_id}/claim/{ticket.generation}/{ticket.tag}"


# Once a transfer is claimed, its payload gets at least this long, even past the deadline.
MIN_TRANSFER_S = 2.0
CLAIM_QUEUE_KEY = "pdkv/claims"  # prefill sides push "<S|F>\n<prefill_id>\n<request_id>"
CLAIM_SENDING = "S"
CLAIM_GIVEN_UP = "X"
CLAIM_FAILED_PREFIX = "F "


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``; raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class KVTransferStats:
    """One transfer: blocks and payload bytes moved, wall seconds from start to end."""

    num_blocks: int
    num_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class KVTransferCounters:
    """Totals since start (for ``pdserve:`` metrics): transfers that succeeded and
    failed, payload bytes and seconds of the successful ones; and ``num_in_flight``, a
    gauge: transfers whose payload is moving now (claimed by the sender, not yet ended).
    A transfer stuck on a peer that stopped reading stays in flight until its timeout.
    ``num_refused``: connections to this worker's KV listeners (its KV store, its pair
    listeners; a decode worker's) dropped for failing the cluster's handshake: a peer
    without the cluster secret, or one that is not pdserve."""

    num_transfers: int = 0
    num_failed: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    num_in_flight: int = 0
    num_refused: int = 0


class CounterSet:
    """Thread-safe running ``KVTransferCounters``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = KVTransferCounters()

    def start(self) -> None:
        """A payload starts moving (``num_in_flight`` + 1); end it with ``add(...,
        moving=True)``."""
        with self._lock:
            t = self._totals
            self._totals = dataclasses.replace(t, num_in_flight=t.num_in_flight + 1)

    def add(self, stats: KVTransferStats | None, moving: bool = False) -> None:
        """Count one transfer: ``stats`` for a success, None for a failure. ``moving``:
        it was ``start``ed, and leaves ``num_in_flight`` in the same update, so a reader
        never sees it neither in flight nor counted."""
        with self._lock:
            t = dataclasses.replace(self._totals,
                                    num_in_flight=self._totals.num_in_flight - int(moving))
            if stats is None:
                self._totals = dataclasses.replace(t, num_failed=t.num_failed + 1)
            else:
                self._totals = dataclasses.replace(
                    t, num_transfers=t.num_transfers + 1, num_bytes=t.num_bytes + stats.num_bytes,
                    seconds=t.seconds + stats.seconds)

    def snapshot(self) -> KVTransferCounters:
        with self._lock:
            return self._totals
