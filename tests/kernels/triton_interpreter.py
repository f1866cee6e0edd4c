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
