"""A tensor-parallel worker's ranks: rank 0 is the engine's process, ranks 1..N-1 are
processes it spawns, each holding its share of the model and of the KV cache
(``engine/parallel.py``; ../shared/DESIGN.md, Tensor parallelism).

Rank 0 schedules. Before each forward pass it sends the step's inputs (token ids,
positions, the attention metadata, the rows whose logits are wanted: numpy arrays, a few
KB) down a pipe to every other rank; all ranks then run the same forward pass, meeting in
two all-reduces per layer and a gather of the logits to rank 0, which samples. No rank
schedules, samples or keeps request state, so ranks cannot diverge.

The group is gloo on CPU and NCCL on CUDA, made from a ``TCPStore`` on 127.0.0.1 (the
ranks of a worker are one machine's processes) with a timeout on every collective.

Failure: a rank that dies (kill -9, OOM) fails rank 0's next collective or pipe write, or
its liveness check, with ``RankFailedError``; the engine then stops (the whole worker is
dead, and its requests fail or migrate as for any dead worker). A rank 0 that dies closes
the pipes, and every other rank exits on the end of its pipe; one blocked in a collective
fails it when the peer's connection drops, or at the timeout.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel import RankFailedError, TensorParallel

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # a step's collectives; the first one waits for kernels' builds
START_TIMEOUT_S = 600.0  # a rank loads its share of the weights


@dataclass(slots=True)
class RankSpec:
    """What a rank process needs to build its shard (picklable)."""

    model_config: ModelConfig
    block_size: int
    device: str  # rank 0's device; CUDA ranks take the next indices
    kv_cache_dtype: str
    seed: int
    size: int
    store_port: int
    num_threads: int | None


def make_group(store: dist.Store, rank: int, size: int, device: torch.device,
               timeout_s: float = COLLECTIVE_TIMEOUT_S, connect_timeout_s: float = 60.0):
    """The tensor-parallel process group over ``store`` (prefixed ``tp``): NCCL on CUDA,
    gloo on 127.0.0.1 otherwise; connecting waits up to ``connect_timeout_s`` for the
    other ranks, and each collective after is bounded by ``timeout_s``."""
    store = dist.PrefixStore("tp", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=connect_timeout_s)
    group = dist.ProcessGroupGloo(store, rank, size, opts)
    group.set_timeout(timedelta(seconds=timeout_s))
    return group


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the next CUDA index after rank 0's, or the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def threads_per_rank(size: int) -> int:
    """CPU threads each of ``size`` ranks takes by default: its share of the CPUs this
    process may run on (ranks would otherwise oversubscribe the cores N times)."""
    return max(1, len(os.sched_getaffinity(0)) // size)


class TensorParallelExecutor:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them each step, checks them.

    Each rank is a spawned process running ``rank_main(spec, rank, pipe)`` (a module-level
    function, pickled by name: ``model_runner.rank_main``, which builds the rank's
    ``ModelRunner`` between ``join_group`` and ``serve_rank``).

    Raises (constructor):
        RankFailedError: a rank did not start (its error in the message) within
            ``START_TIMEOUT_S``.
    """

    def __init__(self, spec: RankSpec, device: torch.device,
                 rank_main: Callable[[RankSpec, int, Connection], None]) -> None:
        self.size = spec.size
        self._store = dist.TCPStore("127.0.0.1", 0, spec.size, is_master=True,
                                    timeout=timedelta(seconds=START_TIMEOUT_S),
                                    wait_for_workers=False)
        spec.store_port = self._store.port
        context = multiprocessing.get_context("spawn")
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._pipes: list[Connection] = []
        for rank in range(1, spec.size):
            parent, child = context.Pipe()
            process = context.Process(target=rank_main, args=(spec, rank, child),
                                      name=f"pdserve-tp-rank-{rank}", daemon=True)
            process.start()
            child.close()
            self._processes.append(process)
            self._pipes.append(parent)
        try:
            # NOTE: the ranks report before they make the group, so a rank that fails to
            # start (an import error, a bad device) is seen here, not as a rendezvous
            # timeout
            self._expect("connecting", time.monotonic() + START_TIMEOUT_S)
            self.tp = TensorParallel(0, spec.size,
                                     make_group(self._store, 0, spec.size, device))
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every rank has loaded its shard.

        Raises:
            RankFailedError: a rank failed to load (its error) or did not answer in time.
        """
        try:
            self._expect("ready", time.monotonic() + timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _expect(self, state: str, deadline: float) -> None:
        for rank, pipe in enumerate(self._pipes, start=1):
            reply = self._receive(rank, pipe, deadline)
            if reply[0] != state:
                raise RankFailedError(f"tensor-parallel rank {rank} failed to start: {reply[1]}")

    def _receive(self, rank: int, pipe: Connection, deadline: float) -> tuple:
        while True:
            try:
                if pipe.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                    return pipe.recv()
            except (EOFError, OSError) as exc:
                raise RankFailedError(f"tensor-parallel rank {rank} exited "
                                      f"(exit code {self._processes[rank - 1].exitcode})"
                                      ) from exc
            if not self._processes[rank - 1].is_alive():
                raise RankFailedError(f"tensor-parallel rank {rank} exited (exit code "
                                      f"{self._processes[rank - 1].exitcode})")
            if time.monotonic() >= deadline:
                raise RankFailedError(f"tensor-parallel rank {rank} did not answer in "
                                      f"{START_TIMEOUT_S:.0f} s")

    def send(self, command: str, *args: Any) -> None:
        """Send ``(command, *args)`` to every other rank, which then joins rank 0 in the
        command's collectives.

        Raises:
            RankFailedError: a rank has exited.
        """
        message = (command, *args)
        for rank, (pipe, process) in enumerate(zip(self._pipes, self._processes), start=1):
            if not process.is_alive():
                raise RankFailedError(f"tensor-parallel rank {rank} exited (exit code "
                                      f"{process.exitcode})")
            try:
                pipe.send(message)
            except OSError as exc:
                raise RankFailedError(f"tensor-parallel rank {rank} is gone: {exc}") from exc

    def receive_handles(self, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> list[int]:
        """One file descriptor from each other rank, in rank order (its KV cache's shared
        memory, sent after an ``allocate_kv_cache`` on the CPU); the caller closes them.

        Raises:
            RankFailedError: a rank exited or sent nothing within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        fds = []
        for rank, (pipe, process) in enumerate(zip(self._pipes, self._processes), start=1):
            while not pipe.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                if not process.is_alive() or time.monotonic() >= deadline:
                    raise RankFailedError(f"tensor-parallel rank {rank} sent no KV cache "
                                          f"(exit code {process.exitcode})")
            fds.append(reduction.recv_handle(pipe))
        return fds

    def check_alive(self) -> None:
        """Raises ``RankFailedError`` when a rank has exited."""
        for rank, process in enumerate(self._processes, start=1):
            if not process.is_alive():
                raise RankFailedError(f"tensor-parallel rank {rank} exited (exit code "
                                      f"{process.exitcode})")

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1..N-1."""
        return [p.pid for p in self._processes]

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every rank (a polite stop, then SIGKILL after ``timeout_s``)."""
        for pipe in self._pipes:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
            pipe.close()
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(1.0)
        self._pipes.clear()


