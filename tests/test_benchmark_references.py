"""Every ``module.name`` a benchmark script uses of another benchmark module
(``peers.serve_round``, ``serving.run``, ...) still exists there: a helper removed or
renamed in one script once broke two others (``peers.write_model``), which failed only
when run."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SIBLINGS = {p.stem for p in BENCHMARKS.glob("*.py")}


def sibling_references(path: Path) -> set[tuple[str, str]]:
    """(module, attribute) for each ``module.attribute`` of a sibling imported whole."""
    tree = ast.parse(path.read_text(), str(path))
    imported = {alias.asname or alias.name for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names
                if alias.name in SIBLINGS}
    return {(node.value.id, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in imported}


def sibling_imports(path: Path) -> set[tuple[str, str]]:
    """(module, name) for each ``from module import name`` of a sibling."""
    tree = ast.parse(path.read_text(), str(path))
    return {(node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module in SIBLINGS
            for alias in node.names}


@pytest.mark.parametrize("script", sorted(SIBLINGS))
def test_what_a_benchmark_uses_of_another_exists(monkeypatch, script):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    path = BENCHMARKS / f"{script}.py"
    used = sibling_references(path) | sibling_imports(path)
    missing = []
    for module, name in sorted(used):
        if not hasattr(importlib.import_module(module), name):
            missing.append(f"{module}.{name}")
    assert not missing, f"benchmarks/{script}.py uses {missing}, which no longer exist"


def test_the_check_sees_a_missing_helper(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("import peers\nfrom serving import run\npeers.write_model(1)\n")
    assert sibling_references(script) == {("peers", "write_model")}
    assert sibling_imports(script) == {("serving", "run")}
