"""A worker of either role: ``make_worker`` for the Ray launcher, ``main(role)`` for a
plain process. Each service owns its own main (``prefill_worker/main.py``,
``decode_worker/main.py``, run by ``python -m pdserve.<role>_worker``); the plain-process
loop, its signals and its ready file are ``cluster/worker_process.py``'s."""

from __future__ import annotations

from pdserve.cluster.worker_config import WorkerConfig
from pdserve.cluster.worker_process import write_ready_file
from pdserve.decode_worker import main as decode_main
from pdserve.prefill_worker import main as prefill_main

__all__ = ["main", "make_worker", "write_ready_file"]


def make_worker(config: WorkerConfig):
    """The worker object for ``config.role``: a ``PrefillWorker`` for ``"prefill"``, else a
    ``DecodeWorker`` (each module imported on first use: each pulls its own deps)."""
    if config.role == "prefill":
        return prefill_main.make_worker(config)
    return decode_main.make_worker(config)


def main(role: str, argv: list[str] | None = None) -> int:
    """``python -m pdserve.<role>_worker``'s main for ``role`` (``"prefill"`` or
    ``"decode"``); the exit status."""
    return (prefill_main if role == "prefill" else decode_main).main(argv)
