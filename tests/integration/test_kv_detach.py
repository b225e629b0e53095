"""An engine's KV cache is the engine's memory: once its registration ends (its
client closed), the worker must let go of it, not keep it mapped until another
registration replaces it."""

from __future__ import annotations

import time
from pathlib import Path


def _maps(pid: int, segment: str) -> bool:
    """Does process `pid` still map the shm segment `segment`?"""
    return f"/dev/shm/{segment.lstrip('/')}" in Path(f"/proc/{pid}/maps").read_text()


def test_the_worker_unmaps_the_kv_cache_of_a_client_that_closed(make_cluster):
    cluster = make_cluster()
    kv = cluster.kv[0]
    segment = kv.segment
    worker = cluster.node.pid("worker0")
    assert segment and _maps(worker, segment)
    cluster.clients[0].close()  # the client that registered it ends...
    kv.close()  # ...and the engine frees its memory (the segment is unlinked)
    cluster.kv.clear()
    deadline = time.monotonic() + 10.0
    while _maps(worker, segment) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _maps(worker, segment)
