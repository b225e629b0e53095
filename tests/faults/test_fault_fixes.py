"""In-process checks of the product fixes the fault suite and the soak led to (each
is also exercised by a real fault or the soak; these pin the rule itself)."""

from __future__ import annotations

import os
from pathlib import Path

from broker.core import BrokerCore
from tests.integration.cluster import make_config
from tierkv.core.primary import PrimaryTier
from tierkv.core.shm import process_start_time
from tierkv.core.tiering import TieringManager
from tierkv.node.children import ChildRegistry
from tierkv.tiers.index import TierIndex
from tierkv.wire.protocol import Refused, Welcome, WorkerHello


def test_expired_negative_answers_do_not_pile_up():
    """A shared tier's misses are cached for `negative_ttl`; expired ones must leave,
    not stay until `max_negative` entries (the soak saw the broker grow by them)."""
    now = [0.0]
    index = TierIndex(shared=True, negative_ttl=2.0, clock=lambda: now[0])
    for i in range(10_000):
        now[0] = i * 0.01  # 100 misses a second
        index.checked((), [i.to_bytes(8, "big")])
    assert len(index._negative) <= 2.0 / 0.01 + 1
    assert index.lookup((9_999).to_bytes(8, "big")) is False  # still a cached miss
    now[0] += 3.0
    assert index.lookup((9_999).to_bytes(8, "big")) is None  # expired: asked again


def _core(tmp_path: Path) -> tuple[BrokerCore, list[tuple[str, bytes, object]]]:
    sent: list[tuple[str, bytes, object]] = []

    def send(link: str, identity: bytes, msg: object) -> bool:
        sent.append((link, identity, msg))
        return True

    config = make_config("fixes", tmp_path, tiers=[])
    return BrokerCore(config, TieringManager(PrimaryTier(16, "lru")), {}, send), sent


def test_a_worker_saying_hello_on_a_new_session_rejoins(tmp_path):
    """After a hung broker resumes, its worker's new session replaces the old one;
    a process the supervisor did not start, naming the live worker's pid and start
    time (both public), is refused: claims are not evidence."""
    core, sent = _core(tmp_path)
    pid = os.getpid()
    started = process_start_time(pid) or 0
    token = ChildRegistry.new_token()
    ChildRegistry(tmp_path).add(token, "worker0", pid)  # as the supervisor records a child
    core.on_worker(b"worker:0:1", WorkerHello(0, 1, pid, started, token=token))
    core.on_worker(b"worker:0:2", WorkerHello(0, 1, pid, started, token=token))
    assert isinstance(sent[-1][2], Welcome) and sent[-1][1] == b"worker:0:2"
    assert [p["pid"] for p in core.stats()["peers"]] == [pid]
    core.on_worker(b"impostor", WorkerHello(0, 1, pid, started, token="guessed"))
    assert isinstance(sent[-1][2], Refused) and "no token this node gave" in sent[-1][2].reason
    assert [p["pid"] for p in core.stats()["peers"]] == [pid]  # the real one stays
