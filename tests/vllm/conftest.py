"""A tierkv node for vLLM's engines: broker and disk tier as real processes, no gpu
workers (vLLM copies its own blocks), stopped by pid at teardown."""

from __future__ import annotations

import time
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

from tierkv.bench.vllm_engine import EngineShape, node_config, tierkv_extra_config  # noqa: E402

SHAPE = EngineShape(gpu_blocks=48)
# Generous: these tests are about what is decided, not how fast, so a loaded machine
# must not turn an answer into a RETRY or a store into "offered again", nor a disk
# that a loaded machine slows into one the load-or-recompute rule leaves (the tests of
# the budget and of the rule set their own).
DECIDE = {"budget_ms": 10_000.0, "lookup_wait_ms": 60_000.0, "pending_wait_ms": 60_000.0,
          "prefill_tokens_per_s": 0.0}


def extra_config(node: Node, **more: Any) -> dict[str, Any]:
    """`kv_connector_extra_config` for an engine on `node` in these tests."""
    return tierkv_extra_config(node, **{**DECIDE, **more})


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


@pytest.fixture
def engine_on(start_node):
    """Engines (scheduler side) on a node, closed at teardown."""
    from tierkv.bench.vllm_engine import Engine

    engines: list[Engine] = []

    def make(node: Node, copy: bool = False, shape: EngineShape = SHAPE,
             **options: Any) -> Engine:
        engine = Engine(shape, extra_config(node, **options), copy=copy,
                        name=f"e{len(engines)}")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


# -- driving tierkv's manager the way vLLM's scheduler does --------------------------------


def manager_of(engine: Any) -> Any:
    """The engine's `TierkvOffloadingManager` (vLLM's connector builds it)."""
    return engine.scheduler.connector.connector_scheduler.manager


def chunk_keys(n: int, group: int = 0, seed: int = 0) -> list[bytes]:
    """`n` vLLM offload keys of one KV-cache group, as vLLM makes them."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(bytes([seed, i]) * 16, group) for i in range(n)]


def request(req_id: str, *chains: list[bytes], tokens_per_chunk: int = 16) -> Any:
    """A vLLM `ReqContext` whose keys (one chain per group) have their positions
    recorded, as vLLM's scheduler records them before any lookup."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=req_id)
    for chain in chains:
        for i, key in enumerate(chain):
            ctx.set_offload_key_position(key, (i + 1) * tokens_per_chunk)
    return ctx


def end_step(manager: Any) -> None:
    """vLLM's end of a scheduler step, under the manager's lock."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    with manager.lock:
        manager.on_schedule_end(ScheduleEndContext((), ()))


def settle(manager: Any, timeout_s: float = 30.0) -> None:
    """Step the manager as an idle engine does until it owes the broker nothing and
    has nothing out (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with manager.lock:
            busy = manager.has_pending_work() or bool(manager.holdings.owed)
        end_step(manager)
        if not busy:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the manager still owed the broker after {timeout_s}s")
        time.sleep(0.005)


def node_statuses(node: Node, keys: list[bytes]) -> list[str]:
    """What the node says of `keys` (tierkv keys) to a client of its own."""
    from tierkv.client import Client

    with Client.from_config(node.config) as client:
        return client.lookup(keys, status=True).statuses
