"""Bad input on the worker and tier links: forged job ids, truncated and mutated
messages, wrong types, a peer claiming a rank that is taken. The broker answers
with refusals or drops and counts, never crashes, and its block states stay
consistent (checked after every batch); the real peers keep serving."""

from __future__ import annotations

import os
import random
import subprocess

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import new_instance
from tests.integration.cluster import Cluster, keys, leftovers, make_config
from tierkv.core.errors import ErrorCode
from tierkv.core.shm import process_start_time
from tierkv.engine import allocate_kv_cache
from tierkv.node.children import ChildRegistry, tier_secret
from tierkv.tiers.base import JobResult
from tierkv.wire.protocol import (
    PROTOCOL_VERSION,
    Heartbeat,
    Inventory,
    Ready,
    Refused,
    TierDoneBatch,
    TierHello,
    TransferDoneBatch,
    TransferOutcome,
    Welcome,
    WorkerHello,
    decode,
    encode,
)

TRIED = {"worker": 0, "tier": 0}
NO_PROCESS = 1 << 23  # above Linux's highest pid_max: never a process


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """World size 2 with one real worker (rank 0): a fuzzing peer can be rank 1."""
    instance = new_instance()
    run_dir = tmp_path_factory.mktemp("fuzz")
    config = make_config(instance, run_dir, cpu={"num_blocks": 64, "world_size": 2},
                         broker={"job_timeout_s": 30.0},
                         tiers=[{"type": "memory", "name": "mem", "capacity_blocks": 256}])
    cluster = Cluster(config, gpu_blocks=32)
    spec = [s for s in cluster.node.specs() if s.name != "worker1"]
    cluster.node.specs = lambda: spec  # type: ignore[method-assign]
    cluster.node.start()
    cluster.kv.append(allocate_kv_cache(instance, 0, cluster.layout))
    cluster.client().register_kv(0, cluster.kv[0].registration())
    yield cluster
    cluster.stop()
    print(f"\nfuzz inputs tried: {TRIED}")
    assert leftovers(run_dir, instance) == []


class FakePeer:
    def __init__(self, address: str, name: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, f"{name}:{os.urandom(4).hex()}".encode())
        self.sock.connect(address)

    def send(self, payload: bytes) -> None:
        self.sock.send(payload)

    def replies(self, timeout_ms: int = 200) -> list:
        out = []
        while self.sock.poll(timeout_ms):
            out.append(decode(self.sock.recv()))
            timeout_ms = 20
        return out

    def close(self) -> None:
        self.sock.close()


def healthy(cluster: Cluster) -> None:
    c = cluster.clients[0] if cluster.clients else cluster.client()
    stats = c.stats(verify=True)
    assert stats["state"] == "running"
    assert stats["invariants"] == "ok", stats["invariants"]


