"""A child that keeps dying of a signal: the supervisor's log says which signal, says
once what a SIGBUS most likely means (the shared memory ran out) with the free
space of /dev/shm, and the restarts back off instead of looping.

A worker of a node with `cpu.prefault = false` dies of SIGBUS at its first touch
of a page /dev/shm has no room for, and again after every restart. Here the same
death comes from `kill -BUS` on each new worker: the supervisor sees exactly what
the kernel's SIGBUS leaves (an exit status of -7)."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import new_instance
from tests.integration.cluster import leftovers, make_config
from tests.integration.test_supervisor import (
    REPO,
    alive,
    all_ready,
    child_pids,
    stop_supervisor,
    wait_status,
)
from tierkv.node.config import Config, dump_config

BACKOFF_S, BACKOFF_MAX_S = 0.2, 1.6
DEATHS = 6


def no_core_files() -> None:
    """A SIGBUS death dumps core by default: none of this test's, anywhere."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def start_quiet_supervisor(config: Config, path: Path) -> subprocess.Popen:
    """`tierkv up`, its output in node.log only (a pipe nobody reads could fill)."""
    path.write_text(dump_config(config))
    return subprocess.Popen(
        [sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=no_core_files,
    )


def worker_alive_other_than(old: int):  # noqa: ANN201
    return lambda s: any(c["name"] == "worker0" and c["alive"] and c["pid"] != old
                         for c in s["children"])


def test_a_worker_killed_by_sigbus_again_and_again_is_named_explained_once_and_backed_off(
        tmp_path):
    instance = new_instance()
    config = make_config(instance, tmp_path / "run", cpu={"prefault": False},
                         supervisor={"restart_backoff_s": BACKOFF_S,
                                     "restart_backoff_max_s": BACKOFF_MAX_S},
                         tiers=[{"type": "memory", "name": "mem"}])
    proc = start_quiet_supervisor(config, tmp_path / "node.toml.in")
    killed: list[int] = []
    try:
        pid = child_pids(wait_status(config, all_ready(config), proc))["worker0"]
        began = time.monotonic()
        for _ in range(DEATHS):
            subprocess.run(["kill", "-BUS", str(pid)], check=True, timeout=10)
            killed.append(pid)
            status = wait_status(config, worker_alive_other_than(pid), proc, timeout=60)
            pid = child_pids(status)["worker0"]
        took = time.monotonic() - began
    finally:
        assert stop_supervisor(proc) == 0
    assert not any(alive(p) for p in killed)
    assert leftovers(config.run_path, instance) == []

    text = (config.run_path / "node.log").read_text()
    deaths = [line for line in text.splitlines() if "worker0 (pid" in line and "SIGBUS" in line]
    assert len(deaths) == DEATHS, text[-4000:]
    for pid in killed:
        assert any(f"worker0 (pid {pid}) was killed by SIGBUS" in line for line in deaths)
    # The likely cause, with /dev/shm's free space in readable units, said once.
    hints = [line for line in text.splitlines() if "/dev/shm" in line and "free" in line]
    assert len(hints) == 1, hints
    assert re.search(r"\d+(\.\d)? (GiB|MiB|KiB|bytes) free", hints[0]), hints[0]
    assert "shared memory" in hints[0]
    # The delay doubles while it keeps dying, up to the configured maximum.
    delays = [float(d) for d in re.findall(r"worker0 \(pid \d+\) was killed by SIGBUS .*?"
                                           r"restarting in (\d+\.\d+)s", text)]
    assert delays == [0.2, 0.4, 0.8, 1.6, 1.6, 1.6], delays
    # Spread out: the restarts took at least the sum of their delays (a lower bound,
    # which a slow machine only makes easier), one restart per death.
    assert took >= sum(delays), (took, delays)
    assert text.count("restarted worker0 (pid") == DEATHS
