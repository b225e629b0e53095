"""The layout's promises (docs/architecture.md): imports point one way, and there
are no import circles, so a newcomer can read any layer without the ones above it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tierkv", "broker", "workers")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(path: Path) -> set[str]:
    """Every absolute import of the module, wherever it is in the file, but those
    for type checkers only (`if TYPE_CHECKING:`), which never run."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {t for i in _imports(p) if (t := resolve(i)) not in (None, m)}
            for m, p in modules.items()}


def test_the_library_and_processes_never_import_scripts_or_tests():
    offenders = {m: sorted(i for i in _imports(p) if i.split(".")[0] in ("scripts", "tests"))
                 for m, p in _modules().items()}
    assert {m: i for m, i in offenders.items() if i} == {}


def test_the_core_imports_nothing_above_it():
    above = ("tierkv.node", "tierkv.bench", "tierkv.demo", "tierkv.client", "tierkv.engine",
             "tierkv.wire", "tierkv.vllm", "broker", "workers")
    graph = _graph()
    bad = {m: sorted(t for t in targets if t.startswith(above))
           for m, targets in graph.items() if m.startswith("tierkv.core")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_there_are_no_import_circles():
    graph = _graph()
    # A package's __init__ that re-exports its submodules is not a circle with them.
    for module, targets in graph.items():
        targets.difference_update(t for t in list(targets) if t.startswith(module + "."))
    state: dict[str, int] = {}
    path: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert circles == []


def test_every_import_of_our_packages_names_a_module_that_exists():
    """Imports inside functions (optional parts, drivers) run only when used: a moved
    module must not leave one behind that fails then."""
    modules = _modules()
    missing = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] in PACKAGES and target not in modules:
                    missing.setdefault(name, []).append(target)
    assert missing == {}
