"""The disk tier as it runs: in a real node (broker, CPU worker, tier process), and
killed with SIGKILL in the middle of a batch of stores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.integration.cluster import keys, step_until, store_when_room, wait_for
from tierkv.core.blockformat import CorruptBlock, unpack_header
from tierkv.core.errors import ErrorCode, TierError
from tierkv.node.config import ConfigError
from tierkv.node.lifecycle import wait_ready
from workers.disk import HEADER_AREA, DiskBackend, namespace_dir, slot_bytes_for

PAGE = 1024  # the cluster's block: 1 KiB per rank, one rank


def disk_entry(root: Path, slots: int = 64) -> dict:
    return {"type": "disk", "root": str(root), "budget_bytes": slots * slot_bytes_for(PAGE),
            "threads": 4}


def tier_blocks(client) -> int:
    tier = client.stats()["tiers"]["disk"]
    return tier["blocks"] if tier["available"] else -1


def tier_restarted(client, blocks: int) -> bool:
    tier = client.stats()["tiers"]["disk"]
    return tier["peer_deaths"] >= 1 and tier["available"] and tier["blocks"] == blocks


def slot_offset(root: Path, key: bytes, block_bytes: int = PAGE) -> tuple[Path, int]:
    """Where `key`'s block lies on disk, found the way a restart finds it."""
    slot = slot_bytes_for(block_bytes)
    for slab in sorted((root / namespace_dir("default")).glob("slab-*.dat")):
        raw = slab.read_bytes()
        for offset in range(0, len(raw), slot):
            try:
                if unpack_header(raw[offset : offset + 256]).key == key:
                    return slab, offset
            except CorruptBlock:
                continue
    raise AssertionError(f"key {key!r} is on no slot")


def restart_tier(cluster, name: str = "tier:disk:0") -> None:
    node = cluster.node
    node.kill(name, signal.SIGKILL)
    node.children[name].proc.wait(10)
    spec = next(s for s in node.specs() if s.name == name)
    wait_ready([node.spawn(spec)], 30)


