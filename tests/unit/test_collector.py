"""The broker's collector: what survives a full collection is frozen, so later
collections walk only what is new (their pause does not grow with the node), and
a cycle among frozen objects is still freed at the next thaw."""

from __future__ import annotations

import gc
import weakref

import pytest

from broker.collector import Collector


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def collector():
    clock = [0.0]
    c = Collector(clock=lambda: clock[0], rethaw_s=60.0)
    c.start()
    yield c, clock
    c.stop()
    gc.unfreeze()


def test_survivors_of_a_full_collection_are_frozen(collector):
    c, _ = collector
    kept = [[i] for i in range(1000)]  # noqa: F841  (live records, like a node's)
    frozen = gc.get_freeze_count()
    c.after_turn()
    assert gc.get_freeze_count() == frozen  # no full collection ran: nothing frozen
    gc.collect()
    c.after_turn()
    assert gc.get_freeze_count() >= frozen + 1000
    assert c.stats()["freezes"] == 1


def test_a_cycle_frozen_alive_is_freed_at_the_thaw(collector):
    c, clock = collector
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    gc.collect()
    c.after_turn()  # the cycle is frozen while alive
    del a, b
    gc.collect()
    assert gone() is not None  # frozen: the collector does not walk it
    clock[0] = 61.0
    c.after_turn()
    assert gone() is None
    assert c.stats()["rethaws"] == 1
