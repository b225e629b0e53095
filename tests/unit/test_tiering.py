"""TieringManager in-process, over real shared memory and MemoryTier."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.primary import BlockStateError, PrimaryTier
from tierkv.core.shm import SharedRegion
from tierkv.core.tiering import Lookup, TieringManager
from tierkv.tiers.base import Job, JobResult
from tierkv.tiers.local import LocalTier
from tierkv.tiers.memory import MemoryBackend, MemoryTier

PAGE = 256


def k(*ns: int) -> list[bytes]:
    return [n.to_bytes(8, "big") for n in ns]


def pattern(key: bytes, size: int) -> bytes:
    out = bytearray()
    seed = key
    while len(out) < size:
        seed = hashlib.blake2b(seed, digest_size=64).digest()
        out += seed
    return bytes(out[:size])


@pytest.fixture
def region(instance):
    with SharedRegion.create(instance, num_blocks=6, page_size=PAGE) as r:
        yield r


class RecordingTier(MemoryTier):
    """A MemoryTier that remembers the jobs it was given (observation only)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loads: list[Job] = []
        self.stores: list[Job] = []
        self.shutdown_at: list[bool] = []

    def submit_load(self, job: Job) -> None:
        self.loads.append(job)
        super().submit_load(job)

    def submit_store(self, job: Job) -> None:
        self.stores.append(job)
        super().submit_store(job)


def manager(region, *tiers, capacity=None, **kw) -> TieringManager:
    return TieringManager(PrimaryTier(capacity or region.layout.num_blocks), tiers, **kw)


def gpu_store(
    mgr: TieringManager, region: SharedRegion, keys: list[bytes], may_refuse: bool = False
) -> list[bytes]:
    out = mgr.prepare_store(keys)
    if out is None and may_refuse:
        return []
    assert out is not None
    for key, block_id in zip(out.keys_to_store, out.block_ids, strict=True):
        region.block(block_id)[:] = pattern(key, region.block_bytes)
    mgr.complete_store(out.keys_to_store)
    return out.keys_to_store


def gpu_load(mgr: TieringManager, region: SharedRegion, keys: list[bytes], req=None) -> list[bytes]:
    ids = mgr.prepare_load(keys, req_id=req)
    data = [bytes(region.block(b)) for b in ids]
    mgr.complete_load(keys)
    return data


def settle(mgr: TieringManager, steps: int = 2) -> None:
    for _ in range(steps):
        mgr.step()


def test_store_and_lookup_without_secondary_tiers(region):
    mgr = manager(region)
    gpu_store(mgr, region, k(1, 2, 3))
    assert mgr.lookup(k(1, 2, 3, 4, 5)) == Lookup(3, False)
    assert gpu_load(mgr, region, k(2)) == [pattern(k(2)[0], region.block_bytes)]
    mgr.step()
    assert mgr.lookup(k(9)) == Lookup(0, False)


def test_cascade_reaches_every_tier(region):
    a, b = MemoryTier(region, name="a"), MemoryTier(region, name="b")
    mgr = manager(region, a, b)
    gpu_store(mgr, region, k(1, 2))
    settle(mgr)
    for tier in (a, b):
        assert tier.holds(k(1)[0]) and tier.holds(k(2)[0])
        assert tier.backend._blocks[k(1)[0]] == pattern(k(1)[0], region.block_bytes)
    events = mgr.take_events()
    assert [(e.kind, e.tier) for e in events] == [
        ("stored", "cpu"), ("stored", "a"), ("stored", "b")
    ]


def test_cascade_reader_held_until_each_completion_is_applied(region):
    a, b = MemoryTier(region, name="a"), MemoryTier(region, name="b")
    mgr = manager(region, a, b)
    gpu_store(mgr, region, k(1))
    key = k(1)[0]
    assert mgr.primary.readers(key) == 2  # one per pending cascade
    mgr.step()  # step 1: flushed to the tiers, which complete at once
    assert mgr.primary.readers(key) == 2  # ...but completions are applied next step
    mgr.step()
    assert mgr.primary.readers(key) == 0


