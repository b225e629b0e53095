"""A client that lives through a broker restart: no job of the old broker is ever
taken for one of the new, and no row written into the old region becomes a hit."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import new_instance
from tests.integration.cluster import LAYOUT, keys, leftovers, make_config
from tests.integration.test_supervisor import (
    all_ready,
    child_pids,
    start_supervisor,
    stop_supervisor,
    wait_status,
)
from tierkv.client import Client, RemoteError
from tierkv.core.shm import SharedRegion
from tierkv.engine import KVLayout, allocate_kv_cache

BLOCKS = 32


def _restart_broker(config, proc) -> None:  # noqa: ANN001
    before = wait_status(config, all_ready(config), proc)
    old = child_pids(before)["broker"]
    os.kill(old, signal.SIGKILL)
    wait_status(config, lambda s: any(c["name"] == "broker" and c["pid"] != old and c["alive"]
                                      for c in s["children"]), proc)
    wait_status(config, all_ready(config), proc)


def _register(config, kv) -> Client:  # noqa: ANN001
    """An engine's client with its KV cache registered, once a worker is ready."""
    deadline = time.monotonic() + 30
    while True:
        engine = Client.from_config(config)
        try:
            engine.register_kv(0, kv.registration())
            return engine
        except (RemoteError, ConnectionError):
            engine.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _store_when_ready(client: Client, ks: list[bytes]):  # noqa: ANN202
    """The first store after a restart waits for the worker to have the KV cache back."""
    deadline = time.monotonic() + 30
    while True:
        try:
            store = client.store(ks, list(range(len(ks))))
            if store.job_id is not None:
                return store
        except RemoteError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


@pytest.fixture
def node(tmp_path):
    instance = new_instance()
    config = make_config(instance, tmp_path, tiers=[])
    proc = start_supervisor(config, tmp_path / "node.toml.in")
    kv = allocate_kv_cache(instance, 0, KVLayout.blocks_outer(num_blocks=BLOCKS, **LAYOUT))
    try:
        wait_status(config, all_ready(config), proc)
        yield config, proc, kv
    finally:
        code = stop_supervisor(proc)
        kv.close()
        assert code == 0
        assert leftovers(tmp_path, instance) == []


def test_a_wait_across_a_broker_restart_never_reports_a_load_before_its_bytes(node):
    config, proc, kv = node
    view = kv.tensors[0].view(BLOCKS, -1)
    engine = _register(config, kv)
    client = Client.from_config(config)
    try:
        client.use_kv(engine.registration_tokens)
        first, second = keys(*range(4), prefix=b"a"), keys(*range(4), prefix=b"b")
        view[:8] = 3
        old_jobs = {client.store(first, list(range(4))).job_id,
                    client.store(second, list(range(4, 8))).job_id}
        client.wait(sorted(old_jobs)[1:], timeout=30)  # the other one may be held
        _restart_broker(config, proc)

        for round_ in range(3):
            ks = keys(*range(4), prefix=b"c%d" % round_)
            view[:4] = 10 + round_
            store = _store_when_ready(client, ks)
            assert store.job_id not in old_jobs
            assert client.wait([store.job_id], timeout=30)[store.job_id].success
            view[:4] = 0
            assert client.lookup(ks).hits == 4
            load = client.load(ks, list(range(4)))
            assert load.job_id not in old_jobs
            assert client.wait([load.job_id], timeout=30)[load.job_id].success
            # Reported done: every byte has landed.
            assert bool((view[:4] == 10 + round_).all()), f"round {round_}: bytes not landed"
        # Nothing of the old broker is handed out as finished.
        assert not {r.job_id for r in client.step().finished} & old_jobs
        # A wait for a job of the old broker fails at once rather than succeeding.
        (lost,) = client.wait([min(old_jobs)], timeout=10).values()
        assert not lost.success
    finally:
        client.close()
        engine.close()


def test_a_commit_into_the_region_of_a_broker_that_is_gone_is_refused(node):
    config, proc, _kv = node
    client = Client.from_config(config)
    try:
        region = SharedRegion.attach(config.instance)
        old_generation = region.generation
        region.close()
        _restart_broker(config, proc)
        ks = keys(0, 1, prefix=b"r")
        deadline = time.monotonic() + 30
        while True:
            reserve = client.reserve(ks)
            if reserve.ok or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert reserve.ok and reserve.region != old_generation
        with pytest.raises(RemoteError) as refused:
            client.commit(ks, region=old_generation)
        assert refused.value.code == "stale_region"
        assert client.lookup(ks).hits == 0  # nothing of the old mapping is served
        # Written into the region the broker serves, the same keys are stored.
        again = client.reserve(ks)
        client.commit(ks, region=again.region)
        assert client.lookup(ks).hits == 2
    finally:
        client.close()


def test_an_oversized_region_in_a_commit_is_refused_before_any_work(node):
    """A hostile peer's region string would be echoed once per refused commit group."""
    config, _proc, _kv = node
    client = Client.from_config(config)
    try:
        ks = keys(0, prefix=b"o")
        reserve = client.reserve(ks)
        with pytest.raises(RemoteError) as refused:
            client.commit(ks, region="x" * 100_000)
        assert refused.value.code == "bad_request" and "ops.region" in refused.value.message
        assert len(refused.value.message) < 200
        client.commit(ks, region=reserve.region)  # the reservation is untouched
        assert client.lookup(ks).hits == 1
    finally:
        client.close()
