"""A node and a client at `realtime_priority`: the broker's threads in SCHED_RR for
its life, the client's I/O thread too, and its calling thread only while it waits;
everything works as without it, and a closed client can be used again."""

from __future__ import annotations

import os

import pytest

from tests.integration.cluster import keys, wait_for
from tierkv.client import Client
from tierkv.node.realtime import allowed

pytestmark = pytest.mark.skipif(not allowed(1), reason="this process may not use SCHED_RR "
                                "(CAP_SYS_NICE or `ulimit -r 1`)")


def classes(pid: int) -> dict[str, set[int]]:
    """Thread name -> the scheduling classes of the threads of `pid` with that name."""
    out: dict[str, set[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            policy = os.sched_getscheduler(int(tid)) & ~os.SCHED_RESET_ON_FORK
        except (FileNotFoundError, ProcessLookupError):
            continue
        out.setdefault(name, set()).add(policy)
    return out


def test_broker_and_client_at_realtime_priority_serve_as_usual(make_cluster):
    cluster = make_cluster(broker={"realtime_priority": 1}, client={"realtime_priority": 1})
    broker = classes(cluster.node.pid("broker"))
    assert set().union(*broker.values()) == {os.SCHED_RR}, broker
    assert any(name.startswith("ZMQbg/IO") for name in broker)  # its I/O thread too

    client = Client.from_config(cluster.config)
    client.use_kv(cluster.registration_tokens)
    try:
        blocks = keys(1, 2, 3)
        cluster.fill(blocks, [0, 1, 2])
        wait_for(client, {client.store(blocks, [0, 1, 2]).job_id})
        assert client.lookup(blocks, "r1").hits == 3
        ours = classes(os.getpid())
        assert os.SCHED_RR in ours.get("ZMQbg/IO/0", set()), ours  # the context of its own
        # The calling thread went back to its class after each wait.
        assert os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK == os.SCHED_OTHER
        client.close()
        assert client.lookup(blocks, "r2").hits == 3  # used again after close
    finally:
        client.close()
    # The worker is started by the supervisor, not the broker: untouched.
    worker = classes(cluster.node.pid("worker0"))
    assert os.SCHED_RR not in set().union(*worker.values())
