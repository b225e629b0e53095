"""The broker's view of a tier process: when a job it holds makes it a hung peer."""

from __future__ import annotations

from broker.remote_tier import RemoteTier
from tierkv.tiers.base import Job, JobKind, JobResult
from tierkv.wire.protocol import TierDoneBatch, TierHello, TierJobBatch


def test_a_tier_is_overdue_only_a_grace_past_its_jobs_deadline():
    """A live tier fails the keys it has not started by the deadline and reports them
    soon after; only one that holds a job the whole grace past it is to be fenced."""
    now = [100.0]
    sent: list[tuple[bytes, object]] = []
    tier = RemoteTier("s3", lambda ident, msg: sent.append((ident, msg)) or True,
                      lambda: now[0], job_timeout_s=30.0, fence_grace_s=3.0)
    tier.on_hello(b"t1", TierHello("s3", "s3", pid=1))
    tier.on_inventory(b"t1", [], last=True)
    tier.on_credit(b"t1", 8)
    tier.submit_load(Job(1, (b"k",), (0,), JobKind.PROMOTION))
    tier.dispatch()
    (ident, batch), = sent
    assert ident == b"t1" and isinstance(batch, TierJobBatch)
    assert batch.deadlines == [130.0]  # the tier learns the deadline with the job
    now[0] = 131.0
    assert tier.overdue(now[0]) == set()  # past the deadline, within the grace
    now[0] = 133.5
    assert tier.overdue(now[0]) == {b"t1"}
    tier.on_done(b"t1", TierDoneBatch([JobResult(1, False)], credit=1))
    assert tier.overdue(now[0]) == set()  # reported: nothing held any more


def test_a_tier_whose_breaker_is_open_answers_lookups_as_misses_at_once():
    """A tier whose endpoint is down must not keep starting promotions that can
    only fail; with its circuit breaker open, its keys are misses until it closes."""
    now = [0.0]
    tier = RemoteTier("s3", lambda ident, msg: True, lambda: now[0])
    for ident in (b"t1", b"t2"):
        tier.on_hello(ident, TierHello("s3", "s3", pid=1))
        tier.on_inventory(ident, [b"k"], last=True)
    assert tier.lookup(b"k") is True
    tier.on_stats(b"t1", {"breaker": "open", "breaker_retry_in_s": 5.0})
    assert tier.lookup(b"k") is True  # one process still reaches the endpoint
    tier.on_stats(b"t2", {"breaker": "open", "breaker_retry_in_s": 3.0})
    assert tier.lookup(b"k") is False and tier.stats()["failing"]
    now[0] = 3.5  # one breaker's cool-down is over: a lookup is its trial request
    assert tier.lookup(b"k") is True
    tier.on_stats(b"t2", {"breaker": "open", "breaker_retry_in_s": 2.0})  # the trial failed
    assert tier.lookup(b"k") is False
    tier.on_stats(b"t1", {"breaker": "closed"})
    assert tier.lookup(b"k") is True


def test_a_tier_counts_the_keys_it_reports_that_the_node_did_not_store_there():
    """A key a client was told is a miss becomes a hit when a client stores it or a
    tier comes to hold it otherwise (a tier process back with its inventory, another
    node's store in a shared tier's listing): the tier counts the second kind, each
    key once, and not its own stores, which the node counts itself."""
    now = [0.0]
    sent: list[tuple[bytes, object]] = []
    tier = RemoteTier("disk", lambda ident, msg: sent.append((ident, msg)) or True,
                      lambda: now[0])
    tier.on_hello(b"t1", TierHello("disk", "disk", pid=1))
    tier.on_inventory(b"t1", [b"a", b"b"], last=True)
    assert tier.arrivals == 2
    tier.on_credit(b"t1", 8)
    tier.submit_store(Job(1, (b"c",), (0,), JobKind.STORE))
    tier.dispatch()
    tier.on_done(b"t1", TierDoneBatch([JobResult(1, True, successful_keys=(b"c",))], credit=1))
    assert tier.lookup(b"c") is True and tier.arrivals == 2  # the node's own store
    tier.on_inventory(b"t1", [b"a", b"d"], last=True)  # more of a listing: one new key
    assert tier.arrivals == 3


def test_a_shared_tier_without_a_listing_cannot_count_what_arrives():
    """Another node's store into a shared tier that does not list it is found only by
    asking, so such a tier has no count: a miss of its keys may be a hit unseen."""
    tier = RemoteTier("s3", lambda ident, msg: True, lambda: 0.0)
    tier.on_hello(b"t1", TierHello("s3", "s3", pid=1, shared=True))
    assert tier.arrivals is None
    listed = RemoteTier("s3", lambda ident, msg: True, lambda: 0.0)
    listed.on_hello(b"t1", TierHello("s3", "s3", pid=1, shared=True, refresh_s=30.0))
    listed.on_inventory(b"t1", [b"a"], last=True)
    assert listed.arrivals == 1