def test_cascade_reader_released_on_failure_too(region):
    a = MemoryTier(region, capacity_blocks=1, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 2))  # one job of 2 keys into a 1-block tier: one fails
    settle(mgr)
    assert mgr.primary.readers(k(1)[0]) == 0 and mgr.primary.readers(k(2)[0]) == 0
    assert mgr.stats()["tiering"]["cascade_keys_failed"] == 1


def test_failed_store_cascades_nothing(region):
    a = RecordingTier(region, name="a")
    mgr = manager(region, a)
    out = mgr.prepare_store(k(1))
    mgr.complete_store(out.keys_to_store, success=False)
    settle(mgr)
    assert a.stores == [] and not a.holds(k(1)[0])


def evict_all(mgr, region, start=100) -> None:
    """Fill the CPU tier with other keys so earlier ones are evicted."""
    gpu_store(mgr, region, k(*range(start, start + region.layout.num_blocks)))
    settle(mgr)


def test_promotion_pending_then_hit_with_bytes_equal(region):
    a = MemoryTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 2))
    settle(mgr)
    evict_all(mgr, region)
    assert mgr.primary.lookup(k(1)) == 0
    assert mgr.lookup(k(1, 2), req_id="r") == Lookup(0, True)  # step N: promotion starts
    assert mgr.lookup(k(1, 2), req_id="r") == Lookup(0, True)  # same step: in flight
    mgr.step()
    assert mgr.lookup(k(1, 2), req_id="r") == Lookup(2, False)  # step N+1: hit
    assert gpu_load(mgr, region, k(1, 2), req="r") == [
        pattern(x, region.block_bytes) for x in k(1, 2)
    ]


def test_promotion_held_in_flight_stays_pending(region):
    a = MemoryTier(region, capacity_blocks=64, name="a", auto_complete=False)
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1))
    mgr.step()
    a.complete_pending()
    mgr.step()
    evict_all(mgr, region)
    a.complete_pending()
    settle(mgr)
    assert mgr.lookup(k(1), "r") == Lookup(0, True)
    mgr.step()  # the load is sent; the tier holds it
    assert mgr.lookup(k(1), "r") == Lookup(0, True)
    a.complete_pending()  # it finishes mid-step: applied only on the next step's poll
    assert mgr.lookup(k(1), "r") == Lookup(0, True)
    mgr.step()
    assert mgr.lookup(k(1), "r") == Lookup(1, False)


def test_partial_lookup(region):
    mgr = manager(region)
    gpu_store(mgr, region, k(1, 2, 3))
    assert mgr.lookup(k(1, 2, 3, 4, 5)).hits == 3


def test_scan_stops_at_first_key_no_tier_holds(region):
    a = RecordingTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 3))
    settle(mgr)
    evict_all(mgr, region)
    # 1 is in the tier, 2 nowhere, 3 in the tier: only 1 is promoted.
    assert mgr.lookup(k(1, 2, 3), "r") == Lookup(0, True)
    mgr.step()
    assert [j.keys for j in a.loads] == [tuple(k(1))]


def test_eviction_in_cpu_tier(region):
    mgr = manager(region)
    gpu_store(mgr, region, k(*range(6)))
    gpu_store(mgr, region, k(10))
    assert mgr.lookup(k(0)).hits == 0
    assert mgr.stats()["cpu"]["evictions"] == 1


def test_touch_reaches_every_tier(region):
    a = MemoryTier(region, capacity_blocks=2, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 2))
    settle(mgr)
    mgr.touch(k(1))  # now 2 is the tier's oldest
    gpu_store(mgr, region, k(3))
    settle(mgr)
    assert a.holds(k(1)[0]) and not a.holds(k(2)[0]) and a.holds(k(3)[0])


