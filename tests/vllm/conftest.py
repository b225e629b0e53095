"""A tierkv node for vLLM's engines: broker and disk tier as real processes, no gpu
workers (vLLM copies its own blocks), stopped by pid at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import leftovers
from tierkv.node.config import Config, config_from_dict
from tierkv.node.supervisor import Node

try:
    import vllm  # noqa: F401
except ImportError as e:  # not a skip: these tests are part of the suite
    raise ImportError("tests/vllm need vLLM 0.33: run scripts/test (it installs it) or "
                      "pip install 'tierkv[vllm]'") from e

from tierkv.bench.vllm_engine import EngineShape  # noqa: E402

SHAPE = EngineShape(gpu_blocks=48)


def node_config(instance: str, run_dir: Path, page_size: int, cpu_blocks: int,
                disk_blocks: int = 1024, **sections: Any) -> Config:
    (run_dir / "disk").mkdir(exist_ok=True)
    data: dict[str, Any] = {
        "instance": instance,
        "run_dir": str(run_dir),
        "cpu": {"num_blocks": cpu_blocks, "page_size": page_size, "world_size": 1},
        "broker": {"heartbeat_s": 0.5, "tick_ms": 2.0, "job_timeout_s": 10.0},
        "supervisor": {"ready_timeout_s": 30.0, "stop_timeout_s": 10.0},
        "worker": {"enabled": False},
        "tiers": [{"type": "disk", "root": str(run_dir / "disk"),
                   "budget_bytes": disk_blocks * page_size}],
        **sections,
    }
    return config_from_dict(data, "<test>")


@pytest.fixture
def start_node(instance, tmp_path_factory) -> Iterator[Callable[..., Node]]:
    nodes: list[tuple[Node, Path]] = []

    def start(cpu_blocks: int = 32, page_size: int = SHAPE.page_size, **kw: Any) -> Node:
        run_dir = tmp_path_factory.mktemp("run")
        node = Node(node_config(instance, run_dir, page_size, cpu_blocks, **kw))
        nodes.append((node, run_dir))
        node.start()
        return node

    yield start
    for node, run_dir in nodes:
        node.stop()
        assert leftovers(run_dir, instance) == []


def extra_config(node: Node, **more: Any) -> dict[str, Any]:
    """`kv_connector_extra_config` for a vLLM engine on `node`."""
    return {"spec_name": "TierkvOffloadingSpec", "spec_module_path": "tierkv.vllm",
            "tierkv_config": str(node.config_path), **more}
