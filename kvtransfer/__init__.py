"""Moving KV blocks between a prefill worker and a decode worker (docs/architecture.md, KV transfer).

Each (prefill, decode) pair gets a 2-rank channel, made without a global
``init_process_group`` from the store that the decode worker hosts at its KV address
(``store.KVStoreServer``: it answers only clients that prove the cluster secret), on
first use, and cached. Every payload carries a tag the receiver checks before the pull
may succeed (``auth``). The decode side pulls:

    pull = receiver.init(request_id, prefill_worker_id, local_block_ids)   # BOOTSTRAPPING
    # ... gRPC SendKV to the prefill worker, which calls:
    #     sender.send(request_id, decode_worker_id, decode_kv_address, its_block_ids)
    state = pull.wait(timeout_s)       # SUCCESS, or FAILED with pull.failure_exception()

Both classes are thread-safe and block only in ``send``, ``wait`` and ``KVPull.cancel``.
An asyncio server learns of a pull's end from ``add_done_callback`` rather than a thread
parked in ``wait`` (the loop's default executor has a few threads for everything).
"""

from pdserve.kvtransfer.handle import KVTransfer
from pdserve.kvtransfer.protocol import (
    KVGeometry,
    KVPollState,
    KVTransferCounters,
    KVTransferError,
    KVTransferStats,
)
from pdserve.kvtransfer.pull import KVPull
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender

__all__ = [
    "KVGeometry", "KVPollState", "KVPull", "KVReceiver", "KVSender", "KVTransfer",
    "KVTransferCounters", "KVTransferError", "KVTransferStats",
]
