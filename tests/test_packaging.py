"""The wheel that ``pip install .`` builds (the Dockerfile's install) holds every file the
package needs at run time: a non-editable install compiles the C++ kernels from its own
copy of kernels/csrc, headers included."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Data files read at run time, relative to the repository root: folder -> package folder.
RUNTIME_DATA = {"kernels/csrc": "pdserve/kernels/csrc", "cluster/csrc": "pdserve/cluster/csrc",
                "engine/data": "pdserve/engine/data"}


def test_the_wheel_holds_the_kernel_sources_and_data(tmp_path):
    src = tmp_path / "src"
    # A copy without build leftovers, as a fresh clone (or a Docker build context) has.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", "tests", "benchmarks", "deploy"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "--wheel-dir", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("pdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, packaged in RUNTIME_DATA.items():
        files = [p for p in (ROOT / folder).iterdir() if p.is_file()]
        assert files, folder
        missing = [p.name for p in files if f"{packaged}/{p.name}" not in names]
        assert not missing, f"{folder}: {missing} are not in the wheel (package-data)"
    assert "pdserve/entrypoints/cli.py" in names and "pdserve/proto/common_pb2.py" in names


def test_the_dockerfile_copies_every_package_folder():
    """The Dockerfile copies folders by name (its context leaves tests and the rest out):
    a new top-level package folder must be copied too, or the image cannot import it."""
    import tomllib

    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                  ["tool"]["setuptools"]["package-dir"].values())
    tops = {f.split("/")[0] for f in folders}
    copied = {line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ")}
    assert tops - copied == set(), f"the Dockerfile does not COPY {sorted(tops - copied)}"
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert not (tops | {"pyproject.toml", "README.md"}) & ignored