def test_disk_round_trip_corruption_and_tier_restart(make_cluster, tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    cluster = make_cluster(cpu={"num_blocks": 8}, tiers=[disk_entry(root)])
    c = cluster.client()
    first, second = keys(*range(8)), keys(*range(100, 108))
    cluster.fill(first, list(range(8)))
    wait_for(c, {store_when_room(c, first, list(range(8))).job_id})
    step_until(c, lambda: tier_blocks(c) == 8)
    # Evict `first` from the CPU tier; only the disk holds it now.
    cluster.fill(second, list(range(8, 16)))
    wait_for(c, {store_when_room(c, second, list(range(8, 16))).job_id})
    assert c.lookup(first[:1], "r").hits == 0  # (a lookup starts promotions of what it scans)

    # Promote from disk, load into other GPU blocks: the same bytes.
    step_until(c, lambda: c.lookup(first[:4], "r").hits == 4)
    cluster.scramble([20, 21, 22, 23])
    load = c.load(first[:4], [20, 21, 22, 23], req_id="r")
    assert wait_for(c, {load.job_id})[load.job_id].success
    assert cluster.holds(first[:4], [20, 21, 22, 23])
    c.finish("r")

    # A flipped byte on disk: detected, never served, the key becomes a miss.
    slab, offset = slot_offset(root, first[5])
    with open(slab, "r+b") as f:
        f.seek(offset + HEADER_AREA + 100)
        byte = f.read(1)
        f.seek(offset + HEADER_AREA + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    step_until(c, lambda: not c.lookup(first[5:6], "bad").pending)
    assert c.lookup(first[5:6], "bad").hits == 0
    c.finish("bad")
    stats = c.stats()["tiers"]["disk"]
    assert stats["failures"].get("corrupt", 0) >= 1 and stats["corrupt_blocks"] == 1
    assert tier_blocks(c) == 15  # 8 + 8 stored, one corrupt block dropped

    # SIGKILL the tier and start it again: its inventory says what survived. Wait for
    # the broker to see the death and the new hello before asking: a promotion sent to
    # the dead process would fail, and the broker then remembers the key as a miss.
    restart_tier(cluster)
    step_until(c, lambda: tier_restarted(c, blocks=15))
    step_until(c, lambda: c.lookup(first[6:8], "again").hits == 2)
    cluster.scramble([24, 25])
    load = c.load(first[6:8], [24, 25], req_id="again")
    assert wait_for(c, {load.job_id})[load.job_id].success
    assert cluster.holds(first[6:8], [24, 25])


@pytest.mark.slow
def test_whole_cluster_restart_finds_every_block_stored(make_cluster, tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    ks = keys(*range(16))
    cluster = make_cluster(cpu={"num_blocks": 16}, tiers=[disk_entry(root)])
    c = cluster.client()
    cluster.fill(ks, list(range(16)))
    wait_for(c, {c.store(ks, list(range(16))).job_id})
    step_until(c, lambda: tier_blocks(c) == 16)
    cluster.stop()

    again = make_cluster(cpu={"num_blocks": 16}, tiers=[disk_entry(root)])
    c = again.client()
    step_until(c, lambda: tier_blocks(c) == 16)
    step_until(c, lambda: c.lookup(ks, "r").hits == 16)
    load = c.load(ks, list(range(16, 32)), req_id="r")
    assert wait_for(c, {load.job_id})[load.job_id].success
    assert again.holds(ks, list(range(16, 32)))


def test_missing_root_stops_the_node_with_a_clear_error(make_cluster, tmp_path):
    # Checked before any process starts, naming the key.
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.root .*missing' does not exist"):
        make_cluster(tiers=[disk_entry(tmp_path / "missing")])


# -- SIGKILL in the middle of a batch ------------------------------------------------------

CRASH_BLOCK = 256 * 1024
CRASH_KEYS = 160

_WRITER = textwrap.dedent("""
    import sys, threading
    import numpy as np
    from workers.disk import DiskBackend, slot_bytes_for
    root, first, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    backend = DiskBackend(root, (2 * n + 8) * slot_bytes_for(size), block_bytes=size,
                          namespace="crash")
    print("open", flush=True)
    lock = threading.Lock()

    def write(part):
        for i in range(first + part, first + n, 8):
            data = np.random.default_rng(i).bytes(size)
            backend.store(b"crash-%d" % i, memoryview(data))
            with lock:
                print(i, flush=True)  # reported stored: durable by now

    threads = [threading.Thread(target=write, args=(p,)) for p in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("done", flush=True)
""")


def _kill_mid_batch(root: Path, first: int, after: int) -> set[int]:
    """Run a writer process, SIGKILL it once `after` stores were reported."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), str(first), str(CRASH_BLOCK), str(CRASH_KEYS)],
        stdout=subprocess.PIPE, text=True, env=env)
    acked: set[int] = set()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if line.isdigit():
                acked.add(int(line))
            if len(acked) >= after or line == "done":
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert len(acked) >= after, "the writer finished before it could be killed"
    return acked


def test_sigkill_mid_batch_leaves_no_torn_block_and_loses_nothing_reported(tmp_path):
    acked: set[int] = set()
    for round_, first in enumerate((0, 1000)):
        acked |= _kill_mid_batch(tmp_path, first, after=40 + 20 * round_)
    backend = DiskBackend(str(tmp_path), (2 * CRASH_KEYS + 8) * slot_bytes_for(CRASH_BLOCK),
                          block_bytes=CRASH_BLOCK, namespace="crash")
    try:
        held = {int(k.split(b"-")[1]) for k in backend.inventory()}
        assert acked <= held, f"reported stored but lost: {sorted(acked - held)[:10]}"
        out = bytearray(CRASH_BLOCK)
        torn = 0
        for i in held:
            try:
                backend.load(b"crash-%d" % i, memoryview(out))
            except TierError as e:
                # Only a block the writer never reported may fail, and only as corrupt.
                assert e.code is ErrorCode.CORRUPT and i not in acked, (i, e)
                torn += 1
                continue
            assert bytes(out) == np.random.default_rng(i).bytes(CRASH_BLOCK), i
        assert backend.stats()["corrupt_blocks"] == torn
    finally:
        backend.close()
