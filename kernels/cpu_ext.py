"""pdserve's C++ CPU kernels (``kernels/csrc``): built on first use, then loaded as
``torch.ops.pdserve_cpu``.

The sources are compiled with ``torch.utils.cpp_extension.load`` (g++ or clang++, and
ninja, must be on PATH) and ``-march=native``, so the build fits the CPU it runs on; the
build directory's name carries a hash of the CPU's feature flags, so a home directory
shared by different machines (a cluster's NFS) keeps one build per kind of CPU, and a
hash of the sources (headers included) and of their folder (a checkout each). The
first build takes about 10 s on an idle machine (minutes on two busy cores); later
processes load the cached library at once. A process builds or loads only while it holds
the build folder (``_build_folder_lock``: an ``flock`` the OS drops with its process), so
a build killed midway leaves nothing that makes later loads wait forever.

Where the build fails (no compiler, an unsupported platform) ``load`` logs one warning
and returns False, and the kernels' dispatchers use the PyTorch references instead.
``PDSERVE_CPU_KERNELS=0`` turns the C++ kernels off.

``python -c "from pdserve.kernels import cpu_ext; cpu_ext.main()"`` builds them ahead of
time: ``pdserve serve`` does so once, before it starts CPU workers, where ``is_built()`` is
False, so the workers load the cached build instead of each compiling it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "PDSERVE_CPU_KERNELS"
_SOURCES = ("cpu_attention.cpp", "cpu_store_kv.cpp", "cpu_prefill_attention.cpp",
            "cpu_layers.cpp", "cpu_block_copy.cpp", "cpu_gemm.cpp", "cpu_gemm_avx512.cpp",
            "cpu_gemm_quant.cpp", "cpu_gemm_quant_amx.cpp", "cpu_gemm_quant_bf16.cpp",
            "cpu_sampling.cpp", "cpu_kv_quant.cpp",
            "cpu_decode_quant.cpp", "cpu_prefill_quant.cpp", "cpu_moe.cpp")
_OPS = ("paged_decode_attention", "paged_prefill_attention", "store_kv", "store_kv_quant",
        "paged_decode_attention_quant", "paged_prefill_attention_quant", "rms_norm",
        "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "argmax_rows",
        "gather_block_rows", "scatter_block_rows", "pack_linear_weight", "linear_packed",
        "linear_panel_width", "sample_rows", "filter_rows", "pack_quant_weight",
        "pack_quant_groups", "linear_quant",
        "moe_grouped", "set_linear_quant_bf16", "set_linear_quant_slice_rows")
_CSRC = Path(__file__).resolve().parent / "csrc"
# NOTE: the longest another process's build may hold the folder before load gives up (a
# first build takes minutes on two busy cores)
BUILD_WAIT_S = 1800.0
_lock = threading.Lock()
_loaded: bool | None = None


def enabled() -> bool:
    """Whether the environment allows the C++ kernels (``PDSERVE_CPU_KERNELS`` not 0)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def load() -> bool:
    """Build (once per machine kind) and load the C++ CPU kernels; True if
    ``torch.ops.pdserve_cpu`` is usable. Thread-safe; never raises."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            _loaded = enabled() and _build_and_load()
        return _loaded


def is_built() -> bool:
    """Whether this machine kind's build of the current sources is in torch's extension
    cache, so ``load`` will not compile (it still checks, and rebuilds if torch's own
    versioning says so)."""
    from torch.utils import cpp_extension

    name = _extension_name()
    try:
        # NOTE: the folder cpp_extension.load builds in; private, hence the fallback
        folder = cpp_extension._get_build_directory(name, verbose=False)
    except (AttributeError, TypeError, OSError):
        return False
    return Path(folder, f"{name}.so").is_file()


def main() -> None:
    """Build (or load) the kernels in this process and exit: status 0 when usable, else 1
    (the warning saying why is on stderr)."""
    logging.basicConfig(level=logging.WARNING, format="pdserve: %(message)s")
    try:
        usable = load()
    except KeyboardInterrupt:  # NOTE: the build was stopped; torch has released its lock
        sys.exit(130)
    sys.exit(0 if usable else 1)


def has_prefill_attention() -> bool:
    """Whether the C++ paged prefill attention runs here: built, and the CPU has
    AVX512-BF16 (its only code path; elsewhere the reference serves)."""
    return load() and _has_prefill_attention()


@functools.cache
def _has_prefill_attention() -> bool:
    return bool(torch.ops.pdserve_cpu.has_paged_prefill_attention())


def has_linear_packed() -> bool:
    """Whether ``torch.ops.pdserve_cpu.linear_packed`` (linears on weights packed by
    ``pack_linear_weight``, ``kernels/csrc/cpu_gemm.cpp``) runs on this CPU: the C++
    kernels load and were built with AVX2 and FMA (fp32, 16-feature panels) or AVX-512
    (fp32 and bf16, 32-feature panels, ``cpu_gemm_avx512.cpp``)."""
    return load() and _has_linear_packed()


@functools.cache
def _has_linear_packed() -> bool:
    return bool(torch.ops.pdserve_cpu.has_linear_packed())


def linear_packed_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes whose linears run faster in ``linear_packed`` than in oneDNN's
    packed linear on this CPU, as measured by ``benchmarks/cpu_linear.py``:

    - an AVX2 + FMA build (no AVX-512): fp32 (1.11-1.33x oneDNN at 1-128 rows, 1.01-1.04x
      at 256-1024, on a 2-core Zen 3);
    - an AVX-512 build: bf16, unless oneDNN's bf16 GEMM has hardware that runs it faster
      than fp32 FMAs: AMX tiles, or an AMD CPU's AVX512-BF16 (Zen 4 computes vdpbf16ps at
      twice its fp32 FMA rate). On a 2-core Xeon without AMX, oneDNN's bf16 linears ran at
      140-167 GFLOP/s and ``linear_packed``'s bf16 (fp32 FMAs on widened weights) at
      220-266: 1.26x at 1 row, 1.56-1.60x at 32-1024. Its fp32 path stays on oneDNN
      there (1.10x at 32 rows but 0.81-0.84x at 256 and more).
    """
    if not has_linear_packed():
        return frozenset()
    if int(torch.ops.pdserve_cpu.linear_panel_width()) == 16:
        return frozenset({torch.float32})
    if torch.cpu._is_amx_tile_supported() or _cpu_vendor() == "AuthenticAMD":
        return frozenset()
    return frozenset({torch.bfloat16})


