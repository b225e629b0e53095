"""The service end to end on CPU: real processes, real sockets, real shared memory."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.integration.cluster import key_bytes, keys, step_until, wait_for
from tierkv.client import BrokerUnavailable, Client, RemoteError
from tierkv.core.shm import SharedRegion


def test_store_then_load_returns_the_same_bytes(make_cluster):
    cluster = make_cluster()
    c = cluster.client()
    ks = keys(1, 2, 3, 4)
    cluster.fill(ks, [0, 1, 2, 3])
    store = c.store(ks, [0, 1, 2, 3], req_id="r1")
    assert store.keys_accepted == ks
    (result,) = wait_for(c, {store.job_id}).values()
    assert result.success and result.kind == "store"
    cluster.scramble([0, 1, 2, 3, 10, 11, 12, 13])
    assert c.lookup(ks, req_id="r2").hits == 4
    load = c.load(ks, [10, 11, 12, 13], req_id="r2")
    assert wait_for(c, {load.job_id})[load.job_id].success
    assert cluster.holds(ks, [10, 11, 12, 13])
    assert not cluster.holds(ks, [0, 1, 2, 3])  # the source blocks were scrambled
    # Storing present keys again copies nothing.
    assert c.store(ks, [0, 1, 2, 3]).keys_accepted == []


def test_a_cpu_worker_copies_without_loading_torch(make_cluster):
    """On a node without a GPU the worker copies with numpy: importing torch would
    cost it seconds at every start and restart, and some 200 MB."""
    cluster = make_cluster()
    c = cluster.client()
    ks = keys(5, 6)
    cluster.fill(ks, [0, 1])
    assert wait_for(c, {c.store(ks, [0, 1]).job_id}).popitem()[1].success
    assert c.lookup(ks, req_id="r").hits == 2
    assert wait_for(c, {c.load(ks, [8, 9], req_id="r").job_id}).popitem()[1].success
    assert cluster.holds(ks, [8, 9])
    # A CUDA cache is refused without opening it (that would load torch), and the
    # CPU cache stays attached.
    cuda = {**cluster.kv[0].registration(), "device": "cuda", "storages": []}
    with pytest.raises(RemoteError, match="copies on the CPU"):
        c.register_kv(0, cuda, token=cluster.registration_tokens[0])
    assert c.lookup(ks, req_id="r2").hits == 2
    assert wait_for(c, {c.load(ks, [10, 11], req_id="r2").job_id}).popitem()[1].success
    assert cluster.holds(ks, [10, 11])
    maps = Path(f"/proc/{cluster.node.pid('worker0')}/maps").read_text()
    assert "libtorch" not in maps


def test_batch_runs_one_step_in_one_round_trip(make_cluster):
    cluster = make_cluster()
    c = cluster.client()
    ks = keys(7, 8)
    cluster.fill(ks, [4, 5])
    results = c.batch().lookup(ks, "r").store(ks, [4, 5], "r").touch(ks).step().send()
    lookup, store, touched, step = results
    assert lookup.hits == 0 and store.keys_accepted == ks and touched is None
    wait_for(c, {store.job_id})
    bad = c.batch().load(keys(99), [0], "r").lookup(ks, "r").send()
    assert isinstance(bad[0], RemoteError) and bad[0].code == "bad_request"
    assert bad[1].hits == 2  # the refused op did not stop the others


def test_evicted_block_is_promoted_back_from_the_tier(make_cluster):
    cluster = make_cluster(cpu={"num_blocks": 8})
    c = cluster.client()
    first, second = keys(*range(8)), keys(*range(100, 108))
    cluster.fill(first, list(range(8)))
    wait_for(c, {c.store(first, list(range(8))).job_id})
    # The cascade to the memory tier finishes within a few steps. The tier's count
    # grows when its completion arrives; the cascade's readers are released only
    # when the broker applies it at a later step, and until then `first` cannot be
    # evicted (under load the next store was once refused and `first` stayed).
    step_until(c, lambda: c.stats()["tiers"]["memory"]["blocks"] == 8
               and c.stats()["tiering"]["cascades_in_flight"] == 0)
    cluster.fill(second, list(range(8, 16)))
    store = c.store(second, list(range(8, 16)))
    assert store.keys_accepted == second and not store.refused
    wait_for(c, {store.job_id})
    # `second` is still cascading to the memory tier, so every CPU block may have a
    # reader now: the promotion of `first` finds no room. That was a flat miss (the
    # race seen under load); it is `pending` now, as it should be.
    first_lookup = c.lookup(first[:4], "r")
    assert first_lookup.pending and first_lookup.hits == 0
    hit = step_until(c, lambda: c.lookup(first[:4], "r").hits == 4)
    assert hit
    cluster.scramble([20, 21, 22, 23])
    load = c.load(first[:4], [20, 21, 22, 23], req_id="r")
    assert wait_for(c, {load.job_id})[load.job_id].success
    assert cluster.holds(first[:4], [20, 21, 22, 23])
    stats = c.stats()
    assert stats["tiers"]["memory"]["promoted_blocks"] == 4
    assert stats["cpu"]["evictions"] >= 8


def test_world_size_two_each_rank_writes_its_own_page(make_cluster):
    cluster = make_cluster(cpu={"world_size": 2, "num_blocks": 8})
    c = cluster.client()
    ks = keys(1, 2, 3)
    cluster.fill(ks, [3, 4, 5])
    store = c.store(ks, [3, 4, 5])
    assert wait_for(c, {store.job_id})[store.job_id].success
    region = SharedRegion.attach(cluster.config.instance)
    try:
        page = cluster.config.cpu.page_size
        for rank in range(2):
            for key in ks:
                # Rows come out of the allocator in order: key i in row i.
                row = ks.index(key)
                assert bytes(region.page(row, rank)) == key_bytes(key, rank, page)
    finally:
        region.close()
    cluster.scramble([3, 4, 5])
    load = c.load(ks, [3, 4, 5])
    assert wait_for(c, {load.job_id})[load.job_id].success
    assert cluster.holds(ks, [3, 4, 5])


def test_store_is_refused_when_room_cannot_be_made(make_cluster):
    cluster = make_cluster(cpu={"num_blocks": 4})
    c = cluster.client()
    ks = keys(1, 2, 3, 4)
    cluster.fill(ks, [0, 1, 2, 3])
    wait_for(c, {c.store(ks, [0, 1, 2, 3]).job_id})
    step_until(c, lambda: c.stats()["tiering"]["cascades_in_flight"] == 0)
    # Every block has a reader until released (a load in flight could finish, and
    # release its readers, before the store arrives: a pin cannot).
    assert len(c.pin(ks, "reader")) == 4
    refused = c.store(keys(9), [8])
    assert refused.refused and refused.job_id is None and refused.keys_accepted == []
    c.release(ks)
    accepted = c.store(keys(9), [8])
    assert accepted.keys_accepted == keys(9) and not accepted.refused
    wait_for(c, {accepted.job_id})


def test_tier_killed_mid_batch_fails_its_jobs_and_leaves_lookups(make_cluster):
    cluster = make_cluster(cpu={"num_blocks": 8})
    c = cluster.client()
    ks = keys(*range(8))
    cluster.fill(ks, list(range(8)))
    wait_for(c, {c.store(ks[:4], list(range(4))).job_id})
    step_until(c, lambda: c.stats()["tiers"]["memory"]["blocks"] == 4)
    tier = cluster.node.children["tier:memory:0"]
    tier.proc.send_signal(signal.SIGSTOP)  # hung: the next cascade stays in flight
    wait_for(c, {c.store(ks[4:], list(range(4, 8))).job_id})
    step_until(c, lambda: c.stats()["tiering"]["cascades_in_flight"] >= 1)
    tier.proc.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    step_until(c, lambda: c.stats()["tiering"]["cascades_in_flight"] == 0, timeout=10)
    detected = time.monotonic() - t0
    stats = c.stats()
    assert detected < 5 * cluster.config.broker.heartbeat_s + 2
    assert stats["tiers"]["memory"]["available"] is False
    assert stats["cpu"]["blocks_ready"] == 8
    # Cascade readers were released: every CPU block can be evicted again.
    more = keys(*range(50, 58))
    cluster.fill(more, list(range(8, 16)))
    store = c.store(more, list(range(8, 16)))
    assert store.keys_accepted == more
    wait_for(c, {store.job_id})
    # Evicted keys are a miss now: the tier is gone from lookups, nothing pending.
    assert c.lookup(ks[:2], "r").hits == 0
    assert c.lookup(ks[:2], "r").pending is False


def test_worker_killed_fails_transfers_cleanly(make_cluster):
    cluster = make_cluster()
    c = cluster.client()
    ks = keys(1, 2)
    cluster.fill(ks, [0, 1])
    wait_for(c, {c.store(ks, [0, 1]).job_id})
    worker = cluster.node.children["worker0"]
    worker.proc.send_signal(signal.SIGSTOP)
    load = c.load(ks, [2, 3])
    worker.proc.send_signal(signal.SIGKILL)
    result = wait_for(c, {load.job_id}, timeout=10)[load.job_id]
    assert not result.success and result.error_code in ("unavailable", "timeout")
    # The readers of the failed load were released; a new store is refused cleanly.
    with pytest.raises(RemoteError) as e:
        c.store(keys(5), [5])
    assert e.value.code == "unavailable"
    assert c.stats()["cpu"]["blocks_ready"] == 2


def test_broker_gone_means_broker_unavailable_within_timeout(make_cluster):
    cluster = make_cluster()
    c = Client(cluster.config.address("client"), timeout=0.5)
    assert c.lookup(keys(1)).hits == 0
    cluster.node.kill("broker", signal.SIGKILL)
    cluster.node.children["broker"].proc.wait(5)
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="within 0.5s"):
        c.lookup(keys(1))
    assert time.monotonic() - t0 < 2.0
    c.close()


def test_a_lookup_can_pin_its_hits_in_the_same_pass(make_cluster, instance):
    """The engine-copy path (tierkv.vllm): the hits come back pinned with their rows and
    the region they belong to; nothing can evict them until they are released."""
    cluster = make_cluster(cpu={"num_blocks": 4})
    c = cluster.client()
    ks = keys(1, 2, 3)
    reserved = c.reserve(ks, "w")
    region = SharedRegion.attach(instance)
    try:
        assert reserved.ok and reserved.region == region.generation
        for key, row in zip(ks, reserved.block_ids, strict=True):
            region.page(row, 0)[:] = key_bytes(key, 0, region.layout.page_size)
    finally:
        region.close()
    c.commit(ks)
    # Until the cascade to the memory tier is applied, its readers hold the blocks.
    step_until(c, lambda: c.stats()["tiers"]["memory"]["blocks"] == 3
               and c.stats()["tiering"]["cascades_in_flight"] == 0)
    found = c.lookup([*ks, *keys(9)], "r", status=True, pin=True)
    assert found.statuses == ["hit", "hit", "hit", "miss"]
    assert found.rows[:3] == reserved.block_ids and found.rows[3] == -1
    assert found.region == reserved.region
    # Pinned: another engine's store that needs two blocks of four cannot evict them.
    other = cluster.client()
    assert not other.reserve(keys(20, 21), "w2").ok
    c.release(ks)
    assert other.reserve(keys(20, 21), "w2").ok
    with pytest.raises(ValueError, match="all pin"):
        c.batch().lookup(ks, "a", pin=True).lookup(ks, "b")


def test_a_waiting_client_is_answered_when_its_job_finishes_not_at_the_next_tick(make_cluster):
    """Worker completions used to wait for the broker's next tick (`broker.tick_ms`,
    5 ms by default) even when a client was blocked in `wait` on them. With a tick
    of a minute, `wait` would only return after its own request expired."""
    cluster = make_cluster(broker={"tick_ms": 60_000.0})
    c = cluster.client()
    ks = keys(31, 32)
    cluster.fill(ks, [0, 1])
    store = c.store(ks, [0, 1])
    assert c.wait([store.job_id], timeout=5.0)[store.job_id].success
    assert c.lookup(ks, "r").hits == 2
    load = c.load(ks, [2, 3], "r")
    assert c.wait([load.job_id], timeout=5.0)[load.job_id].success
    assert cluster.holds(ks, [2, 3])


def test_a_leading_run_group_stops_promoting_at_its_first_miss_beside_a_per_key_group(
        make_cluster):
    """A hybrid model's step: its full-attention chain is a leading run (promotions
    stop at the first key no tier holds), its sliding-window chain key by key (every
    key a tier holds is promoted). One flag per message made both per key."""
    cluster = make_cluster(cpu={"num_blocks": 8})
    c = cluster.client()
    full, window = keys(1, 2, 3, prefix=b"a"), keys(1, 2, prefix=b"b")
    cluster.fill([*full, *window], list(range(5)))
    wait_for(c, {c.store([*full, *window], list(range(5))).job_id})
    step_until(c, lambda: c.stats()["tiers"]["memory"]["blocks"] == 5
               and c.stats()["tiering"]["cascades_in_flight"] == 0)
    fillers = keys(*range(10, 18), prefix=b"f")  # evict them all from the CPU tier
    cluster.fill(fillers, list(range(8)))
    wait_for(c, {c.store(fillers, list(range(8))).job_id})
    before = c.stats()["tiering"]["promotions_started"]
    gap = keys(99, prefix=b"x")  # held by no tier
    found_full, found_window = c.batch().lookup([full[0], *gap, *full[1:]], "full") \
        .lookup([window[0], *gap, window[1]], "window", status=True).send()
    assert found_full.statuses is None and found_full.pending
    assert found_window.statuses == ["pending", "miss", "pending"]
    # full[0] and both window keys; not full[1:], behind the full chain's first miss.
    assert c.stats()["tiering"]["promotions_started"] - before == 3
