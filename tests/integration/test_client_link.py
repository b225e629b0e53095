"""The client link as any ZeroMQ client in any language sees it: the wire format of
the README, with REQ as well as DEALER sockets, against a real broker process."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from tests.integration.cluster import keys
from tierkv.client import BrokerUnavailable, Client


def roundtrip(sock: zmq.Socket, request: dict) -> dict:
    sock.send(msgpack.packb(request, use_bin_type=True))
    assert sock.poll(5000), "no reply from the broker within 5 s"
    return msgpack.unpackb(sock.recv(), raw=False)


def test_a_plain_req_client_gets_its_reply(make_cluster):
    """Issue 13: the broker dropped REQ's empty delimiter and replied without it,
    so libzmq discarded the reply and a REQ client waited forever."""
    cluster = make_cluster()
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(cluster.config.connect_address("client"))
        reply = roundtrip(req, {"v": 1, "op": "stats", "id": 7})
        assert reply["op"] == "reply" and reply["id"] == 7 and reply["ok"] is True
        assert reply["result"]["instance"] == cluster.config.instance
        # A REQ socket alternates send and receive: a second request works too.
        reply = roundtrip(req, {"v": 1, "op": "lookup", "id": 8, "keys": keys(1, 2)})
        assert reply["ok"] and reply["result"]["hits"] == 0
        bad = roundtrip(req, {"v": 1, "op": "lookup", "id": 9, "keys": "not a list"})
        assert bad["ok"] is False and bad["error"]["code"] == "protocol" and bad["id"] == 9
    finally:
        req.close()


def test_a_raw_dealer_client_gets_its_reply_without_an_envelope(make_cluster):
    cluster = make_cluster()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(cluster.config.connect_address("client"))
        reply = roundtrip(dealer, {"v": 1, "op": "stats", "id": 1})
        assert reply["ok"] and reply["id"] == 1
    finally:
        dealer.close()


def test_a_client_of_a_socket_file_that_does_not_exist_says_so_at_once(tmp_path):
    """Issue 13: it waited its whole timeout (10 s) before saying anything."""
    address = f"ipc://{tmp_path / 'nothing-here.sock'}"
    with Client(address, timeout=10.0) as client:
        t0 = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="socket file does not exist"):
            client.stats()
        assert time.monotonic() - t0 < 1.0
