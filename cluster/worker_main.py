"""``python -m pdserve.prefill_worker`` / ``python -m pdserve.decode_worker``: one worker
as a plain process (no Ray), finding the others through Redis. Stops on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from pdserve.cluster.cli import add_engine_args
from pdserve.cluster.worker_config import add_worker_args, worker_config_from_args


def make_worker(config):
    """The worker object for ``config.role`` (imported lazily: each pulls its own deps)."""
    if config.role == "prefill":
        from pdserve.prefill_worker.server import PrefillWorker

        return PrefillWorker(config)
    from pdserve.decode_worker.server import DecodeWorker

    return DecodeWorker(config)


async def serve(config, ready_file: str | None = None) -> None:
    worker = make_worker(config)
    await worker.start()
    info = {"worker_id": worker.worker_id, "role": config.role,
            "grpc_address": worker.grpc_address, "kv_address": worker.kv_address}
    print(json.dumps(info), flush=True)
    if ready_file:
        with open(ready_file, "w") as f:
            json.dump(info, f)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await worker.stop()


def main(role: str, argv=None) -> int:
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
        asyncio.run(serve(config, args.ready_file))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve {role} worker: error: {exc}", file=sys.stderr)
        return 2
    return 0