def join_group(spec: RankSpec, rank: int, pipe: Connection
               ) -> tuple[torch.device, TensorParallel]:
    """In rank ``rank``'s process: tell rank 0 it is connecting, then join the group; this
    rank's device and its ``TensorParallel``. Raises what the rendezvous raises (a
    timeout after ``START_TIMEOUT_S``)."""
    device = rank_device(torch.device(spec.device), rank)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    pipe.send(("connecting",))
    return device, TensorParallel(rank, spec.size, make_group(store, rank, spec.size, device))


def serve_rank(runner: Any, rank: int, pipe: Connection) -> None:
    """In rank ``rank``'s process, its shard built: tell rank 0 it is ready, then run rank
    0's commands on ``runner`` (``runner.run_command(command, *args)``, which may return a
    file descriptor to hand to rank 0) until it says stop or goes away. A command that
    fails (a failed collective: rank 0 sees it too) ends the process with status 1."""
    pipe.send(("ready",))
    while True:
        try:
            message = pipe.recv()
        except (EOFError, OSError):
            return  # NOTE: rank 0 is gone: so is this worker
        command, args = message[0], message[1:]
        if command == "stop":
            return
        try:
            fd = runner.run_command(command, *args)
            if fd is not None:  # NOTE: its KV cache's memory, for rank 0 to map
                reduction.send_handle(pipe, fd, os.getppid())
                os.close(fd)
        except Exception:  # a failed collective: rank 0 sees it too
            logger.exception("tensor-parallel rank %d: %s failed", rank, command)
            os._exit(1)