def mutations(payload: bytes, rng: random.Random) -> list[bytes]:
    """Truncations, bit flips, duplications and splices of a valid message."""
    out = [payload[: rng.randrange(len(payload))] for _ in range(3)]
    for _ in range(4):
        b = bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        out.append(bytes(b))
    out.append(payload + payload)
    out.append(payload[: len(payload) // 2] + os.urandom(8))
    return out


def test_a_hello_naming_the_live_workers_pid_without_its_token_is_refused(node):
    """A hello naming the live worker's pid and start time (both public) once
    replaced it, and the engine's copies then came back wrong."""
    worker = next(p for p in node.clients[0].stats()["peers"] if p["kind"] == "worker")
    pid = worker["pid"]
    peer = FakePeer(node.config.connect_address("worker"), "impostor")
    try:
        peer.send(encode(WorkerHello(0, 2, pid, process_start_time(pid) or 0)))
        (answer,) = peer.replies(2000)
        assert isinstance(answer, Refused) and "no token this node gave" in answer.reason
        peer.send(encode(TransferDoneBatch([TransferOutcome(1, True)])))
        assert isinstance(peer.replies(2000)[0], Refused)  # not admitted: say hello first
    finally:
        peer.close()
    healthy(node)


def test_wrong_world_size_and_out_of_range_rank_are_refused(node):
    peer = FakePeer(node.config.connect_address("worker"), "lost")
    try:
        for hello in (WorkerHello(1, 4, 1), WorkerHello(7, 2, 1), WorkerHello(-1, 2, 1)):
            peer.send(encode(hello))
            (answer,) = peer.replies(2000)
            assert isinstance(answer, Refused) and "does not fit" in answer.reason
    finally:
        peer.close()


def test_forged_and_malformed_worker_messages(node):
    """A fuzzing rank-1 worker answers real jobs with forged, stale and garbage
    outcomes; rank 0 is real. Stores and loads still end (failed or not) and the
    broker's state stays consistent."""
    rng = random.Random(1234)
    c = node.clients[0]
    peer = FakePeer(node.config.connect_address("worker"), "fuzz1")
    stand_in = subprocess.Popen(["sleep", "300"])
    try:
        # Admitted as the supervisor admits its children: a token in its record, for
        # a stand-in process (the one the broker would fence if the peer went silent).
        token, kv_token = ChildRegistry.new_token(), ChildRegistry.new_token()
        node.node.registry.add(token, "worker1", stand_in.pid)
        c.use_kv({1: kv_token})
        peer.send(encode(WorkerHello(1, 2, NO_PROCESS, 0, "cpu", {"fake": True}, token=token,
                                     registration_token=kv_token)))
        assert any(isinstance(m, Welcome) for m in peer.replies(2000))
        stores = seen = 0
        for round_ in range(6):
            ks = keys(*range(round_ * 10, round_ * 10 + 3), prefix=b"w")
            node.fill(ks, [0, 1, 2])
            store = c.store(ks, [0, 1, 2])
            stores += store.job_id is not None
            jobs = [m for m in peer.replies(300) if hasattr(m, "jobs")]
            job_ids = [j.job_id for batch in jobs for j in batch.jobs]
            seen += len(job_ids)
            garbage = [
                encode(TransferDoneBatch([TransferOutcome(j + 1000, True) for j in job_ids])),
                encode(TransferDoneBatch([TransferOutcome(-5, False, "x" * 10_000, "y")])),
                msgpack.packb({"v": PROTOCOL_VERSION, "op": "transfer_done", "results": [1]}),
                msgpack.packb({"v": PROTOCOL_VERSION, "op": "transfer", "jobs": []}),
                msgpack.packb({"v": PROTOCOL_VERSION + 1, "op": "hb"}),
                encode(Heartbeat()), os.urandom(rng.randrange(1, 64)),
            ]
            valid = encode(TransferDoneBatch([TransferOutcome(j, rng.random() < 0.5,
                                                              ErrorCode.FATAL.value)
                                              for j in job_ids]))
            for payload in [*garbage, *mutations(valid, rng), valid, valid]:
                peer.send(payload)
                TRIED["worker"] += 1
            if store.job_id is not None:
                c.wait([store.job_id], timeout=30)  # ends: failed or not, never hangs
            healthy(node)
        assert stores == 6 and seen >= 6  # the fuzzing rank was sent every job
    finally:
        peer.close()
        stand_in.kill()
        stand_in.wait(10)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of(
    st.binary(max_size=200),
    st.fixed_dictionaries({"v": st.just(PROTOCOL_VERSION), "op": st.sampled_from(
        ["tier_done", "inventory", "ready", "tier_stats", "tier_hello", "hb", "bye"])},
        optional={"results": st.lists(st.dictionaries(
            st.sampled_from(["job_id", "success", "successful_keys", "error_code"]),
            st.one_of(st.integers(-3, 3), st.booleans(), st.binary(max_size=9),
                      st.lists(st.binary(min_size=1, max_size=9), max_size=3))), max_size=3),
                  "keys": st.lists(st.binary(max_size=70), max_size=5),
                  "credit": st.integers(-10, 10**6), "last": st.booleans(),
                  "stats": st.dictionaries(st.text(max_size=3), st.integers(-9, 9))}
    ).map(lambda d: msgpack.packb(d, use_bin_type=True))),
    min_size=1, max_size=8))
def test_fuzzed_tier_messages_never_break_the_broker(node, payloads):
    peer = FakePeer(node.config.connect_address("tier"), "fuzztier")
    try:
        peer.send(encode(TierHello("mem", "memory", NO_PROCESS, namespace=node.config.namespace,
                                   token=tier_secret(node.config.tier_secret_path))))
        peer.send(encode(Inventory([b"ghost-key"], True)))
        peer.send(encode(Ready(4)))
        for payload in payloads:
            peer.send(payload)
            TRIED["tier"] += 1
        peer.send(encode(TierDoneBatch([JobResult(10**9, True, (b"k",))], credit=1)))
        peer.replies(100)
    finally:
        peer.close()
    healthy(node)


def test_real_tier_and_worker_still_serve_after_the_fuzzing(node):
    c = node.clients[0]
    peers = c.stats()["peers"]
    assert any(p["kind"] == "tier" and p["state"] == "ready" for p in peers)
    assert c.stats()["broker"]["protocol_errors"] > 0  # what was dropped was counted
    healthy(node)
