"""tests/sglang: tierkv as SGLang's HiCache L3, against SGLang's own classes (0.5.23):
its dynamic backend factory, real host KV pools (`MHATokenToKVPoolHost`,
`MLATokenToKVPoolHost`) on the CPU, and a real `HiCacheController` with its storage
threads, over a real tierkv node (broker and disk tier as processes).

They run in the environment `scripts/test` builds for them (`.venv-sglang`: SGLang
without its dependency list, on the CPU torch): `scripts/test tests/sglang`. In any
other environment they are not collected (the run's header says so).

What the CPU cannot run: an SGLang server (no CPU kernel wheel), and the controller's
device <-> host copies (CUDA streams): those need a GPU machine with SGLang's full
install (`scripts/gpu-check`'s SGLang part, `tierkv.sglang.server_check`), and nothing
here stands in for them.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

SGLANG = importlib.util.find_spec("sglang") is not None
if not SGLANG:
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config: pytest.Config) -> str:
    if not SGLANG:
        return ("tests/sglang: not collected here (no sglang); `scripts/test tests/sglang` "
                "runs them in their own environment")
    import sglang

    return f"tests/sglang: sglang {sglang.__version__}"


def _stand_in_torchvision() -> None:
    """SGLang's multimodal config modules import `torchvision.transforms` when its
    memory pools load; HiCache never calls it, and PyPI's torchvision needs a CUDA
    torch. A module that answers every name, in `sys.modules` only, after
    `import sglang` (transformers asks whether torchvision exists before that)."""
    if "torchvision" in sys.modules:
        return

    def answer(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        module = types.ModuleType(name)
        module.__path__ = []
        module.__getattr__ = answer  # type: ignore[attr-defined]
        sys.modules[name] = module


if SGLANG:
    import sglang  # noqa: F401  (before the stand-in: see above)

    _stand_in_torchvision()


@pytest.fixture
def start_node(instance, tmp_path_factory) -> Iterator[Callable[..., Any]]:
    """Nodes for SGLang engines: broker and disk tier as real processes, no gpu
    workers (the backend copies its own pages); every node is stopped by pid."""
    from tests.integration.cluster import leftovers
    from tierkv.bench.engine_nodes import node_config
    from tierkv.node.supervisor import Node

    nodes: list[tuple[Any, Path]] = []

    def start(page_size: int, cpu_blocks: int = 32, disk_blocks: int = 256,
              run_dir: Path | None = None) -> Any:
        run_dir = run_dir or tmp_path_factory.mktemp("run")
        node = Node(node_config(instance, run_dir, page_size, cpu_blocks, disk_blocks,
                                label="<sglang test node>"))
        nodes.append((node, run_dir))
        node.start()
        return node

    yield start
    for node, _ in nodes:
        node.stop()
    for run_dir in dict.fromkeys(run_dir for _, run_dir in nodes):  # a restart shares one
        assert leftovers(run_dir, instance) == []
