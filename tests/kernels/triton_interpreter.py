"""Switches triton's CPU interpreter on for the kernel tests, imported by each of them
before anything from pdserve.kernels.

triton reads TRITON_INTERPRET when it is imported (its own tl.max, tl.sum ... are jit
functions) and when each kernel is decorated, so it must be set before the first import
of triton. Not in a conftest.py: the suite's tests import the top-level conftest by name.
In a session that imported triton earlier (the engine's tests collected first), the
interpreter cannot be switched on and the CPU runs of the Triton kernels are skipped.
"""

from __future__ import annotations

import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
TRITON_IMPORTED_EARLY = "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ
if not HAS_CUDA and not TRITON_IMPORTED_EARLY:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def device_params() -> list:
    """The devices the Triton kernels run on, as pytest params: "cpu" under the
    interpreter (skipped where it could not be switched on), "cuda" where a GPU is lent
    (marked ``cuda``)."""
    import pytest

    from pdserve.kernels._triton_utils import HAS_TRITON, interpreting

    return [
        pytest.param("cpu", marks=pytest.mark.skipif(
            TRITON_IMPORTED_EARLY or not (HAS_TRITON and interpreting()),
            reason="needs triton's interpreter: export TRITON_INTERPRET=1, or run "
                   "tests/kernels before anything imports triton")),
        pytest.param("cuda", marks=[pytest.mark.cuda,
                                    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
    ]
