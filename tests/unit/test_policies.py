"""Policy conformance (every registered policy) and LRU/ARC specifics."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.core.policies import ARCPolicy, LRUPolicy, known_policies, make_policy

ALL = known_policies()


@pytest.mark.parametrize("name", ALL)
class TestConformance:
    def test_get_insert_remove(self, name):
        p = make_policy(name, 4)
        p.insert(b"a", 0)
        assert p.get(b"a") == 0 and b"a" in p and len(p) == 1
        assert p.get(b"zz") is None
        p.remove(b"a")
        p.remove(b"a")  # unknown keys are ignored
        assert b"a" not in p and len(p) == 0

    def test_double_insert_raises(self, name):
        p = make_policy(name, 4)
        p.insert(b"a", 0)
        with pytest.raises(KeyError):
            p.insert(b"a", 1)

    def test_evict_is_all_or_nothing(self, name):
        p = make_policy(name, 4)
        for i, k in enumerate([b"a", b"b", b"c"]):
            p.insert(k, i)
        assert p.evict(2, protected={b"a", b"b"}) is None
        assert len(p) == 3 and all(k in p for k in (b"a", b"b", b"c"))
        victims = p.evict(1, protected={b"a", b"b"})
        assert victims == [(b"c", 2)]
        assert p.evict(0, protected=set()) == []

    def test_evict_none_when_only_protected_remain(self, name):
        p = make_policy(name, 2)
        p.insert(b"a", 0)
        p.insert(b"b", 1)
        before = p.stats()
        assert p.evict(1, protected={b"a", b"b"}) is None
        assert p.stats() == before

    def test_evicts_exactly_n_distinct(self, name):
        p = make_policy(name, 8)
        for i in range(8):
            p.insert(bytes([i]), i)
        victims = p.evict(5, protected=set())
        assert len(victims) == 5 and len({k for k, _ in victims}) == 5
        assert len(p) == 3
        assert all(k not in p for k, _ in victims)

    def test_touch_unknown_is_ignored(self, name):
        p = make_policy(name, 2)
        p.touch([b"nope"])
        assert len(p) == 0

    @settings(max_examples=60, deadline=None)
    @given(ops=st.lists(st.tuples(st.sampled_from("itre"), st.integers(0, 9)), max_size=80))
    def test_random_operations_keep_bookkeeping(self, name, ops):
        cap = 5
        p = make_policy(name, cap)
        present: dict[bytes, int] = {}
        for op, i in ops:
            key = bytes([i])
            if op == "i" and key not in present:
                if len(present) == cap:
                    victims = p.evict(1, protected=set())
                    assert victims is not None and len(victims) == 1
                    present.pop(victims[0][0])
                p.insert(key, i)
                present[key] = i
            elif op == "t":
                p.touch([key])
            elif op == "r":
                p.remove(key)
                present.pop(key, None)
            elif op == "e" and present:
                protected = set(list(present)[:1])
                victims = p.evict(1, protected=protected)
                if len(present) > 1:
                    assert victims is not None and victims[0][0] not in protected
                    present.pop(victims[0][0])
                else:
                    assert victims is None
            assert len(p) == len(present)
            for k, v in present.items():
                assert p.get(k) == v


def test_unknown_policy_lists_known():
    with pytest.raises(ValueError, match="known policies: .*arc.*lru"):
        make_policy("mru", 4)


def test_lru_order_and_touch():
    p = LRUPolicy(4)
    for i, k in enumerate([b"a", b"b", b"c", b"d"]):
        p.insert(k, i)
    p.touch([b"a"])
    assert [k for k, _ in p.evict(2, set())] == [b"b", b"c"]
    assert [k for k, _ in p.evict(2, set())] == [b"d", b"a"]


def test_arc_reuse_moves_t1_to_t2():
    p = ARCPolicy(4)
    p.insert(b"a", 0)
    assert b"a" in p.t1
    p.touch([b"a"])
    assert b"a" in p.t2 and b"a" not in p.t1


def test_arc_b1_ghost_hit_grows_target():
    p = ARCPolicy(2)
    p.insert(b"a", 0)
    p.insert(b"b", 1)
    assert p.evict(1, set()) == [(b"a", 0)]
    assert b"a" in p.b1 and p.p == 0
    p.insert(b"a", 0)  # ghost hit in B1: recency deserved more room
    assert p.p >= 1 and b"a" in p.t2


def test_arc_b2_ghost_hit_shrinks_target():
    p = ARCPolicy(2)
    p.insert(b"a", 0)
    p.touch([b"a"])  # a in T2
    p.insert(b"b", 1)
    p.p = 2.0
    assert p.evict(1, {b"b"}) == [(b"a", 0)]  # from T2 because T1 is protected
    assert b"a" in p.b2
    p.insert(b"a", 0)
    assert p.p < 2.0 and b"a" in p.t2


def test_arc_ghost_lists_stay_bounded():
    cap = 8
    p = ARCPolicy(cap)
    for i in range(1000):
        if len(p) == cap:
            p.evict(1, set())
        p.insert(i.to_bytes(4, "big"), i)
        if i % 3 == 0:
            p.touch([i.to_bytes(4, "big")])
        assert len(p.b1) + len(p.b2) <= cap
        assert len(p.t1) + len(p.b1) <= cap


def _survivors_after_scan(policy) -> set[bytes]:
    hot = [b"h1", b"h2"]
    for i, k in enumerate(hot):
        policy.insert(k, i)
    policy.touch(hot)  # the working set is used twice
    for i in range(100):  # a one-pass scan of keys never seen again
        if len(policy) == policy.capacity:
            policy.evict(1, set())
        policy.insert(f"scan{i}".encode(), 10 + i)
    return {k for k in hot if k in policy}


def test_arc_resists_a_scan_that_lru_does_not():
    assert _survivors_after_scan(ARCPolicy(4)) == {b"h1", b"h2"}
    assert _survivors_after_scan(LRUPolicy(4)) == set()
