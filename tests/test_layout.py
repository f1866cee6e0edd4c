"""Imports go down the layers of docs/architecture.md (Layout), never up or sideways.

From the bottom: the generated gRPC code and the kernels; the engine and KV transfer;
the cluster's state (``cluster/``); the services (prefill worker, decode worker, router),
which never import one another; and the entry points (``entrypoints/``). Every import
counts, also one inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS: list[set[str]] = [
    {"proto", "kernels"},
    {"engine", "kvtransfer"},
    {"cluster"},
    {"prefill_worker", "decode_worker", "router"},
    {"entrypoints"},
]
LAYER = {package: i for i, packages in enumerate(LAYERS) for package in packages}


def pdserve_imports(path: Path) -> list[tuple[int, str]]:
    """(line, subpackage) for every ``pdserve.<subpackage>`` that ``path`` imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "pdserve":  # from pdserve import engine
                names = [f"pdserve.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "pdserve" and len(parts) > 1 and parts[1] in LAYER:
                found.append((node.lineno, parts[1]))
    return found


def violations() -> list[str]:
    found = []
    for package, layer in LAYER.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue  # generated
            for line, target in pdserve_imports(path):
                if target == package:
                    continue
                upward = LAYER[target] > layer
                sideways = LAYER[target] == layer
                if upward or sideways:
                    kind = "up" if upward else "sideways"
                    found.append(f"{path.relative_to(ROOT)}:{line} imports pdserve.{target} "
                                 f"({kind}: {package} is layer {layer}, {target} layer "
                                 f"{LAYER[target]})")
    return found


def test_every_package_folder_has_a_layer():
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"pdserve_pkg", "tests"}
    assert folders <= set(LAYER), f"no layer for {sorted(folders - set(LAYER))}"
    assert set(LAYER) <= folders


def test_imports_only_go_down():
    assert violations() == []


@pytest.mark.parametrize(("source", "expected"), [
    ("from pdserve.router.model_service import ModelService\n", [(1, "router")]),
    ("def f():\n    import pdserve.entrypoints.cli\n", [(2, "entrypoints")]),
    ("from pdserve import engine, cluster\n", [(1, "engine"), (1, "cluster")]),
    ("from . import sibling\nimport os\n", []),
])
def test_the_check_sees_every_form_of_import(source, expected, tmp_path):
    path = tmp_path / "module.py"
    path.write_text(source)
    assert pdserve_imports(path) == expected
