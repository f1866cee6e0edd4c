"""An engine's CPU threads (``--cpu-omp-threads-bind``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND``):
the CPU list parser, binding the thread that steps the engine's intra-op team to CPUs
(the C++ kernels' ``bind_intra_op_threads``), and moving a running engine onto another
CPU set and thread count (``apply_cpu_split``, when the pools on a CPU node change)."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (Linux's cpu list format, in the order given).

    Raises:
        ValueError: not such a list, naming ``cpu_omp_threads_bind``.
    """
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or int(last or first) < int(first):
            raise ValueError(f"cpu_omp_threads_bind={text!r} must be auto, nobind or a CPU "
                             "list such as 0-3 or 0,2,4-5")
        cpus.extend(range(int(first), int(last or first) + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_omp_threads_bind={text!r} names a CPU twice")
    return cpus


def bind_intra_op_threads(mode: str, num_threads: int | None, explicit_only: bool = False
                          ) -> int:
    """Bind the calling thread's intra-op team as ``mode`` (``cpu_omp_threads_bind``:
    ``auto``, ``nobind`` or a CPU list; ``EngineConfig`` says what each does) says, after
    setting the team to ``num_threads`` threads when given (a per-thread setting); returns
    how many threads were bound. ``explicit_only``: bind only for a CPU list, not for
    ``auto``. For a CPU engine (``LLMEngine.bind_threads``).

    Raises:
        ValueError: a CPU list shorter than the team.
    """
    from pdserve.kernels import cpu_ext

    if mode == "nobind" or (explicit_only and mode == "auto"):
        return 0
    if num_threads:
        torch.set_num_threads(num_threads)  # NOTE: a per-thread setting
    threads = torch.get_num_threads()
    if mode == "auto":
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) != threads:
            logger.info("intra-op threads not bound: %d threads on %d CPUs "
                        "(--cpu-omp-threads-bind auto binds only a team that has "
                        "them all)", threads, len(cpus))
            return 0
    else:
        cpus = parse_cpu_list(mode)
        if len(cpus) < threads:
            raise ValueError(f"cpu_omp_threads_bind={mode!r} names {len(cpus)} CPUs "
                             f"for {threads} intra-op threads")
    bound = cpu_ext.bind_intra_op_threads(cpus[:threads])
    # NOTE: a CPU outside the process's allowed set (or the machine) stays unbound
    logger.log(logging.INFO if bound == threads else logging.WARNING,
               "%d of %d intra-op threads bound to CPUs %s", bound, threads, cpus[:threads])
    return bound


def set_process_affinity(cpus) -> int:
    """Let every thread of this process run only on ``cpus`` (CPU numbers); threads it
    starts later inherit the calling thread's set. Returns how many threads were moved
    (Linux: each of ``/proc/self/task``; elsewhere the calling thread).

    Raises:
        OSError: ``cpus`` holds no CPU this process may have.
    """
    cpus = set(cpus)
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:
        tids = [0]
    moved = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            moved += 1
        except ProcessLookupError:  # NOTE: ended meanwhile
            continue
    return moved


def apply_cpu_split(mode: str, cpus, num_threads: int) -> int:
    """Move this engine onto ``cpus`` with ``num_threads`` intra-op threads (a worker's
    share of a CPU node, ``PoolScaler``'s re-split); call it on the thread that steps the
    engine, between two steps. Every thread of the process goes to ``cpus``; the team is
    resized and, with ``mode`` ``auto`` (``cpu_omp_threads_bind``) and one thread per CPU,
    each of its threads bound to one of them. With ``nobind`` or a CPU list the team is
    only resized (a list names CPUs of its own). Returns how many threads were bound.

    Raises:
        OSError: ``cpus`` holds no CPU this process may have.
    """
    set_process_affinity(cpus)
    if mode != "auto":
        torch.set_num_threads(num_threads)
        return 0
    return bind_intra_op_threads(mode, num_threads)
