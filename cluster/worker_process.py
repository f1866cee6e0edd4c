"""One worker as a plain process (no Ray), finding the others through Redis: the body of
``python -m pdserve.prefill_worker`` and ``python -m pdserve.decode_worker`` (each
service's ``main`` passes its role and how to build its worker).

SIGTERM drains: the worker stops taking requests and leaves the registry, its requests
and KV leases get ``--drain-grace-s`` seconds to end, then it stops (the router migrates
decodes still running). SIGINT stops it at once."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.cluster import event_loop
from pdserve.cluster.worker_config import WorkerConfig, add_worker_args, worker_config_from_args
from pdserve.engine.args import add_engine_args

# config -> the service's worker object (``PrefillWorker`` or ``DecodeWorker``): it has
# ``start()``, ``drain(grace_s)``, ``stop(grace_s=...)`` and the addresses it serves on
WorkerFactory = Callable[[WorkerConfig], Any]


def write_ready_file(path: Path, info: dict) -> None:
    """Write ``info`` as JSON to ``path`` whole or not at all: a launcher that polls for the
    file (SLURM scripts, tests) never reads it half-written. The bytes go to a sibling file
    first, then ``os.replace`` renames it (atomic on one POSIX file system).

    Raises ``OSError`` when the folder is not writable."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(info))
    os.replace(partial, path)


async def serve(config: WorkerConfig, make_worker: WorkerFactory,
                ready_file: str | None = None) -> None:
    """Start ``make_worker(config)``, print its addresses as one JSON line (and write them
    to ``ready_file``), then serve until SIGINT (stop now) or SIGTERM (drain for
    ``config.drain_grace_s`` seconds, then stop)."""
    worker = make_worker(config)
    await worker.start()
    metrics = worker.runtime.metrics_server
    info = {"worker_id": worker.worker_id, "role": config.role,
            "grpc_address": worker.grpc_address, "kv_address": worker.kv_address,
            "metrics_address": metrics.address if metrics is not None else ""}
    print(json.dumps(info), flush=True)
    if ready_file:
        write_ready_file(Path(ready_file), info)
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    await stop.wait()
    if received[0] == signal.SIGTERM:
        logging.getLogger(__name__).info("draining for at most %.1f s", config.drain_grace_s)
        await worker.drain(config.drain_grace_s)
        await worker.stop(grace_s=0.0)  # the grace is spent: what still runs migrates
    else:
        await worker.stop()


def run_worker(role: str, make_worker: WorkerFactory, argv: list[str] | None = None) -> int:
    """Parse the engine's and the worker's flags from ``argv`` (default ``sys.argv``) and
    serve one ``role`` (``"prefill"`` or ``"decode"``) worker until a signal; the exit
    status: 0, or 2 for bad settings (a ``ValueError`` or ``FileNotFoundError``, printed
    to stderr)."""
    parser = argparse.ArgumentParser(prog=f"python -m pdserve.{role}_worker",
                                     description=f"Run one pdserve {role} worker.")
    add_engine_args(parser)
    add_worker_args(parser)
    parser.add_argument("--ready-file", help="write the worker's addresses here once serving")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = worker_config_from_args(role, args)
        event_loop.run(serve(config, make_worker, args.ready_file))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve {role} worker: error: {exc}", file=sys.stderr)
        return 2
    return 0
