"""A disk tier whose budget is larger than its filesystem's free space holds what fits.

The tier's filesystem is a real 64 MiB tmpfs in a private mount namespace (root, or
a user namespace, only: skipped elsewhere); its budget is 128 MiB, and a filler file
takes part of the room first. The tier must hold about what fits (not nothing, and
not report the budget), grow when the filler goes, and, when the filesystem fills
up behind its back, fail a store cleanly and keep every block it holds. The
scenario runs as its own process inside the namespace (the mount has to exist
before it starts) and prints one JSON line of what it saw; the tmpfs vanishes with
the namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
FS_MIB = 64
# Mount the small tmpfs on "$1", then become the Python that runs the scenario.
ENTER = f'mount -t tmpfs -o size={FS_MIB}M tmpfs "$1" && shift && exec "$@"'
UNSHARE_ROOT = ["unshare", "-m", "--propagation", "private", "sh", "-c", ENTER, "enter"]
UNSHARE_USER = ["unshare", "-r", "-m", "--propagation", "private", "sh", "-c", ENTER, "enter"]
SCENARIO_TIMEOUT_S = 240.0  # 128 MiB of stores into memory, on 2 noisy cores

SCENARIO = r"""
import errno, json, logging, os, sys, time
from tierkv.core.errors import ErrorCode, TierError
from workers.disk import DiskBackend, slot_bytes_for

root, filler_mib, block, slab = sys.argv[1], *map(int, sys.argv[2:5])
MiB = 2**20
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("tierkv.disk").addHandler(Keep())
logging.getLogger("tierkv.disk").setLevel(logging.INFO)

def free_bytes():
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize

