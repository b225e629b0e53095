"""A node run the way the README says: `tierkv up --detach`, `tierkv status` (table and
JSON), `tierkv down`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.integration.cluster import leftovers, make_config
from tierkv.node.config import dump_config
from tierkv.node.control import supervisor_pid
from tierkv.node.status import gather, render, report

REPO = Path(__file__).resolve().parents[2]


def tierkv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierkv.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def node_file(instance: str, tmp_path: Path) -> tuple[Any, str]:
    config = make_config(instance, tmp_path / "run", worker={"enabled": False},
                         tiers=[{"type": "memory", "name": "mem", "capacity_blocks": 16}])
    path = tmp_path / "node.toml"
    path.write_text(dump_config(config))
    return config, str(path)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout}s"
        time.sleep(0.05)


def table_rows(text: str) -> list[list[str]]:
    """The process table's rows: process, pid, state (a state may hold a comma)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("process "))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip())[:3])
    return rows


def test_up_detach_status_and_down(instance, tmp_path):
    config, path = node_file(instance, tmp_path)
    up = tierkv("up", "--detach", "-c", path)
    assert up.returncode == 0, up.stderr
    assert f"log: {config.run_path / 'node.log'}" in up.stdout
    sup = supervisor_pid(config)
    assert sup is not None and f"supervisor pid {sup}" in up.stdout
    try:
        status = json.loads(tierkv("status", "--json", "-c", path).stdout)
        assert status["supervisor"]["alive"] and status["supervisor"]["pid"] == sup
        assert {c["name"]: c["state"] for c in status["supervisor"]["children"]} == {
            "broker": "running", "tier:mem:0": "running"}
        # What a promotion from each tier is expected to cost, until measured its
        # type's default, in both forms.
        cost = status["broker"]["tiers"]["mem"]["load_cost"]
        assert cost["samples"] == 0 and cost["latency_ms"] > 0 and cost["bandwidth_mb_s"] > 0
        table = tierkv("status", "-c", path).stdout
        assert "load latency" in table and "no (default)" in table
        # A second start of the running instance is refused and changes nothing.
        again = tierkv("up", "--detach", "-c", path)
        assert again.returncode != 0 and "already running" in again.stderr
        assert supervisor_pid(config) == sup
    finally:
        down = tierkv("down", "-c", path)
    assert down.returncode == 0, down.stderr
    pids = {c["name"]: c["pid"] for c in status["supervisor"]["children"]}
    assert f"supervisor (pid {sup})" in down.stdout
    for name, pid in pids.items():
        assert f"{name} (pid {pid})" in down.stdout
        assert gone(pid)
    assert gone(sup) and leftovers(config.run_path, instance) == []
    # Nothing to stop: said, and not a success.
    again = tierkv("down", "-c", path)
    assert again.returncode == 1 and f"instance {instance!r} is not running" in again.stderr


def test_down_says_when_the_node_has_not_stopped_in_time(instance, tmp_path):
    config, path = node_file(instance, tmp_path)
    assert tierkv("up", "--detach", "-c", path).returncode == 0
    sup = supervisor_pid(config)
    assert sup is not None
    os.kill(sup, signal.SIGSTOP)  # it cannot act on the SIGTERM until it is continued
    try:
        late = tierkv("down", "--timeout", "1", "-c", path)
        assert late.returncode == 1 and "still stopping after 1s" in late.stderr
    finally:
        os.kill(sup, signal.SIGCONT)  # the pending SIGTERM now stops it, cleanly
    wait_until(lambda: gone(sup), 60, "the supervisor stopped")
    assert leftovers(config.run_path, instance) == []


def test_status_json_is_checked_now_as_the_table_is(instance, tmp_path):
    """After the supervisor was SIGKILLed and its children exited, the
    table said `exited` but --json printed the status file as written, `alive: true`
    for pids that no longer existed."""
    config, path = node_file(instance, tmp_path)
    assert tierkv("up", "--detach", "-c", path).returncode == 0
    sup = supervisor_pid(config)
    assert sup is not None
    written = json.loads((config.run_path / "supervisor.json").read_text())
    pids = [c["pid"] for c in written["children"]]
    os.kill(sup, signal.SIGKILL)
    # The children see their lifeline close and stop by themselves.
    wait_until(lambda: all(gone(p) for p in [sup, *pids]), 60, "the node's processes exited")
    assert all(c["alive"] for c in written["children"])  # what the file still says
    before = time.time()
    out = tierkv("status", "--json", "-c", path)
    data = json.loads(out.stdout)
    assert data["checked_at"] >= before
    assert data["supervisor"]["alive"] is False and data["supervisor"]["uptime_s"] is None
    assert data["supervisor"]["written"] == written["written"]
    for child in data["supervisor"]["children"]:
        assert (child["alive"], child["state"], child["uptime_s"]) == (False, "exited", None)
    # The table says the same, row for row.
    text = tierkv("status", "-c", path).stdout
    assert f"supervisor: pid {sup} is not running" in text
    assert table_rows(text) == [[p["process"], str(p["pid"]), p["state"]]
                                for p in data["processes"]]
    assert [row[2] for row in table_rows(text)] == ["exited", "exited"]
    # The same checked report behind both, at one instant.
    status = gather(config, timeout=1)
    now = time.time()
    checked = report(status, now)
    assert table_rows(render(status, now)) == [[p["process"], str(p["pid"]), p["state"]]
                                               for p in checked["processes"]]


def test_down_has_its_own_usage():
    out = tierkv("down", "--help", timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: tierkv down")
    assert "--timeout" in out.stdout