def test_two_requests_different_keys_two_loads_at_step_end(region):
    a = RecordingTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 2, 3, 4))
    settle(mgr)
    evict_all(mgr, region)
    assert mgr.lookup(k(1, 2), "A").pending and mgr.lookup(k(3, 4), "B").pending
    assert a.loads == []  # nothing sent before the step ends
    mgr.step()
    assert sorted((j.req_id, j.keys) for j in a.loads) == [
        ("A", tuple(k(1, 2))), ("B", tuple(k(3, 4)))
    ]


def test_two_requests_same_key_one_promotion(region):
    a = RecordingTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1))
    settle(mgr)
    evict_all(mgr, region)
    assert mgr.lookup(k(1), "A") == Lookup(0, True)
    assert mgr.lookup(k(1), "B") == Lookup(0, True)
    mgr.step()
    assert len(a.loads) == 1 and a.loads[0].keys == tuple(k(1))
    assert mgr.lookup(k(1), "B") == Lookup(1, False)


def test_failed_promotion_becomes_a_miss_without_retry(region):
    a = RecordingTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1))
    settle(mgr)
    evict_all(mgr, region)
    a.backend.delete(k(1)[0])  # the tier lost it behind the index's back
    assert mgr.lookup(k(1), "r") == Lookup(0, True)
    settle(mgr)
    assert mgr.lookup(k(1), "r") == Lookup(0, False)
    settle(mgr)
    assert mgr.lookup(k(1), "r") == Lookup(0, False)
    assert len(a.loads) == 1
    assert mgr.primary.free_blocks == 0 or not mgr.primary.contains(k(1)[0])
    assert mgr.stats()["tiering"]["promotions_failed"] == 1
    mgr.primary.check_invariants()


def test_partial_promotion_keeps_the_keys_that_loaded(region):
    a = MemoryTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 2, 3))
    settle(mgr)
    evict_all(mgr, region)
    a.backend.delete(k(3)[0])
    assert mgr.lookup(k(1, 2, 3), "r").pending
    settle(mgr)
    assert mgr.lookup(k(1, 2, 3), "r") == Lookup(2, False)
    assert not mgr.primary.contains(k(3)[0])


def test_cpu_full_of_busy_blocks_answers_pending_not_a_miss(region):
    """A block on disk was once a flat miss while every CPU block was busy, and
    the engine recomputed what it could have loaded a step later."""
    a = MemoryTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1))
    settle(mgr)
    evict_all(mgr, region)
    busy = k(*range(100, 106))
    mgr.prepare_load(busy)  # every CPU block has a reader
    assert mgr.lookup(k(1), "r") == Lookup(0, True, retry=True)  # no room yet: ask again
    assert mgr.stats()["tiering"]["promotions_refused"] == 1
    mgr.complete_load(busy)  # the loads finished: blocks can be evicted again
    assert mgr.lookup(k(1), "r") == Lookup(0, True)  # now promoted
    settle(mgr)
    assert mgr.lookup(k(1), "r") == Lookup(1, False)
    mgr.check_invariants()


def test_cpu_full_of_cascading_blocks_answers_pending(region):
    """Every CPU block pinned by cascades still in flight: pending, not a miss."""
    slow = MemoryTier(region, capacity_blocks=64, name="slow", auto_complete=False)
    mgr = manager(region, slow)
    gpu_store(mgr, region, k(1))
    settle(mgr)
    slow.complete_pending()
    settle(mgr)
    evict_all(mgr, region)  # k(1) only in the tier now; the fill is still cascading
    assert all(mgr.primary.readers(x) for x in k(*range(100, 106)))
    assert mgr.lookup(k(1), "r") == Lookup(0, True, retry=True)
    slow.complete_pending()
    settle(mgr)
    assert mgr.lookup(k(1), "r").pending  # room now: promoted
    mgr.step()  # the promotion goes out
    slow.complete_pending()
    settle(mgr)
    assert mgr.lookup(k(1), "r") == Lookup(1, False)


