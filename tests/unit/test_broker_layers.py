"""The broker's step operations are a layer below the core that calls them: they
are handed the parts they work on (the manager, the owner table, the event router,
the clock, the region, the store and load entry points), so a reader can follow
`broker.ops` without `broker.core`, and a test can run them on those parts alone."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported(path: Path) -> set[str]:
    """Every module the file imports, those for type checkers included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_step_operations_never_import_the_core_that_calls_them():
    assert "broker.core" not in _imported(ROOT / "broker" / "ops.py")


def test_the_step_operations_are_built_from_the_parts_they_use():
    import inspect

    from broker.ops import StepOps

    params = set(inspect.signature(StepOps).parameters)
    assert "core" not in params
    assert {"manager", "owners", "events", "clock", "region_id", "store", "load"} <= params
