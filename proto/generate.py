"""Regenerate pdserve.proto's gencode from the ``.proto`` files beside this script.

    python proto/generate.py            # rewrite proto/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python proto/generate.py --check    # exit 1 when the committed modules are stale
    python proto/generate.py --out DIR  # write elsewhere

The generator is pinned to grpcio-tools ``GRPC_TOOLS_VERSION``, whose protoc writes
"Protobuf Python Version 5.26.1" gencode. That gencode makes no runtime-version check,
so it loads under every protobuf from 5.26.1 through 7.x. Newer gencode does not: from
5.27 on it calls ``runtime_version.ValidateProtobufRuntimeVersion``, which raises
``VersionError`` when the runtime is older than the gencode, so grpcio-tools 1.85
(protobuf 7 gencode) cannot be imported under protobuf 5. The same release's gRPC
plugin only warns under grpcio older than itself. The pinned tools need protobuf < 6,
so they live outside the project's environment: on first use this script runs
``pip install --target`` into ``$PDSERVE_GRPC_TOOLS_DIR`` (default
``~/.cache/pdserve/grpcio-tools-<version>``).

The ``.proto`` files import each other as ``pdserve/proto/<name>.proto`` and are staged
under that path for protoc, so the gencode imports ``from pdserve.proto import
common_pb2`` and registers the files under names no other package uses.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GRPC_TOOLS_VERSION = "1.65.5"
PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("common.proto", "prefill.proto", "decode.proto", "router.proto")
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_PROTOC = """
import os, sys
import grpc_tools
from grpc_tools import protoc
include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
sys.exit(protoc.main(["protoc", "-I" + include] + sys.argv[1:]))
"""


def tools_dir() -> Path:
    """Where the pinned grpcio-tools are installed (``pip install --target``)."""
    default = Path.home() / ".cache" / "pdserve" / f"grpcio-tools-{GRPC_TOOLS_VERSION}"
    return Path(os.environ.get("PDSERVE_GRPC_TOOLS_DIR", default))


def ensure_tools() -> Path:
    """Install the pinned grpcio-tools into ``tools_dir()`` unless already there.

    Raises:
        RuntimeError: pip failed (e.g. no network), with its output.
    """
    target = tools_dir()
    marker = target / f"grpcio_tools-{GRPC_TOOLS_VERSION}.dist-info"
    if marker.is_dir():
        return target
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--target", str(target), f"grpcio-tools=={GRPC_TOOLS_VERSION}"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0 or not marker.is_dir():
        raise RuntimeError(f"installing grpcio-tools=={GRPC_TOOLS_VERSION} into {target} "
                           f"failed:\n{done.stdout}{done.stderr}")
    return target


def expected_outputs() -> list[str]:
    """File names of the gencode, e.g. ``common_pb2.py`` (no ``_grpc`` for ``common``)."""
    names = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        names += [stem + s for s in SUFFIXES if not (stem == "common" and "grpc" in s)]
    return names


def stage(root: Path) -> list[str]:
    """Copy ``PROTO_FILES`` to ``root/pdserve/proto/``; return their protoc names."""
    (root / "pdserve" / "proto").mkdir(parents=True, exist_ok=True)
    for proto in PROTO_FILES:
        shutil.copy(PROTO_DIR / proto, root / "pdserve" / "proto" / proto)
    return [f"pdserve/proto/{p}" for p in PROTO_FILES]


def generate(out_dir: Path) -> list[Path]:
    """Run the pinned protoc over ``PROTO_FILES``; write the gencode into ``out_dir``.

    Raises:
        RuntimeError: the tools could not be installed or protoc failed.
    """
    tools = ensure_tools()
    with tempfile.TemporaryDirectory() as tmp:
        src, gen = Path(tmp, "src"), Path(tmp, "gen")
        gen.mkdir()
        args = [f"-I{src}", f"--python_out={gen}", f"--pyi_out={gen}",
                f"--grpc_python_out={gen}", *stage(src)]
        env = {**os.environ, "PYTHONPATH": str(tools), "PYTHONNOUSERSITE": "1"}
        done = subprocess.run([sys.executable, "-c", _PROTOC, *args], check=False, cwd=src,
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed:\n{done.stdout}{done.stderr}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in expected_outputs():
            shutil.copy(gen / "pdserve" / "proto" / name, out_dir / name)
            written.append(out_dir / name)
        return written


def stale_files(generated_dir: Path) -> list[str]:
    """Names whose committed copy in ``PROTO_DIR`` differs from ``generated_dir``'s."""
    return [name for name in expected_outputs()
            if not (PROTO_DIR / name).is_file()
            or not filecmp.cmp(PROTO_DIR / name, generated_dir / name, shallow=False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed gencode differs from a fresh one")
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="where to write")
    args = parser.parse_args()
    if not args.check:
        for path in generate(args.out):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = stale_files(Path(tmp))
    if stale:
        print(f"stale gencode: {', '.join(stale)}; run python proto/generate.py")
        return 1
    print("gencode is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