def test_lease_protects_landed_blocks_until_loaded(instance):
    with SharedRegion.create(instance, num_blocks=2, page_size=PAGE) as region:
        a = MemoryTier(region, capacity_blocks=64, name="a")
        mgr = manager(region, a, lease_s=100)
        gpu_store(mgr, region, k(1, 2))
        settle(mgr)
        gpu_store(mgr, region, k(3, 4))
        settle(mgr)
        evict_all(mgr, region)
        assert mgr.lookup(k(1, 2), "A").pending
        settle(mgr)  # A's blocks landed and are leased
        # B cannot evict A's unread blocks: no room now, ask again.
        assert mgr.lookup(k(3, 4), "B") == Lookup(0, True, retry=True)
        assert mgr.lookup(k(1, 2), "A") == Lookup(2, False)
        gpu_load(mgr, region, k(1, 2), req="A")
        assert mgr.lookup(k(3, 4), "B") == Lookup(0, True)  # now there is room


def test_finish_and_expiry_end_leases(instance):
    with SharedRegion.create(instance, num_blocks=2, page_size=PAGE) as region:
        a = MemoryTier(region, capacity_blocks=64, name="a")
        now = [0.0]
        mgr = manager(region, a, lease_s=3.0, clock=lambda: now[0])
        gpu_store(mgr, region, k(1, 2))
        settle(mgr)
        evict_all(mgr, region)
        mgr.lookup(k(1), "A")
        mgr.lookup(k(2), "B")
        settle(mgr)
        assert mgr.primary.readers(k(1)[0]) == 1 and mgr.primary.readers(k(2)[0]) == 1
        mgr.finish("A")
        assert mgr.primary.readers(k(1)[0]) == 0
        now[0] = 2.0
        assert mgr.lookup(k(2), "B").hits == 1  # asking again renews B's lease
        now[0] = 4.5
        settle(mgr)
        assert mgr.primary.readers(k(2)[0]) == 1
        now[0] = 5.5
        settle(mgr)
        assert mgr.primary.readers(k(2)[0]) == 0
        assert mgr.stats()["tiering"]["leases_expired"] == 1


def test_unknown_job_result_is_counted_not_fatal(region):
    a = MemoryTier(region, name="a")
    mgr = manager(region, a)
    a._runner._done.append(JobResult(job_id=999, success=True))
    a._jobs[999] = Job(999, (), (), a_kind())
    mgr.step()
    assert mgr.stats()["tiering"]["unknown_job_results"] == 1


def a_kind():
    from tierkv.tiers.base import JobKind

    return JobKind.STORE


class SharedMemoryBackend(MemoryBackend):
    """A memory backend that another node may have filled (like S3)."""

    shared = True


def test_shared_tier_unknown_key_is_checked_then_promoted(region):
    backend = SharedMemoryBackend(64, region.block_bytes)
    backend._blocks[k(7)[0]] = pattern(k(7)[0], region.block_bytes)  # written by "node B"
    tier = LocalTier(backend, region, name="s3ish")
    tier.index.present.clear()  # this node has never seen it
    mgr = manager(region, tier)
    assert mgr.lookup(k(7), "r") == Lookup(0, True, retry=True)  # existence check under way
    mgr.step()
    assert mgr.lookup(k(7), "r") == Lookup(0, True)  # known now: promotion starts
    mgr.step()
    assert mgr.lookup(k(7), "r") == Lookup(1, False)
    assert gpu_load(mgr, region, k(7), req="r") == [pattern(k(7)[0], region.block_bytes)]
    assert mgr.lookup(k(8), "r") == Lookup(0, True, retry=True)
    mgr.step()
    assert mgr.lookup(k(8), "r") == Lookup(0, False)  # negative answer cached


