"""deploy/slurm: both scripts parse, always; the end-to-end run on a one-node Slurm cluster
of its own (``deploy/slurm/run-local.sh``) only when asked for with ``PDSERVE_TEST_SLURM=1``,
as root, with slurm-wlm and munge installed: it starts root daemons (munged, slurmctld,
slurmd) and takes minutes, which the default test run must not."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SLURM_DIR = Path(__file__).resolve().parents[1] / "deploy" / "slurm"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sbcast", "scancel", "squeue",
           "sinfo")


@pytest.mark.parametrize("script", ["pdserve.sbatch", "run-local.sh"])
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(SLURM_DIR / script)], capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PDSERVE_TEST_SLURM") != "1",
                    reason="starts root Slurm daemons and takes minutes: PDSERVE_TEST_SLURM=1")
def test_run_local_serves_and_cancels_cleanly():
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("run-local.sh runs munged, slurmctld and slurmd as root")
    result = subprocess.run([str(SLURM_DIR / "run-local.sh")], capture_output=True, text=True,
                            timeout=1800, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "run-local: PASSED" in result.stdout
