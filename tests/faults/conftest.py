"""The fault suite's node: one supervised node (broker, CPU worker, disk tier, S3 tier
on a local moto endpoint behind a fault-injecting proxy) shared by every fault test,
because a node costs 5-10 s to start on a 2-core machine. Each test first waits until
the node serves fully again, so the order of the tests does not matter.

The figures of every fault run are printed at the end of the session (and written as
JSON to $TIERKV_FAULT_REPORT when set); the seed is printed at the start and on every
failure: TIERKV_FAULT_SEED=<seed> replays the same random points.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import new_instance
from tests.faults import harness
from tests.faults.harness import NodeUnderTest, running_node
from tests.faults.node import disk_tier, s3_tier, seed_from_env
from tests.tiers.fixtures_s3 import TEST_ENV, FlakyEndpoint, s3_test_env, unique_bucket
from tierkv.node.s3server import S3Server

DISK_SLOTS = 8192  # 64 MiB: nothing is evicted in a session, so any missing block is lost


@pytest.fixture(scope="session")
def fault_seed() -> int:
    seed = seed_from_env()
    print(f"\nfault suite seed {seed} (TIERKV_FAULT_SEED={seed} replays it)")
    return seed


@pytest.fixture(scope="package")
def nut(tmp_path_factory: pytest.TempPathFactory, fault_seed: int) -> Iterator[NodeUnderTest]:
    """The shared node under test, torn down by pid with nothing left behind once
    tests/faults are done (not at the session's end: idle, it still takes a third of
    a core from every later test)."""
    work = tmp_path_factory.mktemp("faults")
    disk = work / "disk"
    disk.mkdir()
    with s3_test_env():
        s3 = S3Server(ready_timeout_s=60).start()
    proxy = FlakyEndpoint(s3.endpoint_url).up()
    tiers = [disk_tier(disk, DISK_SLOTS), s3_tier(proxy.endpoint_url, unique_bucket("faults"))]
    try:
        with running_node(new_instance(), work, tiers, fault_seed, disk_root=disk, s3=s3,
                          proxy=proxy, env=TEST_ENV) as under_test:
            yield under_test
    finally:
        proxy.close()
        s3.stop()


@pytest.fixture
def ready(nut: NodeUnderTest) -> NodeUnderTest:
    """The shared node, serving fully (every peer back after the last test's fault)."""
    nut.proxy.delay_s = 0.0
    nut.wait(nut.all_ready, 90, "node ready before the fault")
    return nut


def pytest_terminal_summary(terminalreporter: Any) -> None:
    results = harness.RESULTS
    if not results:
        return
    terminalreporter.section("fault injection figures")
    terminalreporter.write_line(harness.HEADER)
    for result in results:
        terminalreporter.write_line(result.row())
    if len(results) > len({r.fault for r in results}):
        for line in harness.summary_table(results):
            terminalreporter.write_line(line)
    path = os.environ.get("TIERKV_FAULT_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
        terminalreporter.write_line(f"figures written to {path}")