def test_complete_store_of_a_promoting_key_is_refused(region):
    a = MemoryTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1))
    settle(mgr)
    evict_all(mgr, region)
    mgr.lookup(k(1), "r")
    with pytest.raises(BlockStateError, match="being promoted"):
        mgr.complete_store(k(1))


def test_reset_clears_cpu_and_keeps_secondary_data(region):
    a = MemoryTier(region, capacity_blocks=64, name="a", auto_complete=False)
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 2))
    mgr.step()  # cascade sent, held in flight
    mgr.reset()
    assert mgr.primary.free_blocks == region.layout.num_blocks
    assert a.holds(k(1)[0]) and a.holds(k(2)[0])
    assert mgr.lookup(k(1, 2)) == Lookup(0, True)  # promoted back from the tier
    mgr.primary.check_invariants()


def test_shutdown_stops_tiers_before_closing_region(instance):
    region = SharedRegion.create(instance, 2, PAGE)
    order: list[str] = []

    class Watching(MemoryTier):
        def shutdown(self) -> None:
            order.append("tier" if not region.closed else "tier-after-region")
            super().shutdown()

    mgr = TieringManager(PrimaryTier(2), [Watching(region, name="a")], region=region)
    mgr.shutdown()
    assert order == ["tier"] and region.closed


def test_no_secondary_tiers_behaves_like_primary(region):
    mgr = manager(region)
    plain = PrimaryTier(region.layout.num_blocks)
    for keys in (k(1, 2), k(2, 3, 4), k(5, 6, 7, 8)):
        assert mgr.lookup(keys) == Lookup(plain.lookup(keys), False)
        out1, out2 = mgr.prepare_store(keys), plain.prepare_store(keys)
        assert out1 == out2
        mgr.complete_store(out1.keys_to_store)
        plain.complete_store(out2.keys_to_store)
        mgr.step()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(
    st.tuples(st.sampled_from(["store", "lookup", "step", "finish", "touch"]),
              st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
              st.sampled_from(["A", "B", "C"])),
    max_size=60))
def test_random_steps_every_hit_has_the_stored_bytes(region, ops):
    a = MemoryTier(region, capacity_blocks=5, name="a")
    b = MemoryTier(region, capacity_blocks=9, name="b")
    mgr = manager(region, a, b, lease_s=4.0)
    stored: set[bytes] = set()
    for op, ns, req in ops:
        keys = k(*ns)
        if op == "store":
            stored |= set(gpu_store(mgr, region, keys, may_refuse=True))
        elif op == "lookup":
            result = mgr.lookup(keys, req)
            if result.hits:
                hit = keys[: result.hits]
                assert set(hit) <= stored
                data = gpu_load(mgr, region, hit, req=req)
                assert data == [pattern(x, region.block_bytes) for x in hit]
        elif op == "step":
            mgr.step()
        elif op == "finish":
            mgr.finish(req)
        else:
            mgr.touch(keys)
        mgr.primary.check_invariants()
    mgr.reset()
    mgr.primary.check_invariants()


def test_error_code_enum_is_stable():
    assert ErrorCode("not_found") is ErrorCode.NOT_FOUND


def test_a_slow_tier_is_skipped_past_its_backlog_not_pinning_the_cpu_tier(instance):
    with SharedRegion.create(instance, num_blocks=8, page_size=PAGE) as region:
        slow = MemoryTier(region, capacity_blocks=64, name="slow", auto_complete=False)
        mgr = manager(region, slow, max_cascade_backlog=3)
        gpu_store(mgr, region, k(1, 2))
        mgr.step()  # sent, never completed: 2 keys in the backlog
        gpu_store(mgr, region, k(3, 4, 5))
        assert mgr.stats()["tiering"]["cascades_skipped"] == 2
        assert mgr.primary.readers(k(3)[0]) == 1 and mgr.primary.readers(k(4)[0]) == 0
        mgr.step()
        # Blocks that skipped the tier are evictable: the CPU tier keeps taking stores.
        assert gpu_store(mgr, region, k(6, 7, 8, 9, 10)) == k(6, 7, 8, 9, 10)
        slow.complete_pending()
        settle(mgr)
        assert slow.holds(k(1)[0]) and slow.holds(k(3)[0]) and not slow.holds(k(4)[0])


