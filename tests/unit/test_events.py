"""The broker's event routing: each client hears of the blocks it stored."""

from __future__ import annotations

from broker.events import MAX_CLIENTS, EventRouter
from tierkv.core.keys import OffloadEvent


def test_events_go_to_the_owner_of_each_key_and_the_publisher_gets_all():
    published: list[list[OffloadEvent]] = []
    router = EventRouter(published.append)
    router.own(b"A", [b"a1", b"a2"])
    router.own(b"B", [b"b1"])
    router.route([OffloadEvent("stored", (b"a1", b"b1", b"x"), "cpu"),
                  OffloadEvent("removed", (b"a2",), "disk")])
    assert router.take(b"A") == [OffloadEvent("stored", (b"a1",), "cpu"),
                                 OffloadEvent("removed", (b"a2",), "disk")]
    assert router.take(b"B") == [OffloadEvent("stored", (b"b1",), "cpu")]
    assert router.take(b"A") == []  # taken once
    assert len(published) == 1 and published[0][0].keys == (b"a1", b"b1", b"x")


def test_owners_and_queues_are_bounded():
    router = EventRouter(max_owned=3)
    router.own(b"A", [b"1", b"2", b"3", b"4"])
    router.route([OffloadEvent("stored", (b"1", b"4"), "cpu")])
    assert router.take(b"A") == [OffloadEvent("stored", (b"4",), "cpu")]  # b"1" forgotten
    for i in range(MAX_CLIENTS + 5):
        client = f"c{i}".encode()
        router.own(client, [client])
        router.route([OffloadEvent("stored", (client,), "cpu")])
    assert router.take(b"c0") == [] and router.dropped >= 5
    assert router.take(f"c{MAX_CLIENTS + 4}".encode())
