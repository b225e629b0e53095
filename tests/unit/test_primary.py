"""PrimaryTier: the CPU-tier block manager's states and rules."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv.core.policies import known_policies
from tierkv.core.primary import BlockStateError, PrimaryTier
from tierkv.core.reuse import ReuseFilter


def k(*ns: int) -> list[bytes]:
    return [n.to_bytes(8, "big") for n in ns]


def stored(tier: PrimaryTier, keys: list[bytes]):
    out = tier.prepare_store(keys)
    assert out is not None
    tier.complete_store(out.keys_to_store)
    return out


@pytest.mark.parametrize("policy", known_policies())
def test_store_evict_load_protect_sequence(policy):
    tier = PrimaryTier(4, policy=policy)
    stored(tier, k(1, 2))
    assert tier.lookup(k(1, 2)) == 2
    tier.touch(k(2))
    out = tier.prepare_store(k(2, 3, 4, 5))
    assert out is not None
    assert out.keys_to_store == k(3, 4, 5)  # 2 is present: not rewritten
    assert out.evicted_keys == k(1)
    assert len(set(out.block_ids)) == 3
    tier.complete_store(out.keys_to_store)
    assert tier.lookup(k(1)) == 0
    assert tier.lookup(k(2, 3, 4, 5)) == 4
    # While 2 and 3 are being loaded, a store that needs their blocks is refused.
    ids = tier.prepare_load(k(2, 3))
    assert ids == [tier.block_id(x) for x in k(2, 3)]
    assert tier.prepare_store(k(6, 7, 8)) is None
    assert tier.lookup(k(2, 3, 4, 5)) == 4  # refusal changed nothing
    tier.complete_load(k(2, 3))
    out = tier.prepare_store(k(6, 7, 8))
    assert out is not None and out.keys_to_store == k(6, 7, 8)
    tier.check_invariants()


def test_block_ids_are_co_indexed_and_consecutive_when_fresh():
    tier = PrimaryTier(8)
    out = tier.prepare_store(k(10, 11, 12))
    assert out.block_ids == [0, 1, 2]
    assert [tier.block_id(x) for x in out.keys_to_store] == out.block_ids


def test_stores_take_the_lowest_free_ids_in_order():
    """Failed stores and evictions free ids out of order; a store then takes the
    lowest free ids, ascending (runs of rows for the copy engines), whether it
    takes some of them or all."""
    tier = PrimaryTier(8, policy="lru")
    out = tier.prepare_store(k(1, 2, 3, 4, 5, 6, 7, 8))
    assert out.block_ids == list(range(8))
    tier.complete_store(k(5, 1, 7, 3))
    tier.complete_store(k(8, 2, 6, 4), success=False)  # frees 7, 1, 5, 3
    assert tier.prepare_store(k(9, 10)).block_ids == [1, 3]  # some of the free ids
    assert tier.prepare_store(k(11, 12)).block_ids == [5, 7]  # all of them
    tier.complete_store(k(9, 10, 11, 12))
    tier.touch(k(1, 7))  # LRU: 5, 3, 9, 10, 11, 12, 1, 7
    out = tier.prepare_store(k(13, 14, 15))
    assert out.evicted_keys == k(5, 3, 9) and out.block_ids == [1, 2, 4]
    tier.check_invariants()


def test_writing_blocks_are_not_hits_and_not_evicted():
    tier = PrimaryTier(2)
    out = tier.prepare_store(k(1, 2))
    assert tier.lookup(k(1)) == 0
    assert tier.prepare_store(k(3)) is None
    tier.complete_store(out.keys_to_store)
    assert tier.lookup(k(1, 2)) == 2


def test_keys_of_the_call_are_never_evicted_by_it():
    tier = PrimaryTier(2)
    stored(tier, k(1, 2))
    assert tier.prepare_store(k(1, 2, 3, 4)) is None
    out = tier.prepare_store(k(2, 3))
    assert out.evicted_keys == k(1)


def test_failed_store_frees_only_writing_blocks():
    tier = PrimaryTier(4)
    stored(tier, k(1))
    out = tier.prepare_store(k(2, 3))
    tier.complete_store(k(1, 2, 3), success=False)
    assert tier.lookup(k(1)) == 1  # ready key untouched
    assert not tier.contains(k(2)[0]) and not tier.contains(k(3)[0])
    assert tier.free_blocks == 3
    assert out.block_ids  # the ids went back to the free list
    tier.check_invariants()


def test_complete_store_is_idempotent_for_ready_keys():
    tier = PrimaryTier(4)
    stored(tier, k(1))
    assert tier.complete_store(k(1)) == []
    assert tier.lookup(k(1)) == 1


def test_misuse_raises_and_leaves_state_consistent():
    tier = PrimaryTier(4)
    stored(tier, k(1))
    tier.prepare_store(k(2))
    with pytest.raises(BlockStateError, match="unknown key"):
        tier.complete_store(k(1, 9))
    with pytest.raises(BlockStateError, match="writing, not ready"):
        tier.prepare_load(k(1, 2))
    assert tier.readers(k(1)[0]) == 0  # nothing taken by the failed call
    with pytest.raises(BlockStateError, match="unknown, not ready"):
        tier.prepare_load(k(7))
    tier.prepare_load(k(1))
    with pytest.raises(BlockStateError, match="2 released but 1 held"):
        tier.complete_load(k(1, 1))
    assert tier.readers(k(1)[0]) == 1
    tier.complete_load(k(1))
    with pytest.raises(BlockStateError):
        tier.complete_load(k(1))
    tier.check_invariants()


@pytest.mark.parametrize("ready, asked, hits", [
    ((1, 2, 3), (1, 2, 3), 3),  # every key
    ((1, 2, 3), (1, 2), 2),
    ((1, 3), (1, 2, 3), 1),  # a ready key after the first miss is not a hit
    ((2, 3), (1, 2, 3), 0),
    ((1, 2), (1, 1, 2, 9), 3),  # a key asked twice counts twice
    ((1,), (), 0),
])
def test_lookup_counts_the_ready_keys_before_the_first_that_is_not(ready, asked, hits):
    tier = PrimaryTier(8)
    stored(tier, k(*ready))
    assert tier.lookup(k(*asked)) == hits
    # Keys that are not the stored objects (as the broker reads them off the wire).
    assert tier.lookup([bytes(bytearray(key)) for key in k(*asked)]) == hits


def test_completed_load_counts_as_a_use():
    tier = PrimaryTier(3, policy="lru")
    stored(tier, k(1, 2, 3))
    tier.prepare_load(k(1))
    tier.complete_load(k(1))
    out = tier.prepare_store(k(4))
    assert out.evicted_keys == k(2)  # 1 was used by its load, 2 is now the oldest


def test_lookup_alone_is_not_a_use():
    tier = PrimaryTier(3, policy="lru")
    stored(tier, k(1, 2, 3))
    assert tier.lookup(k(1)) == 1
    out = tier.prepare_store(k(4))
    assert out.evicted_keys == k(1)


def test_events_removal_before_store():
    tier = PrimaryTier(2)
    stored(tier, k(1, 2))
    assert [(e.kind, e.keys, e.tier) for e in tier.take_events()] == [
        ("stored", tuple(k(1, 2)), "cpu")
    ]
    stored(tier, k(3))
    events = tier.take_events()
    assert [(e.kind, e.keys) for e in events] == [("removed", tuple(k(1))), ("stored", tuple(k(3)))]
    assert tier.take_events() == []


def test_stats_add_up():
    tier = PrimaryTier(4)
    stored(tier, k(1, 2))
    tier.prepare_store(k(3))
    tier.lookup(k(1, 2, 3))
    s = tier.stats()
    assert s["blocks_ready"] == 2 and s["blocks_writing"] == 1 and s["blocks_free"] == 1
    assert s["usage"] == 0.75
    assert s["hits"] == 2 and s["misses"] == 1


def test_reuse_filter_admits_after_threshold_lookups():
    tier = PrimaryTier(4, reuse_filter=ReuseFilter(threshold=2))
    tier.lookup(k(1, 2))
    out = tier.prepare_store(k(1, 2))
    assert out.keys_to_store == []
    tier.lookup(k(1))
    out = tier.prepare_store(k(1, 2))
    assert out.keys_to_store == k(1)
    assert tier.stats()["reuse_skipped"] == 3
    # Promotions from a lower tier bypass the filter.
    assert tier.prepare_store(k(5), filtered=False).keys_to_store == k(5)


def test_reuse_filter_table_is_bounded():
    f = ReuseFilter(threshold=1, max_entries=10)
    f.record(k(*range(100)))
    assert len(f) == 10
    assert f.admits(k(99)[0]) and not f.admits(k(0)[0])


def test_clear_keeps_blocks_in_use():
    tier = PrimaryTier(4)
    stored(tier, k(1, 2))
    tier.prepare_load(k(1))
    tier.prepare_store(k(3))
    assert tier.clear() == k(2)
    assert tier.lookup(k(1)) == 1 and tier.contains(k(3)[0])
    tier.check_invariants()


class PrimaryMachine(RuleBasedStateMachine):
    """Random operation sequences against the invariants of DESIGN's block states."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = PrimaryTier(6, policy="arc")
        self.writing: set[bytes] = set()
        self.ready: set[bytes] = set()
        self.loading: list[bytes] = []

    keys = st.lists(st.integers(0, 15).map(lambda n: n.to_bytes(2, "big")), max_size=5)

    @rule(keys=keys)
    def store(self, keys):
        before = self.tier.stats()
        protected = {x for x in self.ready if self.tier.readers(x)} | self.writing
        out = self.tier.prepare_store(keys)
        if out is None:
            after = self.tier.stats()
            assert {k: v for k, v in after.items() if k != "stores_refused"} == {
                k: v for k, v in before.items() if k != "stores_refused"
            }
            return
        assert not set(out.evicted_keys) & protected
        assert not set(out.evicted_keys) & set(keys)
        self.ready -= set(out.evicted_keys)
        self.writing |= set(out.keys_to_store)

    @precondition(lambda self: self.writing)
    @rule(success=st.booleans(), data=st.data())
    def complete(self, success, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.writing)), min_size=1))
        self.tier.complete_store(keys, success=success)
        self.writing -= set(keys)
        if success:
            self.ready |= set(keys)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def load(self, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        self.tier.prepare_load(keys)
        self.loading.extend(keys)

    @precondition(lambda self: self.loading)
    @rule()
    def finish_load(self):
        key = self.loading.pop(0)
        self.tier.complete_load([key])

    @rule(keys=keys)
    def lookup(self, keys):
        hits = self.tier.lookup(keys)
        expected = 0
        for key in keys:
            if key not in self.ready:
                break
            expected += 1
        assert hits == expected

    @invariant()
    def consistent(self):
        self.tier.check_invariants()
        s = self.tier.stats()
        assert s["blocks_ready"] == len(self.ready)
        assert s["blocks_writing"] == len(self.writing)
        assert s["blocks_ready"] + s["blocks_writing"] + s["blocks_free"] == 6
        assert s["hits"] + s["misses"] >= s["hits"]


TestPrimaryMachine = PrimaryMachine.TestCase
TestPrimaryMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
