"""An engine's CPU threads (``--cpu-omp-threads-bind``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND``):
the CPU list parser, and binding the thread that steps the engine's intra-op team to CPUs
(the C++ kernels' ``bind_intra_op_threads``)."""

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
