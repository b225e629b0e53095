"""A tierkv node for vLLM's engines: broker and disk tier as real processes, no gpu
workers (vLLM copies its own blocks), stopped by pid at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import leftovers
from tierkv.node.supervisor import Node

try:
    import vllm  # noqa: F401
except ImportError as e:  # not a skip: these tests are part of the suite
    raise ImportError("tests/vllm need vLLM 0.33: run scripts/test (it installs it) or "
                      "pip install 'tierkv[vllm]'") from e

from tierkv.bench.vllm_engine import EngineShape, node_config  # noqa: E402

SHAPE = EngineShape(gpu_blocks=48)


@pytest.fixture
def start_node(instance, tmp_path_factory) -> Iterator[Callable[..., Node]]:
    nodes: list[tuple[Node, Path]] = []

    def start(cpu_blocks: int = 32, page_size: int = SHAPE.page_size,
              disk_blocks: int = 1024, **sections: Any) -> Node:
        run_dir = tmp_path_factory.mktemp("run")
        node = Node(node_config(instance, run_dir, page_size, cpu_blocks, disk_blocks,
                                **sections))
        nodes.append((node, run_dir))
        node.start()
        return node

    yield start
    for node, run_dir in nodes:
        node.stop()
        assert leftovers(run_dir, instance) == []