def take(path, nbytes=None):
    # A file of `nbytes`, or of everything the filesystem has left.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        size = 0
        while nbytes is None or size < nbytes:
            try:
                os.posix_fallocate(fd, size, MiB // 4)
            except OSError as e:
                if e.errno != errno.ENOSPC or nbytes is not None:
                    raise
                return
            size += MiB // 4
    finally:
        os.close(fd)

def payload(n):
    return (n.to_bytes(4, "big") * (block // 4))

def store(backend, first, count):
    ok, no_space = 0, 0
    for n in range(first, first + count):
        try:
            backend.store(b"k-%d" % n, memoryview(payload(n)))
            ok += 1
        except TierError as e:
            if e.code is not ErrorCode.NO_SPACE:
                raise
            no_space += 1
    return {"ok": ok, "no_space": no_space}

def intact(backend):
    out = bytearray(block)
    bad = 0
    for key in backend.inventory():
        backend.load(key, memoryview(out))
        bad += bytes(out) != payload(int(key.split(b"-")[1]))
    return bad

def figures(backend):
    stats = backend.stats()
    return {"capacity": backend.capacity(), "capacity_blocks": stats["capacity_blocks"],
            "blocks": stats["blocks"], "evictions": stats["evictions"],
            "bad_loads": intact(backend)}

seen = {"slot": slot_bytes_for(block)}
take(os.path.join(root, "filler"), filler_mib * MiB)
seen["free_at_start"] = free_bytes()
backend = DiskBackend(root, 128 * MiB, block, namespace="partial", o_direct=False,
                      slab_bytes=slab)
seen["start_log"] = [line for line in lines if "fit" in line]
seen["opened"] = {"capacity": backend.capacity()}
seen["first"] = {**store(backend, 0, 300), **figures(backend)}
# A restart finds the blocks and the same capacity.
backend.close()
backend = DiskBackend(root, 128 * MiB, block, namespace="partial", o_direct=False,
                      slab_bytes=slab)
seen["restarted"] = figures(backend)
# The filler goes: on its next store that finds the tier full, the tier looks
# for room again (at most every grow_retry_s; shortened here, not waited out).
os.unlink(os.path.join(root, "filler"))
seen["free_after_delete"] = free_bytes()
backend.grow_retry_s = 0.0
seen["grown"] = {**store(backend, 1000, 40), **figures(backend)}
# Someone else takes the rest of the filesystem before the tier used its new room.
take(os.path.join(root, "ballast"))
seen["filled"] = {**store(backend, 2000, 300), **figures(backend)}
backend.close()
print(json.dumps(seen))
"""


def namespace_command() -> list[str] | None:
    """The `unshare` that can mount a tmpfs here, or None."""
    if shutil.which("unshare") is None:
        return None
    for command in (UNSHARE_ROOT, UNSHARE_USER):
        try:
            probe = subprocess.run([*command, "/tmp", "true"], capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            continue
        if probe.returncode == 0:
            return command
    return None


@pytest.fixture(scope="module")
def unshare() -> list[str]:
    command = namespace_command()
    if command is None:
        pytest.skip("cannot mount a tmpfs in a private mount namespace here "
                    "(needs unshare(1) and root or user namespaces)")
    return command


def run_scenario(unshare: list[str], mount_point: Path, filler_mib: int, block: int,
                 slab_bytes: int) -> dict[str, Any]:
    """What the scenario saw in its namespace; it is killed by its process group
    (its pid) if it has not ended by then."""
    proc = subprocess.Popen(
        [*unshare, str(mount_point), sys.executable, "-c", SCENARIO, str(mount_point),
         str(filler_mib), str(block), str(slab_bytes)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=SCENARIO_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


# One slab for the whole budget (the default slab is 1 GiB), or 16 MiB slabs: the
# tier grows a slab at a time, so the filesystem can fill up between two.
@pytest.mark.parametrize("slab_mib", [1024, 16])
def test_a_budget_beyond_the_free_space_holds_what_fits_and_grows_as_space_frees(
        unshare, tmp_path, slab_mib):
    block = 256 * 1024
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    seen = run_scenario(unshare, mount_point, filler_mib=32, block=block,
                        slab_bytes=slab_mib * MiB)
    slot, budget = seen["slot"], 128 * MiB
    fits = seen["free_at_start"] // slot  # slots the filesystem had room for
    assert fits < budget // slot

    # At start: the capacity is what fits, give or take the headroom, and one
    # line says how much of the budget that is.
    opened = seen["opened"]["capacity"] // block
    assert 0.9 * fits <= opened <= fits, (opened, fits)
    assert len(seen["start_log"]) == 1, seen["start_log"]
    assert f"{opened} of the budget's {budget // slot} slots" in seen["start_log"][0]

    # 300 stores into a tier of ~120 slots: all succeed, the oldest make room.
    first = seen["first"]
    assert first["no_space"] == 0 and first["ok"] == 300, first
    assert first["blocks"] == first["capacity_blocks"] == opened, first
    assert first["evictions"] == 300 - opened and first["bad_loads"] == 0, first

    restarted = seen["restarted"]
    assert restarted["blocks"] == first["blocks"] and restarted["bad_loads"] == 0, restarted
    assert restarted["capacity_blocks"] == opened, restarted

    # The filler deleted: the tier grows into the space, instead of evicting.
    grown = seen["grown"]
    room = opened + seen["free_after_delete"] // slot
    assert grown["no_space"] == 0 and grown["ok"] == 40, grown
    assert 0.9 * room <= grown["capacity_blocks"] <= room, (grown, room)
    assert grown["evictions"] == 0, "it evicted instead of growing"
    assert grown["blocks"] == first["blocks"] + 40 and grown["bad_loads"] == 0, grown

    # The filesystem filled behind its back: at most a clean no_space while it
    # finds out, then it lives within what it has, and every block it reports loads.
    filled = seen["filled"]
    assert filled["no_space"] <= 1 and filled["ok"] + filled["no_space"] == 300, filled
    assert grown["blocks"] < filled["capacity_blocks"] <= grown["capacity_blocks"], filled
    if slab_mib * MiB < budget:  # its next slab did not fit any more
        assert filled["no_space"] == 1, filled
        assert filled["capacity_blocks"] < grown["capacity_blocks"], filled
    assert filled["blocks"] == filled["capacity_blocks"] and filled["bad_loads"] == 0, filled
