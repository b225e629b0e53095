"""What the real-engine tests share: the models, a node for engines, the reference
outputs of engines without offloading, and how a run's hits are read.

Every engine is a process of its own (`tierkv.demo.vllm_process`), started by a
fixture and ended by pid at its teardown; so is every node process (`Node`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.integration.cluster import leftovers
from tierkv.bench.engine_nodes import node_config as engine_node_config
from tierkv.client import Client
from tierkv.core.shm import SharedRegion
from tierkv.demo.vllm_process import EngineConfig, EngineProcess, ModelShape, tierkv_transfer
from tierkv.demo.vllm_workload import Round
from tierkv.node.config import Config
from tierkv.node.lifecycle import wait_ready
from tierkv.node.supervisor import Node

BLOCK = 32  # tokens per KV block: vLLM's CPU attention needs a multiple of 32
KV_BLOCKS = 40  # the engine's own KV cache: 1,280 tokens, far less than a workload
MAX_TOKENS = 8
# Two models whose KV blocks have the same size (64 KiB) and different layouts:
# A has 2 layers of 2 KV heads, B 4 layers of 1. Engines of both on one node, told
# they are the same model (`namespace`), must still never read each other's blocks.
SHAPES = {"A": ModelShape(), "B": ModelShape(layers=4, hidden=128, heads=2, kv_heads=1,
                                            intermediate=256, seed=1)}
NAMESPACE = "tests-engine-model"
ENGINE_PYTHON = os.environ.get("TIERKV_ENGINE_PYTHON") or sys.executable
START_S = 300.0  # an engine's start, most of it importing vLLM
RUN_S = 240.0  # one run of a workload, faults included
assert SHAPES["A"].page_size(BLOCK) == SHAPES["B"].page_size(BLOCK)
PAGE = SHAPES["A"].page_size(BLOCK)


# -- a node --------------------------------------------------------------------------------


def node_config(instance: str, run_dir: Path, cpu_blocks: int,
                disk_blocks: int = 0) -> Config:
    tiers = []
    if disk_blocks:
        (run_dir / "disk").mkdir(exist_ok=True)
        tiers.append({"type": "disk", "root": str(run_dir / "disk"),
                      "budget_bytes": disk_blocks * (PAGE + 4096)})
    return node_config_with_tiers(instance, run_dir, cpu_blocks, tiers)


def node_config_with_tiers(instance: str, run_dir: Path, cpu_blocks: int,
                           tiers: list[dict[str, Any]]) -> Config:
    """A node with any lower tiers (entries as in a node's config file): a test
    restarts a node with another set of them (`EngineNode.restart_with`)."""
    return engine_node_config(instance, run_dir, PAGE, cpu_blocks, label="<tests/engine node>",
                              tiers=tiers)


class EngineNode:
    """A node (broker and tier processes) that can be restarted on its run directory
    (the disk tier keeps its blocks; the CPU tier starts empty)."""

    def __init__(self, config: Config, python: str = sys.executable) -> None:
        self.config = config
        self.python = python  # of the node's processes (an S3 tier needs boto3)
        self.node = Node(config, python=python)
        self.run_dir = config.run_path

    def start(self) -> EngineNode:
        self.node.start()
        return self

    def stop(self) -> None:
        self.node.stop()

    def restart(self) -> None:
        self.node.stop()
        self.node = Node(self.config, python=self.python)
        self.node.start()

    def restart_with(self, config: Config) -> None:
        """Restart on `config` (the same instance and run directory, other tiers)."""
        if (config.instance, config.run_path) != (self.config.instance, self.run_dir):
            raise ValueError("a node restarts on its own instance and run directory")
        self.config = config
        self.restart()

    @property
    def config_path(self) -> Path:
        return self.node.config_path

    def kill(self, name: str) -> None:
        self.node.kill(name)

    def respawn(self, name: str) -> None:
        """Start child `name` again (what the supervisor does for a child that died)."""
        spec = next(s for s in self.node.specs() if s.name == name)
        child = self.node.children[name]
        child.proc.wait(10)
        child.close_fds()
        wait_ready([self.node.spawn(spec)], self.config.supervisor.ready_timeout_s)

    def stats(self) -> dict[str, Any]:
        with Client.from_config(self.config) as client:
            return client.stats()

    def corrupt_cpu_tier(self, seed: int = 0) -> int:
        """Fill every row of the CPU tier with random bytes; returns the rows."""
        with SharedRegion.attach(self.config.instance) as region:
            rows = region.numpy()
            rows[:] = np.random.default_rng(seed).integers(0, 256, rows.shape, dtype=np.uint8)
            return int(rows.shape[0])

    def leftovers(self) -> list[str]:
        return leftovers(self.run_dir, self.config.instance)


# -- engines -------------------------------------------------------------------------------


def engine_config(model: Path, layout: str, node: EngineNode | None = None,
                  make_model: bool = False, **tierkv: Any) -> EngineConfig:
    """An engine of `layout` offloading into `node` (None: no offloading); `tierkv`
    goes to its `kv_connector_extra_config`."""
    transfer = None
    if node is not None:
        transfer = tierkv_transfer(node.config_path, namespace=NAMESPACE, **tierkv)
    return EngineConfig(model=str(model), shape=SHAPES[layout], block_size=BLOCK,
                        kv_blocks=KV_BLOCKS, max_model_len=1024, max_num_seqs=16,
                        max_num_batched_tokens=2048, kv_transfer=transfer,
                        make_model=make_model)


@dataclass
class Engines:
    """Starts engines for a scope and ends every one of them, by pid, at its end."""

    log_dir: Path
    started: list[EngineProcess] = field(default_factory=list)

    def start(self, config: EngineConfig, name: str) -> EngineProcess:
        engine = EngineProcess(config, self.log_dir / f"{name}.log", python=ENGINE_PYTHON)
        self.started.append(engine)
        t0 = time.monotonic()
        engine.start(START_S)
        print(f"engine {name} (pid {engine.pid}) up in {time.monotonic() - t0:.1f}s, "
              f"{engine.ready['device_blocks']} device blocks")
        return engine

    def stop_all(self) -> None:
        for engine in self.started:
            engine.stop()
        self.started.clear()


class References:
    """Outputs of engines without offloading, one per layout (started on first use,
    kept for the session); each workload computed once."""

    def __init__(self, engines: Engines, models: dict[str, Path]) -> None:
        self.engines = engines
        self.models = models
        self._engines: dict[str, EngineProcess] = {}
        self._outputs: dict[tuple[str, str], list[list[list[int]]]] = {}

    def engine(self, layout: str) -> EngineProcess:
        if layout not in self._engines:
            self._engines[layout] = self.engines.start(
                engine_config(self.models[layout], layout, make_model=True),
                f"reference-{layout}")
        return self._engines[layout]

    def model(self, layout: str) -> Path:
        """The layout's model, written by its reference engine as it starts."""
        self.engine(layout)
        return self.models[layout]

    def outputs(self, rounds: list[Round], layout: str = "A") -> list[list[list[int]]]:
        key = (layout, repr(rounds))
        if key not in self._outputs:
            result = self.engine(layout).run(rounds, MAX_TOKENS, timeout_s=RUN_S)
            self._outputs[key] = tokens(result)
        return self._outputs[key]


# -- reading a run -------------------------------------------------------------------------


def tokens(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[r["tokens"] for r in row] for row in result["rounds"]]


def identical(result: dict[str, Any], reference: list[list[list[int]]]) -> tuple[int, int]:
    """(requests whose output equals the reference token for token, requests)."""
    got = tokens(result)
    same = sum(a == b for ra, rb in zip(got, reference, strict=True)
               for a, b in zip(ra, rb, strict=True))
    return same, sum(len(r) for r in reference)


def hits(result: dict[str, Any]) -> dict[str, int]:
    """Prompt tokens served from cache in the run, by source (vLLM's count):
    `device` its own prefix cache, `host` tierkv's CPU tier, `disk` promoted from
    tierkv's disk tier, `computed` the rest."""
    metrics = result["metrics"]
    out = {source: int(metrics.get(f"vllm:prompt_tokens_cached_by_source{{source={source}}}",
                                   0))
           for source in ("device", "host", "disk", "external_unspecified")}
    out["computed"] = int(metrics.get("vllm:prompt_tokens_by_source{source=local_compute}", 0))
    return out


def node_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """What the node did between two `stats()`: CPU-tier hits, blocks promoted from
    each tier, blocks stored."""
    def diff(path: tuple[str, ...]) -> int:
        a: Any = after
        b: Any = before
        for p in path:
            a = a.get(p, {}) if isinstance(a, dict) else 0
            b = b.get(p, {}) if isinstance(b, dict) else 0
        return int((a or 0) - (b or 0))

    out = {"cpu_hits": diff(("cpu", "hits")),
           "stored": diff(("cpu", "stores_completed")),
           "promotions": diff(("tiering", "promotions_landed"))}
    for tier in after.get("tiers", {}):
        out[f"{tier}_promoted"] = diff(("tiers", tier, "promoted_blocks"))
    return out


def ttft(result: dict[str, Any]) -> float:
    """Mean time to first token of the run's requests (seconds)."""
    values = [r["ttft_s"] for row in result["rounds"] for r in row]
    return sum(values) / len(values) if values else 0.0


def describe(what: str, result: dict[str, Any], reference: list[list[list[int]]],
             node: dict[str, int] | None = None) -> str:
    same, total = identical(result, reference)
    h = hits(result)
    line = (f"{what}: {same}/{total} identical; hit tokens device {h['device']}, "
            f"host {h['host']}, disk {h['disk']}, computed {h['computed']}; "
            f"mean TTFT {ttft(result) * 1000:.0f} ms")
    if node:
        line += "; node " + ", ".join(f"{k} {v}" for k, v in node.items())
    return line


def managed_node(instance: str, run_dir: Path, cpu_blocks: int,
                 disk_blocks: int = 0) -> Iterator[EngineNode]:
    """A started node, stopped at the end; nothing of it may be left behind."""
    node = EngineNode(node_config(instance, run_dir, cpu_blocks, disk_blocks)).start()
    try:
        yield node
    finally:
        node.stop()
    assert node.leftovers() == []
