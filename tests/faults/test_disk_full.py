"""The disk filling up under load, for real: the disk tier lives on a small tmpfs
whose size is below the tier's budget, and at a random point of the load a ballast
file takes what is left, so the next slab the tier grows fails with ENOSPC. The
store fails cleanly (no_space), the tier process keeps running and from then on
lives within the slabs it has (at its limit: every store evicts), and the node keeps
serving. Without root (no tmpfs) the same node runs on a plain directory with a
budget at its limit, and only the second test runs.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import new_instance
from tests.faults.harness import FaultRun, NodeUnderTest, running_node
from tests.faults.node import PAGE, disk_tier
from workers.disk import slot_bytes_for

SLOT = slot_bytes_for(PAGE)
SLAB = 8 * SLOT  # small slabs: the filesystem fills at a slab boundary, as it would


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, bool]]:
    """(root, is a 4 MiB tmpfs); unmounted after the node stopped."""
    root = tmp_path_factory.mktemp("small") / "disk"
    root.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(root)],
        capture_output=True).returncode == 0
    try:
        yield root, mounted
    finally:
        if mounted and subprocess.run(["umount", str(root)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.fixture(scope="module")
def full_node(small_disk: tuple[Path, bool], tmp_path_factory: pytest.TempPathFactory,
              fault_seed: int) -> Iterator[NodeUnderTest]:
    root, mounted = small_disk
    # On the tmpfs: a 16 MiB budget on 4 MiB. Without it: 96 slots, soon at the limit.
    slots = 2048 if mounted else 96
    tier = disk_tier(root, slots, slab_bytes=SLAB, o_direct=False)
    with running_node(new_instance(), tmp_path_factory.mktemp("fullnode"), [tier],
                      fault_seed, disk_root=root) as nut:
        yield nut


def _disk(nut: NodeUnderTest, key: str) -> int:
    stats = nut.stats()
    return 0 if stats is None else int(stats["tiers"]["disk"][key])


def _no_space(nut: NodeUnderTest) -> int:
    failures = nut.failures()
    return 0 if failures is None else failures["disk:no_space"]


def fill_up(root: Path) -> None:
    """A ballast file takes all but less than one slab of what the filesystem has.
    It grows in pieces until ENOSPC: the tier grows its slabs meanwhile, so a size
    computed from `statvfs` first may no longer fit."""
    piece = SLAB // 4
    fd = os.open(root / "ballast", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        size = 0
        while True:
            try:
                os.posix_fallocate(fd, size, piece)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                return
            size += piece
    finally:
        os.close(fd)


def test_disk_fills_up_stores_fail_cleanly_and_the_node_serves_on(full_node, small_disk):
    root, mounted = small_disk
    if not mounted:
        pytest.skip("a real full filesystem needs a tmpfs mount (root)")
    nut = full_node
    tier_pid = nut.node.pid("tier:disk:0")
    with FaultRun(nut, "disk full (tmpfs ENOSPC)") as run:
        # Later than other faults: the tier should hold a few hundred blocks by then,
        # so that what it keeps after the ENOSPC is worth checking.
        run.inject(lambda: fill_up(root), warmup=(3.0, 5.0))
        run.detected(lambda: _no_space(nut) > 0)
        stores = _disk(nut, "stores")
        run.recovered(lambda: _disk(nut, "stores") > stores)
    result = run.check()
    # No crash, no restart: the same tier process, living within the slabs it has.
    assert nut.node.pid("tier:disk:0") == tier_pid and nut.peer_ready("tier", "disk")
    (backend,) = nut.stats()["tiers"]["disk"]["backend"]
    assert backend["enospc_failures"] >= 1, backend
    assert backend["capacity_blocks"] < backend["budget_blocks"], backend
    assert result.checked_blocks > 0


def test_disk_at_its_limit_evicts_and_keeps_what_it_reports(full_node):
    """Past the ENOSPC (or a small budget), every store into the disk tier evicts its
    least recently used block: stores go on, evictions are reported, nothing that
    is still reported stored is missing."""
    nut = full_node
    tier_pid = nut.node.pid("tier:disk:0")
    evictions = _disk(nut, "evictions")
    with FaultRun(nut, "disk at its limit (evicting)") as run:
        run.inject(lambda: None)  # the limit is the fault: the load runs into it
        assert run.probe.round_trip()
    run.check()
    assert _disk(nut, "evictions") > evictions
    assert nut.node.pid("tier:disk:0") == tier_pid
    assert nut.recorder.removed_since(run.mark), "evictions are reported as removed events"