def test_a_load_says_which_tier_each_promoted_block_came_from_once(region):
    a = MemoryTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 2, 3))
    settle(mgr)
    evict_all(mgr, region)
    gpu_store(mgr, region, k(1))  # back in the CPU tier from the engine, not promoted
    settle(mgr)
    assert mgr.lookup(k(1, 2, 3), req_id="r").pending
    mgr.step()
    assert mgr.lookup(k(1, 2, 3), req_id="r") == Lookup(3, False)
    ids, sources = mgr.prepare_load_from(k(1, 2, 3), req_id="r")
    assert sources == {"a": 2}  # 2 and 3 came from tier a; 1 was a CPU hit
    mgr.complete_load(k(1, 2, 3))
    _, again = mgr.prepare_load_from(k(1, 2, 3), req_id="r2")
    assert again == {}  # loaded once already: from now on they are CPU hits
    mgr.complete_load(k(1, 2, 3))
    mgr.check_invariants()


class FailingBackend(MemoryBackend):
    """A memory tier whose loads fail as an unreachable endpoint's do (not lost)."""

    failing = False

    def load(self, key, dst):
        if self.failing:
            raise TierError(ErrorCode.UNAVAILABLE, "endpoint unreachable")
        super().load(key, dst)


def test_a_failed_promotion_backs_off_per_tier_instead_of_retrying_every_step(region, caplog):
    """A promotion that failed for any cause but a lost key must not be retried at
    every lookup while the fault lasted (an S3 outage of a few seconds: ~1,000 jobs
    and 800 warning lines)."""
    now = [0.0]
    backend = FailingBackend(64, block_bytes=region.block_bytes)
    tier = RecordingLocal(backend, region, name="s3")
    mgr = manager(region, tier, clock=lambda: now[0], promotion_backoff_s=1.0,
                  promotion_backoff_max_s=4.0)
    gpu_store(mgr, region, k(1, 2))
    settle(mgr)
    evict_all(mgr, region)
    backend.failing = True
    assert mgr.lookup(k(1, 2), "r") == Lookup(0, True)
    settle(mgr)
    for _ in range(50):  # the engine asks every step while the outage lasts
        assert mgr.lookup(k(1, 2), "r") == Lookup(0, False)
        mgr.step()
    assert len(tier.loads) == 1
    now[0] = 1.5  # the back-off is over: one more try, which fails: twice as long now
    assert mgr.lookup(k(1, 2), "r").pending
    settle(mgr)
    now[0] = 3.0
    assert mgr.lookup(k(1, 2), "r") == Lookup(0, False)
    now[0] = 3.6
    backend.failing = False  # the endpoint is back
    assert mgr.lookup(k(1, 2), "r").pending
    settle(mgr)
    assert mgr.lookup(k(1, 2), "r") == Lookup(2, False)
    assert len(tier.loads) == 3
    assert mgr.stats()["tiering"]["promotions_failed"] == 4
    # The warning was written once per spell, not once per failed job.
    lines = [r for r in caplog.records if "promotion of" in r.getMessage()]
    assert 1 <= len(lines) <= 2
    mgr.check_invariants()