@functools.cache
def _cpu_vendor() -> str:
    """``vendor_id`` of ``/proc/cpuinfo`` (``GenuineIntel``, ``AuthenticAMD``), or ""."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def bind_intra_op_threads(cpus: list[int]) -> int:
    """Bind intra-op thread i of the calling thread's OpenMP team to CPU ``cpus[i]``
    (as vLLM's ``VLLM_CPU_OMP_THREADS_BIND``); returns how many threads were bound (0
    when the C++ kernels are unavailable). Call it on the thread that runs the model.

    Raises:
        RuntimeError: fewer CPUs than ``torch.get_num_threads()`` threads.
    """
    if not load():
        return 0
    return int(torch.ops.pdserve_cpu.bind_intra_op_threads(list(cpus)))


@contextlib.contextmanager
def _build_folder_lock(name: str) -> Iterator[None]:
    """Hold the extension's build folder while torch builds or loads it: an advisory
    ``flock`` on a file of ours, which the OS drops when its process ends, killed or not.

    torch's own lock is a ``lock`` file it deletes when its build ends, and waits for
    without a timeout; a build killed midway (Ctrl-C during a first, minutes-long build)
    left it behind and every later process waited on it forever. No pdserve process
    builds in the folder without holding this lock, so a ``lock`` file found under it is
    such a leftover, and is removed.

    Raises:
        TimeoutError: another process held the folder for ``BUILD_WAIT_S`` seconds.
    """
    from torch.utils import cpp_extension

    try:
        # NOTE: the folder cpp_extension.load builds in; private, hence the fallback
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    except (AttributeError, TypeError):
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "pdserve.flock", "a") as held:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has held {folder} for "
                                       f"{BUILD_WAIT_S:.0f} s") from None
                time.sleep(0.2)
        try:
            leftover = folder / "lock"
            if leftover.exists():
                logger.warning("removing %s, left by a build that did not finish", leftover)
                leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _build_and_load() -> bool:
    from torch.utils import cpp_extension

    try:
        with _build_folder_lock(_extension_name()):
            _load(cpp_extension)
        return all(hasattr(torch.ops.pdserve_cpu, op) for op in _OPS)
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as exc:
        # NOTE: any build or load failure means "use the references" (TimeoutError is
        # an OSError)
        lines = str(exc).strip().splitlines() or [""]
        detail = next((line for line in lines if "error" in line.lower()), lines[-1])
        logger.warning("pdserve C++ CPU kernels unavailable, using the PyTorch references "
                       "(%s: %s)", type(exc).__name__, detail.strip())
        return False


def _load(cpp_extension) -> None:
    """Build (where torch's versioning asks) and load the extension; raises as
    ``cpp_extension.load``."""
    cpp_extension.load(
        name=_extension_name(),
        sources=[str(_CSRC / name) for name in _SOURCES],
        # NOTE: no fast-math: results stay IEEE; these two only let loops with
        # clamps and conversions vectorize.
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                      "-fno-trapping-math"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def _extension_name() -> str:
    return f"pdserve_cpu_{_cpu_tag()}_{_source_tag(_CSRC)}"


def _source_tag(csrc: Path) -> str:
    """A short hash of every file in ``csrc`` (torch's own versioning sees only the
    ``.cpp`` sources, not the headers they include) and of where it is: two checkouts of
    the same sources get a build folder each (one folder's build commands name one
    checkout's paths, so sharing it rebuilt the extension whenever the other loaded it)."""
    digest = hashlib.sha256(str(csrc.resolve()).encode())
    for path in sorted(csrc.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _cpu_tag() -> str:
    """A short hash of the CPU's architecture and feature flags."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags += line
                    break
    except OSError:
        flags += platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]
