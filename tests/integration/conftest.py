from __future__ import annotations

import pytest

from tests.integration.cluster import Cluster, leftovers, make_config


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
