"""The event router's bounds, counted in keys: a client's queue, one reply, and the
owner map, which is as large as what the tiers hold."""

from __future__ import annotations

from broker.events import MAX_QUEUED_KEYS, MAX_REPLY_KEYS, EventRouter
from tierkv.core.keys import OffloadEvent


def key(n: int) -> bytes:
    return b"key" + n.to_bytes(8, "big")


def stored(first: int, n: int) -> OffloadEvent:
    return OffloadEvent("stored", tuple(key(i) for i in range(first, first + n)), "cpu")


def test_a_silent_clients_queue_keeps_its_newest_keys_and_says_how_many_went():
    router = EventRouter()
    tick = 1000
    total = MAX_QUEUED_KEYS + 5 * tick + 123
    router.own(b"A", [key(i) for i in range(total)])
    for first in range(0, total, tick):
        router.route([stored(first, min(tick, total - first))])
    assert router.queued_keys == MAX_QUEUED_KEYS
    assert router.take_dropped(b"A") == total - MAX_QUEUED_KEYS
    assert router.take_dropped(b"A") == 0  # told once
    taken = []
    while events := router.take(b"A"):
        assert sum(len(e.keys) for e in events) <= MAX_REPLY_KEYS
        taken.extend(k for e in events for k in e.keys)
    assert taken == [key(i) for i in range(total - MAX_QUEUED_KEYS, total)]  # newest, in order


def test_a_reply_splits_an_event_and_the_rest_comes_next():
    router = EventRouter()
    router.own(b"A", [key(i) for i in range(10)])
    router.route([stored(0, 10)])
    assert router.take(b"A", limit=4) == [stored(0, 4)]
    assert router.take(b"A", limit=4) == [stored(4, 4)]
    assert router.take(b"A", limit=4) == [stored(8, 2)]
    assert router.take(b"A") == [] and router.take_dropped(b"A") == 0


def test_an_owner_is_forgotten_once_no_tier_holds_its_key():
    held = {key(1), key(2)}
    router = EventRouter(holds=held.__contains__)
    router.own(b"A", [key(1), key(2), key(3)])  # key 3: a store that failed, no event
    held.discard(key(1))
    router.route([OffloadEvent("removed", (key(1),), "cpu")])
    assert router.take(b"A") == [OffloadEvent("removed", (key(1),), "cpu")]  # heard first
    assert router.stats()["owned_keys"] == 1  # key 1 and key 3 went; key 2 is held
    router.route([OffloadEvent("stored", (key(1), key(2)), "disk")])
    assert router.take(b"A") == [OffloadEvent("stored", (key(2),), "disk")]


def test_an_ended_client_gets_no_queue_and_its_owners_go():
    router = EventRouter()
    router.own(b"A", [key(1)])
    router.route([stored(1, 1)])
    router.forget(b"A")
    router.route([stored(1, 1)])
    assert router.queued_keys == 0 and router.take(b"A") == []
    router.own(b"B", [key(2)])
    router.route([])  # the sweep meets the ended client's entry
    assert router.stats()["owned_keys"] == 1
