"""Rows an engine reserved ahead (`tierkv.vllm.spares`) at a broker that was then
SIGKILLed: the supervisor starts a new broker (a new CPU region), and the engine's
first request after it is stored there, never written into the dead broker's rows.
vLLM's real Scheduler and `TierkvConnector` on a supervised node (`tierkv up`)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cluster import leftovers
from tests.integration.test_supervisor import (
    child_pids,
    start_supervisor,
    stop_supervisor,
    wait_status,
)
from tests.vllm.conftest import DECIDE, SHAPE, manager_of, node_statuses
from tests.vllm.test_store_retry import document_keys, documents
from tierkv.bench.vllm_engine import Engine, node_config
from tierkv.client import BrokerUnavailable, Client
from tierkv.node.config import Config

NAMES = {"broker", "tier:disk:0"}
BACK_S = 30.0  # a restarted broker answers within this (its start, then a tier's)


def node_up(status: dict) -> bool:
    return {c["name"] for c in status["children"] if c["alive"]} >= NAMES


@pytest.fixture
def supervised(instance, tmp_path) -> Iterator[tuple[Config, Path, object]]:
    """A node run by its supervisor (which restarts a child that dies), stopped by pid."""
    config = node_config(instance, tmp_path, SHAPE.page_size, cpu_blocks=64, disk_blocks=256)
    path = tmp_path / "node.toml"
    proc = start_supervisor(config, path)
    try:
        wait_status(config, node_up, proc)
        yield config, path, proc
    finally:
        stop_supervisor(proc)
    assert leftovers(tmp_path, instance) == []


def kill_broker(config: Config, proc) -> None:  # noqa: ANN001
    """SIGKILL the broker and wait until the supervisor has the node back."""
    old = child_pids(wait_status(config, node_up, proc))["broker"]
    os.kill(old, signal.SIGKILL)
    wait_status(config, lambda s: node_up(s) and child_pids(s)["broker"] != old, proc)
    deadline = time.monotonic() + BACK_S
    while True:  # its socket is bound once it answers a client of its own
        try:
            with Client.from_config(config) as client:
                client.stats()
            return
        except (BrokerUnavailable, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_the_first_request_after_a_broker_restart_is_stored(supervised):
    """The engine is idle while the broker is SIGKILLed and restarted, holding rows
    reserved ahead at the dead one: its first request after the node is back is
    stored at the new broker (found by a lookup of the node's own afterwards)."""
    config, path, proc = supervised
    extra = {"spec_name": "TierkvOffloadingSpec", "spec_module_path": "tierkv.vllm",
             "tierkv_config": str(path), **DECIDE}
    engine = Engine(SHAPE, extra)
    docs = documents(3)
    try:
        for doc in docs[:2]:
            engine.add(doc + [7, 8, 0], max_tokens=2)
        engine.run()
        assert len(manager_of(engine).spares) > 0  # rows held ahead at this broker
        kill_broker(config, proc)
        # As an engine that was idle while the node restarted: its socket is back.
        assert manager_of(engine).link.client.connected(BACK_S)
        engine.add(docs[2] + [7, 8, 1], max_tokens=2)
        engine.run()
        stored = node_statuses(_Reader(config), document_keys(engine, docs[2]))
    finally:
        engine.close()
    assert "miss" not in stored
    assert engine.mismatches == []


class _Reader:
    """What `node_statuses` needs of a node: its config."""

    def __init__(self, config: Config) -> None:
        self.config = config
