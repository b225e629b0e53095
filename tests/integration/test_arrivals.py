"""What a reply says has arrived at the node (`OpsResult.arrivals`): the keys it came
to hold other than by the asking client's own stores. An engine keeps the misses of
a request waiting in its queue while that count does not move, instead of asking
about them again every few steps, so the count must move with every store by
another client and never with the client's own. A real node, real clients."""

from __future__ import annotations

import pytest

from tests.integration.cluster import keys, wait_for
from tests.integration.test_ownership import write_rows
from tierkv.client import Client, RemoteError


def arrivals(client: Client) -> int:
    """The count as a reply to this client says it (a lookup of a key nobody stores)."""
    found = client.lookup(keys(999_999, prefix=b"nobody"), "probe")
    assert found.hits == 0 and found.arrivals >= 0
    return found.arrivals


def stored_by_reservation(client: Client, instance: str, block_keys: list[bytes]) -> None:
    """Stored the way an engine that copies its own blocks does: reserve, write, commit."""
    reserved = client.reserve(block_keys, "writer")
    write_rows(instance, block_keys, reserved.block_ids)
    client.commit(block_keys)


def test_the_count_moves_with_another_clients_stores_not_with_ones_own(make_cluster,
                                                                         instance):
    cluster = make_cluster(cpu={"num_blocks": 32})
    engine, other = cluster.client(), cluster.client()
    before, others_before = arrivals(engine), arrivals(other)
    assert engine.lookup(keys(1, 2), "waiting").hits == 0  # misses it is told
    stored_by_reservation(engine, instance, keys(3, 4))
    cluster.fill(keys(5), [0])
    wait_for(engine, {engine.store(keys(5), [0]).job_id})  # through the node's worker
    assert arrivals(engine) == before  # its own stores: its misses are still misses
    assert arrivals(other) == others_before + 3  # to the other, three keys arrived
    stored_by_reservation(other, instance, keys(1))
    assert arrivals(engine) == before + 1  # one of its misses may be a hit now
    assert engine.lookup(keys(1, 2), "waiting").hits == 1
    other.reserve(keys(6), "failed")
    other.commit(keys(6), ok=False)  # a store that failed brings nothing
    assert arrivals(engine) == before + 1
    # An engine that connects anew counts its own stores from nothing: it is never
    # told a value a miss it kept from before could carry.
    again = cluster.client()
    assert abs(arrivals(again) - arrivals(engine)) > 1 << 20


def test_the_count_is_of_the_clients_namespace(make_cluster, instance):
    """Engines of two models share a node, each in a namespace of its own (the prefix
    of its keys, which it names as its scope): a store in one moves the count of
    every client of that namespace, and not the other's."""
    cluster = make_cluster(cpu={"num_blocks": 32})
    engine, same, other = cluster.client(), cluster.client(), cluster.client()
    engine.scope = same.scope = b"model-a"
    other.scope = b"model-b"
    before, theirs = arrivals(engine), arrivals(other)
    stored_by_reservation(other, instance, keys(1, 2, prefix=b"model-b"))
    assert arrivals(engine) == before  # another model's blocks: no miss of it changed
    stored_by_reservation(same, instance, keys(1, prefix=b"model-a"))
    assert arrivals(engine) == before + 1
    assert arrivals(other) == theirs  # its own stores, and another namespace's


def test_a_scope_longer_than_a_key_is_refused_and_changes_nothing(make_cluster):
    cluster = make_cluster(cpu={"num_blocks": 8})
    client = cluster.client()
    client.scope = b"s" * 65
    with pytest.raises(RemoteError, match="ops.scope"):
        client.lookup(keys(1), "r")
    client.scope = b""
    assert client.lookup(keys(1), "r").hits == 0 and arrivals(client) >= 0
