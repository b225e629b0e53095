"""The engine's spare rows (`tierkv.vllm.spares`): how many it asks for, which it
hands out, renews and lets go of. The clock is the test's."""

from __future__ import annotations

from tierkv.vllm import spares as spares_module
from tierkv.vllm.spares import RENEW_S, STALE_S, SpareRows


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def pool(most: int = 64) -> tuple[SpareRows, Clock]:
    rows = SpareRows(most)
    clock = Clock()
    rows.now = clock  # type: ignore[method-assign]
    return rows, clock


def fill(rows: SpareRows, clock: Clock, region: str = "r1") -> list[bytes]:
    keys, new = rows.to_reserve(clock())
    rows.reserved(keys, new, list(range(100, 100 + len(keys))), region, clock())
    return keys


def test_it_asks_for_twice_what_a_step_took_and_hands_them_out_oldest_first():
    rows, clock = pool()
    assert rows.to_reserve(clock()) == ([], 0)  # no demand yet: no rows held for nothing
    assert rows.take(5) == []  # the demand is counted although none could be given
    rows.step_ended()
    keys = fill(rows, clock)
    assert len(keys) == 10 and len(rows) == 10 and rows.region == "r1"
    taken = rows.take(4)
    assert taken is not None and [s.key for s in taken] == keys[:4]
    assert [s.row for s in taken] == [100, 101, 102, 103]
    rest = rows.take(7)  # short: what there are (the job reserves the rest)
    assert [s.key for s in rest] == keys[4:] and len(rows) == 0
    rows.give_back(rest)  # the job was not made: first in line again
    assert [s.key for s in rows.take(2)] == keys[4:6]


def test_demand_is_capped_and_a_refusal_backs_off():
    rows, clock = pool(most=8)
    rows.take(100)
    rows.step_ended()
    keys, new = rows.to_reserve(clock())
    assert len(keys) == new == 8
    rows.reserved(keys, new, None, "", clock())  # no room at the broker
    assert rows.to_reserve(clock()) == ([], 0)
    clock.t += 1.5
    assert len(rows.to_reserve(clock())[0]) == 8


def test_old_spares_are_renewed_and_stale_ones_let_go_not_used():
    rows, clock = pool()
    rows.take(2)
    rows.step_ended()
    first = fill(rows, clock)
    clock.t += RENEW_S + 1
    keys, new = rows.to_reserve(clock())
    assert keys == first and new == 0  # renewals only: the demand is met
    rows.reserved(keys, 0, [100, 101, 102, 103], "r1", clock())
    clock.t += STALE_S - 1
    assert len(rows.take(1)) == 1 and rows.take_stale() == []
    clock.t += 2 * STALE_S  # an idle engine renewed nothing
    assert rows.take(1) == []
    assert sorted(rows.take_stale()) == sorted(first[1:])


def test_a_broker_restart_voids_every_spare():
    rows, clock = pool()
    rows.take(3)
    rows.step_ended()
    fill(rows, clock, "old")
    rows.take(20)
    rows.step_ended()
    keys, new = rows.to_reserve(clock())
    rows.reserved(keys, new, list(range(new)), "new", clock())
    assert rows.region == "new" and len(rows) == new  # the old region's are gone


def test_spare_keys_are_no_namespaces_and_never_repeat():
    rows, clock = pool()
    rows.take(8)
    rows.step_ended()
    keys = fill(rows, clock)
    assert all(k.startswith(spares_module.PREFIX) for k in keys)
    assert len(set(keys)) == len(keys) and all(len(k) <= 64 for k in keys)


def test_stores_waiting_for_rows_are_asked_for_within_a_refusals_back_off():
    rows, clock = pool(most=64)
    rows.take(30)
    rows.step_ended()
    keys, new = rows.to_reserve(clock())
    rows.reserved(keys, new, None, "", clock())  # a tight node: no room for 60
    assert rows.to_reserve(clock()) == ([], 0)  # backing off
    rows.want(10)  # a store of 10 blocks got no rows
    assert rows.short()
    keys, new = rows.to_reserve(clock())
    assert new == len(keys) == 10  # only what it lacks: a tight node may have that
    rows.reserved(keys, new, list(range(10)), "r1", clock())
    assert len(rows.take(10)) == 10


def test_a_reply_of_another_region_voids_the_spares_before_any_is_handed_out():
    rows, clock = pool()
    rows.take(4)
    rows.step_ended()
    fill(rows, clock, "old")
    rows.new_region("old")
    assert len(rows) == 8
    rows.new_region("")  # a refusal names no region: nothing learned
    assert len(rows) == 8
    rows.new_region("new")  # the broker restarted: the old one's rows are no one's
    assert len(rows) == 0 and rows.region == "new" and rows.take(4) == []


def test_waiting_stores_are_bounded_and_ended_with_their_request():
    from tierkv.vllm.spares import WaitingStores

    waiting = WaitingStores()
    waiting.refused("a", 10, "no room")
    waiting.refused("b", 5, "no room")
    assert waiting.rows() == 15 and "a" in waiting
    waiting.stored("a")
    assert waiting.ended("a") is None  # stored in a later step: nothing dropped
    dropped = waiting.ended("b")
    assert dropped is not None and (dropped.blocks, dropped.why) == (5, "no room")
    for i in range(WaitingStores.MOST + 3):
        waiting.refused(f"r{i}", 1, "no room")
    assert waiting.rows() == WaitingStores.MOST and "r0" not in waiting
