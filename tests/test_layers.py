"""The package's import graph: no circles, and every import points down the layers a reader can draw.

Every import counts, the ones inside functions too (they are read from the source, not from sys.modules).
The layers, lowest first; a module may import its own layer and the ones below:

0. declarations: the formulation spec and registry, input validation, where kernels run (attnlab.runtime);
1. implementations: the oracle modules (attnlab.oracles.*) and the Triton kernels (attnlab.kernels.*);
2. front ends and measurement: attnlab.oracle, attnlab.kernel, metrics, evaluate, conventions, the package;
3. the property library (attnlab.properties: strategies, checks, targets, suite, specimens);
4. commands (attnlab.commands.*: report, map, validate, selftest, bench, campaign);
5. entry points: the CLI, the pytest plugin and the property suites it runs (attnlab.properties' conftest,
   session and test modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folders of the installed subpackages (pyproject.toml's package-dir).
PACKAGE_DIRS = {"attnlab": ROOT / "attnlab", "attnlab.oracles": ROOT / "oracles", "attnlab.kernels": ROOT / "kernels",
                "attnlab.properties": ROOT / "properties"}

LAYERS: tuple[tuple[str, ...], ...] = (
    ("attnlab.spec", "attnlab.registry", "attnlab.validation", "attnlab.runtime"),
    ("attnlab.oracles", "attnlab.kernels"),
    ("attnlab", "attnlab.oracle", "attnlab.kernel", "attnlab.metrics", "attnlab.evaluate", "attnlab.conventions"),
    ("attnlab.properties",),
    ("attnlab.commands",),
    ("attnlab.cli", "attnlab.pytest_plugin", "attnlab.properties.conftest", "attnlab.properties.session",
     "attnlab.properties.test_"),
)


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> source file."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its source (relative imports resolved)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (stem, node.module or "") if p)
            candidates = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def layer(name: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = name == prefix or name.startswith(prefix + ".") or (prefix.endswith("_") and name.startswith(prefix))
            if matches and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"{name} is in no layer of tests/test_layers.py: place it")
    return best[0]


GRAPH = {name: imports_of(name, path, set(modules())) for name, path in modules().items()}


def test_every_module_has_a_layer() -> None:
    for name in GRAPH:
        layer(name)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_point_down(name: str) -> None:
    upward = sorted(t for t in GRAPH[name] if layer(t) > layer(name))
    assert not upward, f"{name} (layer {layer(name)}) imports {', '.join(f'{t} (layer {layer(t)})' for t in upward)}"


def test_no_import_circle() -> None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(GRAPH.get(node, ())):
            if target == "attnlab":  # every submodule's parent package: imported by Python, not a dependency
                continue
            if state.get(target) == 1:
                circle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def test_the_walk_sees_imports_inside_functions() -> None:
    assert "attnlab.commands.report" in GRAPH["attnlab.commands.stability"]
    assert GRAPH["attnlab.cli"] >= {"attnlab.commands.report", "attnlab.commands.bench"}
