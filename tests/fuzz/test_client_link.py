"""Malformed input to a real broker process: error replies or counted drops, and it
keeps serving everyone else."""

from __future__ import annotations

import sys

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import new_instance
from tests.integration.cluster import leftovers, make_config
from tierkv.client import Client, RemoteError
from tierkv.node.config import dump_config
from tierkv.node.lifecycle import spawn, stop, wait_ready
from tierkv.wire.keyblob import pack_counts
from tierkv.wire.protocol import PROTOCOL_VERSION, decode


@pytest.fixture(scope="module")
def broker(tmp_path_factory):

    instance = new_instance()
    run_dir = tmp_path_factory.mktemp("broker")
    config = make_config(instance, run_dir, tiers=[])
    path = run_dir / "b.toml"
    path.write_text(dump_config(config))
    child = spawn("broker", [sys.executable, "-m", "broker", "-c", str(path)])
    try:
        wait_ready([child], 30)
        yield config
    finally:
        assert stop(child, 10) == 0, child.tail()
        assert leftovers(run_dir, instance) == []


def raw_socket(config) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(config.address("client"))
    return sock


def ask(sock: zmq.Socket, payload: bytes, timeout_ms: int = 3000):
    sock.send(payload)
    assert sock.poll(timeout_ms), "the broker did not answer"
    return decode(sock.recv())


def ops(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": "ops", **fields})


@pytest.mark.parametrize("payload, code", [
    (b"\x00\x01garbage", "protocol"),
    (msgpack.packb({"v": PROTOCOL_VERSION + 1, "op": "ops", "id": 3}), "protocol"),
    (msgpack.packb({"v": 1, "op": "lookup", "id": 3, "keys": [b"k"]}), "protocol"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "op": "nuke", "id": 4}), "protocol"),
    (ops(id=5, keys=[7], key_len=1), "protocol"),
    (ops(id=6, keys=b"k" * 65, key_len=65, lookup={"counts": pack_counts([1])}), "protocol"),
    (ops(id=7, keys=b"kk", key_len=1, lookup={"counts": pack_counts([5])}), "protocol"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "op": "tier_hello", "id": 8, "tier": "x",
                    "type": "x", "pid": 1}), "protocol"),
])
def test_bad_requests_get_error_replies(broker, payload, code):
    sock = raw_socket(broker)
    try:
        reply = ask(sock, payload)
        assert reply.ok is False and reply.error.code == code
    finally:
        sock.close()
    with Client(broker.address("client"), timeout=3) as c:
        assert c.lookup([b"fine"]).hits == 0


def test_a_refused_group_is_an_error_of_its_own_and_the_others_run(broker):
    sock = raw_socket(broker)
    try:
        reply = ask(sock, ops(id=9, keys=b"ab", key_len=1, lookup={"counts": pack_counts([1])},
                              load={"counts": pack_counts([1])}, load_gpu=pack_counts([1])))
        assert reply.ok and reply.result["hits"] == pack_counts([0])
        (error,) = reply.result["errors"]
        assert error["section"] == "load" and error["code"] == "unavailable"  # no worker
    finally:
        sock.close()


def test_version_mismatch_names_both_versions(broker):
    sock = raw_socket(broker)
    try:
        reply = ask(sock, msgpack.packb({"v": 7, "op": "stats", "id": 1}))
        assert "protocol version 7" in reply.error.message
        assert f"speaks version {PROTOCOL_VERSION}" in reply.error.message
        assert reply.id == 1
    finally:
        sock.close()


def test_misuse_is_refused_with_bad_request(broker):
    with Client(broker.address("client"), timeout=3) as c:
        with pytest.raises(RemoteError) as e:
            c.load([b"never-stored"], [0])
        assert e.value.code in ("bad_request", "unavailable")


GROUPS = st.fixed_dictionaries(
    {"counts": st.one_of(st.binary(max_size=12),
                         st.lists(st.integers(-2, 4), max_size=3).map(pack_counts))},
    optional={"req_ids": st.lists(st.text(max_size=3), max_size=3)})


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(max_size=300),
    st.dictionaries(
        st.sampled_from(["v", "op", "id", "keys", "key_len", "key_lens", "lookup", "pin",
                         "reserve", "commit", "commit_ok", "store", "store_gpu", "load",
                         "load_gpu", "finish", "step", "wait", "wait_s", "contexts"]),
        st.one_of(st.integers(-5, 2**40), st.text(max_size=8), st.binary(max_size=12),
                  st.none(), st.booleans(), GROUPS, st.lists(st.binary(max_size=4), max_size=5),
                  st.sampled_from(["ops", "stats", "kv_register", PROTOCOL_VERSION]))
    ).map(lambda d: msgpack.packb(d, use_bin_type=True)),
))
def test_fuzzed_client_messages_never_stop_the_broker(broker, payload):
    sock = raw_socket(broker)
    try:
        sock.send(payload)
        if sock.poll(2000):
            decode(sock.recv())  # whatever came back is a well-formed reply
    finally:
        sock.close()
    with Client(broker.address("client"), timeout=3) as c:
        assert c.stats()["state"] == "running"
