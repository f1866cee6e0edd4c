"""benchmarks/router_stream.py runs end to end on a few streams: its stand-in for
``ModelService`` still meets what ``build_app`` asks of a model's router (it drifted once
and the benchmark failed with a 500), and each section prints a figure. No timing is
asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "router_stream.py"


def test_every_section_streams_and_prints_a_figure():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "300", "--streams", "3",
         "--stream-tokens", "8", "--step-ms", "1"],
        capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = dict(re.findall(r"^(\S.*?)\s+([\d.]+) us/token$", done.stdout, re.MULTILINE))
    assert set(figures) == {"detokenize", "format completion", "format completion+logprobs",
                            "format chat", "format chat+logprobs", "asgi", "uvicorn"}, \
        done.stdout
    # NOTE: the uvicorn child's CPU is read in clock ticks (10 ms): 0 for a few tokens
    assert all(float(us) > 0 for name, us in figures.items() if name != "uvicorn"), figures