def test_a_success_resets_the_back_off(region):
    now = [0.0]
    backend = FailingBackend(64, block_bytes=region.block_bytes)
    tier = RecordingLocal(backend, region, name="s3")
    mgr = manager(region, tier, clock=lambda: now[0], promotion_backoff_s=1.0,
                  promotion_backoff_max_s=60.0)
    gpu_store(mgr, region, k(1, 2, 3))
    settle(mgr)
    evict_all(mgr, region)
    backend.failing = True
    for t in (0.0, 1.1, 3.2, 7.3):  # back-offs of 1, 2, 4, then 8 s
        now[0] = t
        assert mgr.lookup(k(1), "r").pending
        settle(mgr)
    assert mgr.lookup(k(1), "r") == Lookup(0, False)
    now[0] = 15.4
    backend.failing = False
    assert mgr.lookup(k(1), "r").pending
    settle(mgr)
    assert mgr.lookup(k(1), "r").hits == 1
    backend.failing = True
    assert mgr.lookup(k(1, 2), "r2").pending  # k(2) fails now: the back-off starts over
    settle(mgr)
    now[0] = 16.5  # 1.1 s later: a fresh back-off of 1 s is over
    assert mgr.lookup(k(1, 2), "r2").pending


class RecordingLocal(LocalTier):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loads: list[Job] = []

    def submit_load(self, job: Job) -> None:
        self.loads.append(job)
        super().submit_load(job)


def test_a_lookup_leases_its_hits_to_the_request_until_it_loads_them(region):
    """Another engine sharing the broker must not evict a block between an
    engine's lookup and its load; the lookup now leases the hits it reports."""
    mgr = manager(region, lease_s=60.0)
    gpu_store(mgr, region, k(1, 2, 3))
    assert mgr.lookup(k(1, 2, 3), "A").hits == 3
    assert mgr.lookup(k(1, 2, 3), "A").hits == 3  # asked again: no second reader
    assert [mgr.primary.readers(x) for x in k(1, 2, 3)] == [1, 1, 1]
    # Another request fills the tier: A's hits are not the victims.
    assert gpu_store(mgr, region, k(10, 11, 12, 13), may_refuse=True) == []
    assert gpu_store(mgr, region, k(10, 11, 12)) == k(10, 11, 12)
    assert mgr.lookup(k(1, 2, 3), "A").hits == 3
    assert gpu_load(mgr, region, k(1, 2, 3), req="A") == [pattern(x, region.block_bytes)
                                                         for x in k(1, 2, 3)]
    assert [mgr.primary.readers(x) for x in k(1, 2, 3)] == [0, 0, 0]  # loaded: lease over
    mgr.check_invariants()


def test_lookup_keys_answers_a_status_per_key(region):
    from tierkv.core.tiering import HIT, MISS, PENDING

    a = MemoryTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 2))
    settle(mgr)
    evict_all(mgr, region)
    gpu_store(mgr, region, k(3))
    settle(mgr)
    found, status = mgr.lookup_keys(k(1, 9, 3), "r")  # 1 in tier a, 9 nowhere, 3 in CPU
    assert status == [PENDING, MISS, HIT]
    assert found.hits == 0 and found.pending
    settle(mgr)
    found, status = mgr.lookup_keys(k(1, 9, 3), "r")
    assert status == [HIT, MISS, HIT] and found.hits == 1
    assert mgr.source_of(k(1)[0]) == "a" and mgr.source_of(k(3)[0]) is None


def test_a_lookups_promotion_never_evicts_the_hits_it_reports(region):
    """Found by the random test: a lookup reported a hit on a key that its own
    promotion of the next key then evicted (a lookup without a request id holds
    no lease), so the load that followed found the key gone."""
    a = MemoryTier(region, capacity_blocks=64, name="a")
    mgr = manager(region, a)
    gpu_store(mgr, region, k(1, 2))
    settle(mgr)
    evict_all(mgr, region)  # 1 and 2 only in tier a; the CPU tier is full of others
    gpu_store(mgr, region, k(1))  # 1 is back in the CPU tier...
    settle(mgr)
    mgr.touch(k(*range(101, 106)))  # ...and the least recently used block there
    found = mgr.lookup(k(1, 2))  # 1 a hit; 2 is promoted into the room it needs
    assert found.hits == 1 and found.pending
    assert mgr.primary.is_ready(k(1)[0])
    assert gpu_load(mgr, region, k(1)) == [pattern(k(1)[0], region.block_bytes)]
