"""What a hostile peer or client could do to a node that a well-behaved
one cannot: get a bystander process killed, crash a handler with a registration
nested 900 deep, or take the engine's KV registration away."""

from __future__ import annotations

import os
import subprocess
import time

import msgpack
import pytest
import zmq

from tests.integration.cluster import keys
from tierkv.client import RemoteError
from tierkv.node.children import tier_secret
from tierkv.wire.protocol import PROTOCOL_VERSION, Ready, TierHello, decode, encode


def dealer(address: str, name: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, name + os.urandom(4))
    sock.connect(address)
    return sock


def test_a_tier_hello_without_the_nodes_token_or_secret_is_refused(make_cluster):
    """A forged tier process was once welcomed, drew jobs by announcing
    credit, and answered promotions without writing the row."""
    cluster = make_cluster(cpu={"num_blocks": 16})
    forged = dealer(cluster.config.connect_address("tier"), b"forged")
    try:
        forged.send(encode(TierHello("memory", "memory", pid=os.getpid(), token="made-up")))
        forged.send(encode(Ready(1000)))
        assert forged.poll(5000)
        answer = decode(forged.recv())
        assert type(answer).__name__ == "Refused" and "tier secret" in answer.reason
    finally:
        forged.close()
    c = cluster.client()
    ks = keys(1, 2)
    cluster.fill(ks, [0, 1])
    assert c.wait([c.store(ks, [0, 1]).job_id])
    deadline = time.monotonic() + 10
    while c.stats()["tiers"]["memory"]["blocks"] < 2 and time.monotonic() < deadline:
        c.step()  # cascaded by the real tier process alone
        time.sleep(0.05)
    assert c.stats()["tiers"]["memory"]["blocks"] == 2


def test_a_tier_started_by_hand_that_goes_silent_never_gets_a_process_killed(make_cluster):
    """A tier process the operator started (it proves the tier secret, not a token of
    the supervisor's) names a bystander's pid. When it went silent the broker used to
    SIGKILL the named process. Now a peer the node did not start is never signalled;
    the blocks of the jobs it took stay held until the process it named is seen gone,
    so nothing it could still write lands in a reused row."""
    cluster = make_cluster(cpu={"num_blocks": 16})
    bystander = subprocess.Popen(["sleep", "120"])
    forged = dealer(cluster.config.connect_address("tier"), b"forged")
    try:
        c = cluster.client()
        secret = tier_secret(cluster.config.tier_secret_path, create=False)
        forged.send(encode(TierHello("memory", "memory", pid=bystander.pid, start_time=0,
                                     inventory_total=0, token=secret)))
        forged.send(encode_map({"v": PROTOCOL_VERSION, "op": "inventory", "keys": [],
                                "last": True}))
        forged.send(encode(Ready(1000)))  # the most credit: the jobs come here
        assert forged.poll(5000)
        assert type(decode(forged.recv())).__name__ == "Welcome"
        ks = keys(*range(1, 9))
        cluster.fill(ks, list(range(8)))
        deaths = c.stats()["broker"]["peer_deaths"]
        store = c.store(ks, list(range(8)))
        assert store.job_id is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c.stats()["broker"]["peer_deaths"] == deaths:
            c.step()  # the forged tier holds the cascades and answers nothing
            time.sleep(0.05)
        time.sleep(0.2)
        assert bystander.poll() is None, "the broker killed a process it did not start"
        stats = c.stats(verify=True)
        assert stats["quarantined_peers"] and stats["invariants"] == "ok"
        held = stats["tiers"]["memory"]["held_jobs"]
        assert held > 0  # the cascade jobs it took wait for it to exit
        bystander.kill()
        bystander.wait(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c.stats()["quarantined_peers"]:
            c.step()
            time.sleep(0.05)
        stats = c.stats(verify=True)
        assert not stats["quarantined_peers"] and stats["tiers"]["memory"]["held_jobs"] == 0
        assert stats["invariants"] == "ok"
        assert stats["tiering"]["cascades_in_flight"] == 0
    finally:
        forged.close()
        if bystander.poll() is None:
            bystander.kill()
            bystander.wait(5)


def encode_map(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def nested(depth: int) -> dict:
    value: dict = {"x": 1}
    for _ in range(depth):
        value = {"x": value}
    return value


def test_a_deeply_nested_registration_gets_an_error_reply_and_is_not_kept(make_cluster):
    """A `kv_register` nested 900 maps deep decoded, then raised RecursionError when
    the broker forwarded it: no reply, and the bad registration kept for re-sending."""
    cluster = make_cluster()
    sock = dealer(cluster.config.connect_address("client"), b"hostile")
    try:
        sock.send(encode_map({"v": PROTOCOL_VERSION, "op": "kv_register", "id": 5, "rank": 0,
                              "registration": nested(900)}))
        assert sock.poll(5000), "no reply to a deeply nested registration"
        reply = msgpack.unpackb(sock.recv(), raw=False)
        assert reply["id"] == 5 and reply["ok"] is False
        assert reply["error"]["code"] in ("bad_request", "protocol")
    finally:
        sock.close()
    c = cluster.client()
    ks = keys(1)
    cluster.fill(ks, [0])
    store = c.store(ks, [0])  # the engine's registration still works
    assert c.wait([store.job_id])[store.job_id].success


def test_no_client_can_take_the_engines_registration_away(make_cluster):
    """A bad `kv_register` from any client made the broker mark the rank as having
    no KV cache, though the worker still held the working one: the engine's stores
    failed until it registered again."""
    cluster = make_cluster()
    engine = cluster.clients[0]
    stranger = cluster.client()
    with pytest.raises(RemoteError):
        stranger.register_kv(0, {"x": 1})  # refused: not this rank's engine
    ks = keys(1, 2)
    cluster.fill(ks, [0, 1])
    store = engine.store(ks, [0, 1])
    assert engine.wait([store.job_id])[store.job_id].success
    # Even the engine's own bad registration leaves the working one in place.
    with pytest.raises(RemoteError):
        engine.register_kv(0, {"x": 1})
    load = engine.load(ks, [5, 6], req_id="r")
    assert engine.wait([load.job_id])[load.job_id].success
    assert cluster.holds(ks, [5, 6])
    # Another client may replace it with the token the registration returned.
    token = cluster.registration_tokens[0]
    assert token
    reply = stranger.register_kv(0, cluster.kv[0].registration(), token=token)
    assert reply["rank"] == 0
