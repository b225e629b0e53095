"""Suite-wide fixtures: unique instance names, caches of the run's own, and a check
that nothing is left behind."""

from __future__ import annotations

import os
import uuid

import pytest

from tests import cache_isolation

# Before anything imports vLLM, torch or transformers: see tests/cache_isolation.py.
CACHE_ROOT = cache_isolation.isolate()

from tests.integration.cluster import Cluster, leftovers, make_config  # noqa: E402

# Every instance name this session handed out; only their segments are checked, so
# another run on the same machine cannot make this one fail.
_INSTANCES: set[str] = set()


def new_instance() -> str:
    """An instance name no other test uses (segments named tierkv.t<hex>...)."""
    name = f"t{uuid.uuid4().hex[:12]}"
    _INSTANCES.add(name)
    return name


def _our_segments() -> set[str]:
    try:
        entries = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {e for e in entries if e.startswith("tierkv.") and e.split(".")[1] in _INSTANCES}


@pytest.fixture
def instance() -> str:
    return new_instance()


@pytest.fixture(scope="session", autouse=True)
def no_leftover_segments():
    yield
    cache_isolation.remove(CACHE_ROOT)
    left = _our_segments()
    assert not left, f"shared-memory segments left in /dev/shm: {sorted(left)}"


@pytest.fixture
def make_cluster(instance, tmp_path_factory):
    """Start a node (broker + workers + tiers as real processes); everything is
    stopped by pid at teardown and nothing may be left behind."""
    started: list[Cluster] = []
    run_dirs = []

    def make(gpu_blocks: int = 32, **sections) -> Cluster:
        run_dir = tmp_path_factory.mktemp("run")
        run_dirs.append(run_dir)
        cluster = Cluster(make_config(instance, run_dir, **sections), gpu_blocks)
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.stop()
    for run_dir in run_dirs:
        assert leftovers(run_dir, instance) == []
