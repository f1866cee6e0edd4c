"""Imports go down the layers of docs/architecture.md (Layout), never up or sideways.

From the bottom: the generated gRPC code and the kernels; the engine and KV transfer;
the cluster's state (``cluster/``); the services (prefill worker, decode worker, router),
which never import one another; and the entry points (``entrypoints/``). Every import
counts, also one inside a function or under ``if TYPE_CHECKING:``.

Also: no import loop, neither between packages nor between the modules of one package
(a module that imports its package's ``__init__`` while that ``__init__`` imports it is
one); no relative import that leaves its package; and the engine, with the KV transfer and
the kernels below it, needs no Redis, gRPC or Ray (it runs alone: offline ``LLM``,
benchmarks).
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


# --- import loops, relative imports, and what the engine does not need -----------------

# NOTE: the engine (and the KV transfer and kernels below it) runs in one process with no
# cluster around it (benchmarks, offline use, tests): no Redis, no gRPC, no Ray
STANDALONE = {"engine", "kvtransfer", "kernels"}
CLUSTER_LIBRARIES = ("redis", "grpc", "grpc_tools", "ray")


def module_name(path: Path, root: Path = ROOT) -> str:
    """``pdserve.<package>.<module>`` of a file under ``root`` (``__init__.py``: the
    package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["pdserve", *parts])


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module a ``from`` import names, relative ones resolved against ``importer``."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(path: Path, modules: set[str],
                     root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) for every pdserve module ``path`` imports, anywhere in the file
    (functions and ``if TYPE_CHECKING:`` included), relative imports resolved;
    ``from package import name`` counts the submodule ``name`` if there is one, else the
    package."""
    importer, is_package = module_name(path, root), path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, importer, is_package)
            names = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules
                     else module for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != importer:
                found.append((node.lineno, name))
    return found


def source_files() -> list[Path]:
    return sorted(path for package in LAYER for path in (ROOT / package).rglob("*.py")
                  if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def import_graph() -> dict[str, set[str]]:
    """module -> the pdserve modules it imports (see ``imported_modules``)."""
    paths = source_files()
    modules = {module_name(path) for path in paths}
    return {module_name(path): {m for _, m in imported_modules(path, modules)}
            for path in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node, each sorted (Tarjan's
    algorithm, iterative), plus any node that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1 or node in graph.get(node, ()):
                    groups.append(sorted(group))
    return groups


def package_of(module: str) -> str:
    return module.split(".")[1]


def test_no_import_loop_between_packages():
    graph = import_graph()
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(module))
    assert cycles(packages) == []


@pytest.mark.parametrize("package", sorted(LAYER))
def test_no_import_loop_inside_a_package(package):
    graph = import_graph()
    inside = {m: {t for t in targets if package_of(t) == package}
              for m, targets in graph.items() if package_of(m) == package}
    assert cycles(inside) == [], f"import loops in pdserve.{package}"


def test_relative_imports_stay_in_their_package():
    found = []
    for path in source_files():
        importer = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = _absolute(node, importer, path.name == "__init__.py")
                if target.count(".") < 1 or package_of(target) != package_of(importer):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} climbs to {target}")
    assert found == []


def test_the_engine_needs_no_redis_grpc_or_ray():
    found = []
    for package in sorted(STANDALONE):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] in CLUSTER_LIBRARIES or name.startswith("pdserve.proto"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert found == []


def test_the_loop_check_finds_loops():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_resolves_relative_and_function_imports(tmp_path):
    package = tmp_path / "engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from . import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from pdserve.engine.a import f\n")
    modules = {"pdserve.engine", "pdserve.engine.a", "pdserve.engine.b"}
    assert imported_modules(package / "a.py", modules, tmp_path) == [(2, "pdserve.engine.b")]
    assert imported_modules(package / "b.py", modules, tmp_path) == [(3, "pdserve.engine.a")]


# --- sizes a reader can hold -------------------------------------------------------------

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80  # from ``def`` to the last line; a kernel (``@triton.jit``) may be longer
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".cu", ".proto", ".sh"}


def _own_sources() -> list[Path]:
    """Every source file of the repository but generated code (``*_pb2*.py``)."""
    folders = [*LAYER, "tests", "benchmarks", "deploy", "pdserve_pkg", ".ci"]
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*")
                  if path.suffix in SOURCE_SUFFIXES and "_pb2" not in path.name
                  and "__pycache__" not in path.parts)


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)


def test_no_source_file_is_longer_than_600_lines():
    long = [f"{path.relative_to(ROOT)}: {n}" for path in _own_sources()
            if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert long == []


def test_no_function_but_a_kernel_is_longer_than_80_lines():
    long = []
    for path in _own_sources():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_kernel(node):
                continue
            if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert long == []
