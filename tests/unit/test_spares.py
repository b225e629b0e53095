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
    assert rows.take(5) is None  # the demand is counted although none could be given
    rows.step_ended()
    keys = fill(rows, clock)
    assert len(keys) == 10 and len(rows) == 10 and rows.region == "r1"
    taken = rows.take(4)
    assert taken is not None and [s.key for s in taken] == keys[:4]
    assert [s.row for s in taken] == [100, 101, 102, 103]
    assert rows.take(7) is None and len(rows) == 6  # never part of a job's rows


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
    assert rows.take(1) is not None and rows.take_stale() == []
    clock.t += 2 * STALE_S  # an idle engine renewed nothing
    assert rows.take(1) is None
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
