"""The client link as any ZeroMQ client in any language sees it: the wire format of
the README, with REQ as well as DEALER sockets, against a real broker process."""

from __future__ import annotations

import struct
import time

import msgpack
import pytest
import zmq

from tests.integration.cluster import keys
from tierkv.client import BrokerUnavailable, Client
from tierkv.wire.protocol import PROTOCOL_VERSION as V


def roundtrip(sock: zmq.Socket, request: dict) -> dict:
    sock.send(msgpack.packb(request, use_bin_type=True))
    assert sock.poll(5000), "no reply from the broker within 5 s"
    return msgpack.unpackb(sock.recv(), raw=False)


def test_a_plain_req_client_gets_its_reply(make_cluster):
    """The broker once dropped REQ's empty delimiter and replied without it,
    so libzmq discarded the reply and a REQ client waited forever."""
    cluster = make_cluster()
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(cluster.config.connect_address("client"))
        reply = roundtrip(req, {"v": V, "op": "stats", "id": 7})
        assert reply["op"] == "reply" and reply["id"] == 7 and reply["ok"] is True
        assert reply["result"]["instance"] == cluster.config.instance
        # A REQ socket alternates send and receive: a second request works too. The
        # lookup of the README's wire format: two keys of one request, in one blob.
        reply = roundtrip(req, {"v": V, "op": "ops", "id": 8, "keys": b"".join(keys(1, 2)),
                                "key_len": 9, "lookup": {"counts": struct.pack("<i", 2),
                                                         "req_ids": ["r1"]}})
        assert reply["ok"] and struct.unpack("<i", reply["result"]["hits"]) == (0,)
        assert reply["result"]["state"] == b"\x00"  # answered: nothing to wait for
        bad = roundtrip(req, {"v": V, "op": "ops", "id": 9, "keys": b"x" * 10, "key_len": 9})
        assert bad["ok"] is False and bad["error"]["code"] == "protocol" and bad["id"] == 9
        old = roundtrip(req, {"v": 1, "op": "lookup", "id": 10, "keys": keys(1)})
        assert old["ok"] is False and "protocol version 1" in old["error"]["message"]
    finally:
        req.close()


def test_a_raw_dealer_client_gets_its_reply_without_an_envelope(make_cluster):
    cluster = make_cluster()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(cluster.config.connect_address("client"))
        reply = roundtrip(dealer, {"v": V, "op": "stats", "id": 1})
        assert reply["ok"] and reply["id"] == 1
    finally:
        dealer.close()


def test_a_client_of_a_socket_file_that_does_not_exist_says_so_at_once(tmp_path):
    """A missing socket file is said at once, not after the whole timeout (10 s)."""
    address = f"ipc://{tmp_path / 'nothing-here.sock'}"
    with Client(address, timeout=10.0) as client:
        t0 = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="socket file does not exist"):
            client.stats()
        assert time.monotonic() - t0 < 1.0


def test_each_client_hears_of_its_own_blocks_and_a_router_of_all(make_cluster, tmp_path):
    """Two engines on one broker: the events of both must not go to whichever
    stepped first. Each now gets the events of the blocks it stored; a router that
    wants the whole node subscribes to `broker.events_address`."""
    events_address = f"ipc://{tmp_path / 'events.sock'}"
    cluster = make_cluster(broker={"events_address": events_address})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events_address)
    a, b = cluster.client(), cluster.client()
    mine, theirs = keys(1, 2), keys(3)
    cluster.fill(mine + theirs, [0, 1, 2])
    time.sleep(0.2)  # the subscription reaches the broker's PUB socket
    stores = [a.store(mine, [0, 1], "ra"), b.store(theirs, [2], "rb")]
    heard: dict[str, list] = {"a": [], "b": []}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        heard["a"] += a.step().events
        heard["b"] += b.step().events
        if {k for e in heard["a"] for k in e.keys} >= set(mine) and heard["b"]:
            break
    stored = {name: {(e.tier, k) for e in evs if e.kind == "stored" for k in e.keys}
              for name, evs in heard.items()}
    assert ("cpu", mine[0]) in stored["a"] and ("cpu", mine[1]) in stored["a"]
    assert stored["b"] >= {("cpu", theirs[0])}
    assert not {k for _, k in stored["a"]} & set(theirs)
    assert not {k for _, k in stored["b"]} & set(mine)
    assert all(s.job_id for s in stores)
    published = set()
    while sub.poll(2000) and not published >= set(mine + theirs):
        batch = msgpack.unpackb(sub.recv(), raw=False)
        assert batch["op"] == "events" and batch["seq"] >= 1
        published |= {k for e in batch["events"] if e["tier"] == "cpu" for k in e["keys"]}
    assert published >= set(mine + theirs)
    sub.close()


def test_a_list_over_the_limit_is_refused_under_its_own_request_id(make_cluster):
    """The refusal of a message with a list over MAX_LIST came back under id 0: the
    client skipped it as stale and waited out its timeout (BrokerUnavailable)."""
    from tierkv.client import RemoteError
    from tierkv.wire.protocol import MAX_LIST

    c = make_cluster().client(timeout=5.0)
    batch = c.batch()
    for _ in range(MAX_LIST + 1):
        batch.finish("r")
    with pytest.raises(RemoteError) as refused:
        batch.send()
    assert refused.value.code == "protocol" and "max_array_len" in refused.value.message
