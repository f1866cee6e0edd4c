"""``python -m pdserve.decode_worker``: one decode worker as a plain process (no Ray),
finding the others through Redis (``cluster/worker_process.py`` runs it)."""

from __future__ import annotations

from pdserve.cluster.worker_config import WorkerConfig
from pdserve.cluster.worker_process import run_worker


def make_worker(config: WorkerConfig):
    """A ``DecodeWorker`` for ``config`` (its module imported on first use: it pulls the
    engine and gRPC)."""
    from pdserve.decode_worker.server import DecodeWorker

    return DecodeWorker(config)


def main(argv: list[str] | None = None) -> int:
    """Serve one decode worker with the flags in ``argv`` (default ``sys.argv``); the exit
    status (``cluster.worker_process.run_worker``)."""
    return run_worker("decode", make_worker, argv)
