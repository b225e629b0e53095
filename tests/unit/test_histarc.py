"""histarc specifics (conformance runs in test_policies for every registered policy)."""

from __future__ import annotations

import pytest

from tierkv.core.policies import ARCPolicy, make_policy
from tierkv.core.policies.histarc import HistoryARCPolicy


def key(i: int) -> bytes:
    return i.to_bytes(4, "big")


def churn(policy, start: int, count: int) -> None:
    """Insert `count` fresh keys, evicting one whenever the policy is full."""
    for i in range(start, start + count):
        if len(policy) == policy.capacity:
            assert policy.evict(1, set()) is not None
        policy.insert(key(i), i)


def test_registered_by_name():
    assert isinstance(make_policy("histarc", 8), HistoryARCPolicy)


def test_reuse_long_after_eviction_is_admitted_to_t2():
    # A key returns after 3 * capacity evictions: ARC has forgotten it, histarc not.
    for policy, lands_in_t2 in ((HistoryARCPolicy(4), True), (ARCPolicy(4), False)):
        policy.insert(b"x", 0)
        churn(policy, 100, 4 + 12)
        assert b"x" not in policy
        policy.evict(1, set())
        policy.insert(b"x", 0)
        assert (b"x" in policy.t2) is lands_in_t2


def test_only_marginal_ghost_hits_move_the_target():
    p = HistoryARCPolicy(8, history=4.0, window=0.25)  # window: 2 evictions
    p.insert(b"a", 0)
    churn(p, 100, 8)  # "a" is evicted first, then nothing else yet
    assert b"a" in p.b1
    p.evict(1, set())
    p.insert(b"a", 0)  # returns at once: a slightly larger T1 would have kept it
    assert p.p == 1.0 and b"a" in p.t2

    q = HistoryARCPolicy(8, history=4.0, window=0.25)
    q.insert(b"a", 0)
    churn(q, 100, 8 + 10)  # ten more evictions from T1 after "a"
    q.evict(1, set())
    q.insert(b"a", 0)
    assert q.p == 0.0 and b"a" in q.t2  # admitted as a reuse, target unchanged


def test_t2_ghost_hit_shrinks_the_target():
    p = HistoryARCPolicy(2)
    p.insert(b"a", 0)
    p.touch([b"a"])  # a in T2
    p.insert(b"b", 1)
    p.p = 2.0
    assert p.evict(1, {b"b"}) == [(b"a", 0)]
    p.insert(b"a", 0)
    assert p.p == 1.0 and b"a" in p.t2


def test_ghost_lists_stay_bounded():
    cap = 8
    p = HistoryARCPolicy(cap, history=2.0)
    for i in range(2000):
        if len(p) == cap:
            p.evict(1, set())
        p.insert(key(i), i)
        if i % 3 == 0:
            p.touch([key(i)])
        assert len(p.b1) <= 2 * cap and len(p.b2) <= 2 * cap
    assert p.stats()["b1"] == len(p.b1)


def test_scan_does_not_flush_reused_keys():
    p = HistoryARCPolicy(4)
    hot = [b"h1", b"h2"]
    for i, k in enumerate(hot):
        p.insert(k, i)
    p.touch(hot)
    churn(p, 1000, 100)
    assert all(k in p for k in hot)


def test_rejects_bad_parameters():
    with pytest.raises(ValueError):
        HistoryARCPolicy(4, history=0)
    with pytest.raises(ValueError):
        HistoryARCPolicy(0)
