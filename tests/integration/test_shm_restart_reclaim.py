"""A broker killed with a large CPU tier comes back.

A CPU tier of more than half of the free space in /dev/shm ran fine until its broker
was SIGKILLed: the region the dead broker left still counted as used when the restart
checked for room, so every restart was refused. Each test runs a scenario of
`tests/integration/small_shm.py` in a private mount namespace whose /dev/shm is a
real 10 MiB tmpfs (root only: skipped elsewhere); the tmpfs vanishes with the
namespace, and the host's /dev/shm is checked too.
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
SHM_SIZE = "10M"
# Mount the small tmpfs, then become the Python that runs the scenario ("$0" "$@").
ENTER = f'mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && exec "$0" "$@"'
UNSHARE = ["unshare", "-m", "--propagation", "private", "sh", "-c"]


def namespace_problem() -> str | None:
    """Why no private mount namespace with its own /dev/shm can be made here."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    try:
        probe = subprocess.run([*UNSHARE, ENTER, "true"], capture_output=True, text=True,
                               timeout=30)
    except subprocess.TimeoutExpired:
        return "unshare -m did not answer in 30 s"
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def small_shm() -> None:
    problem = namespace_problem()
    if problem:
        pytest.skip(f"needs root for `unshare -m` and mount ({problem})")


def run_scenario(scenario: str, instance: str, run_dir: Path,
                 timeout: float = 180) -> dict[str, Any]:
    """What the scenario saw, run in its own namespace; every process it left is
    killed by its process group (its pid) before this returns."""
    proc = subprocess.Popen(
        [*UNSHARE, ENTER, sys.executable, "-m", "tests.integration.small_shm",
         scenario, instance, str(run_dir)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def assert_nothing_left(seen: dict[str, Any], instance: str) -> None:
    """No segment in the namespace's /dev/shm when the scenario ended, none here."""
    assert seen["left_in_shm"] == [], "segments left in the namespace's /dev/shm"
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"tierkv.{instance}")]


def test_a_create_after_its_owner_was_killed_takes_the_dead_region(small_shm, instance,
                                                                   tmp_path):
    seen = run_scenario("restart", instance, tmp_path)
    assert seen["first"] == "created"
    # The killed owner's 6 MiB is still allocated: less than 6 MiB is free ...
    assert seen["left_after_kill"] and seen["free_after_kill"] < 6 * 2**20
    # ... and the same region is created again in its place.
    assert seen["again"] == "created", seen
    assert seen["blocks"] == 6
    assert_nothing_left(seen, instance)


def test_a_live_owners_region_is_refused_and_kept(small_shm, instance, tmp_path):
    seen = run_scenario("live", instance, tmp_path)
    assert seen["second"].startswith("refused RegionInUseError:"), seen
    assert "already running" in seen["second"]
    assert seen["kept"] and seen["bytes_kept"]
    assert_nothing_left(seen, instance)


def test_what_does_not_fit_is_refused_at_the_first_start_in_readable_units(
        small_shm, instance, tmp_path):
    seen = run_scenario("too_large", instance, tmp_path)
    assert seen["larger_than_shm"] == (
        "refused RegionError: region of 11.0 MiB does not fit: /dev/shm has 10.0 MiB free "
        "(lower cpu.num_blocks or page_size)"), seen
    # Another instance's live region is not this one's to reclaim.
    assert seen["beside_another"].startswith(
        "refused RegionError: region of 6.0 MiB does not fit: /dev/shm has 4.0 MiB free"), seen
    assert_nothing_left(seen, instance)


def test_a_killed_broker_with_a_large_cpu_tier_is_restarted_and_serves(small_shm, instance,
                                                                       tmp_path):
    seen = run_scenario("node", instance, tmp_path, timeout=300)
    log_tail = seen.pop("log_tail")
    assert seen["started"], log_tail
    assert seen["broker_back"], log_tail
    print(f"broker serving again {seen['back_after_s']} s after SIGKILL")
    assert seen["broker_restarts"] >= 1
    assert seen["stored"] and seen["hits"] == 2 and seen["loaded"] and seen["bytes_back"]
    assert seen["status_rc"] == 0
    assert seen["stop_rc"] == 0, log_tail
    assert_nothing_left(seen, instance)
