"""A child's secrets travel over a pipe, read once, not in its environment
(a peer's token in the environment stays readable in /proc/<pid>/environ for the
process's whole life, to every process of its user, and is inherited by whatever it
starts)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tierkv.node import lifecycle
from tierkv.node.lifecycle import (
    SECRETS_FD_ENV,
    Child,
    child_environment,
    spawn,
    stop,
    wait_ready,
)

CHILD = r"""
import json, os, sys, time
from pathlib import Path
from tierkv.node.lifecycle import SECRETS_FD_ENV, notify_ready, take_secrets

fd = os.environ.get(SECRETS_FD_ENV)
got = take_secrets()
again = take_secrets()
print(json.dumps({
    "got": got, "again": again == got,
    "recorded_first": Path(sys.argv[1]).exists(),  # on_started ran before we could read
    "env_after": os.environ.get(SECRETS_FD_ENV),
    "fd_open_after": fd is not None and os.path.exists(f"/proc/self/fd/{fd}"),
}), flush=True)
notify_ready()
time.sleep(60)
"""


def first_json_line(child: Child, timeout: float) -> str:
    """The child printed its report before saying ready, but our log pump is a thread
    of its own: the line may reach `log_lines` a moment after `wait_ready` returns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = next((line for line in child.log_lines if line.startswith("{")), None)
        if line is not None:
            return line
        time.sleep(0.01)
    raise AssertionError(f"no report from the child within {timeout}s:\n{child.tail()}")


def run_child(tmp_path: Path, secrets: dict[str, str] | None) -> tuple[dict, bytes]:
    """The child's report, and what /proc shows of it while it runs."""
    marker = tmp_path / "recorded"
    child = spawn("secret-child", [sys.executable, "-c", CHILD, str(marker)],
                  env=child_environment(), secrets=secrets,
                  on_started=lambda pid: marker.write_text(str(pid)))
    try:
        wait_ready([child], 30)
        proc = Path(f"/proc/{child.pid}")
        exposed = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
        report = json.loads(first_json_line(child, 10))
    finally:
        stop(child, 5)
    return report, exposed


def test_a_child_reads_its_secrets_once_and_proc_never_shows_them(tmp_path):
    token = "token-" + "7" * 32
    report, exposed = run_child(tmp_path, {"peer_token": token})
    assert report["got"] == {"peer_token": token} and report["again"]
    assert report["recorded_first"]
    assert report["env_after"] is None and not report["fd_open_after"]
    assert token.encode() not in exposed


def test_a_child_without_secrets_reads_none_and_never_an_inherited_fd(tmp_path, monkeypatch):
    # A parent that itself got secrets does not pass its (closed) pipe's number on.
    monkeypatch.setenv(SECRETS_FD_ENV, "3")
    report, _ = run_child(tmp_path, None)
    assert report["got"] == {} and report["recorded_first"]


def test_a_stale_variable_naming_another_fd_is_ignored_not_read(tmp_path, monkeypatch):
    """Started by hand with the variable left over: its fd may be a terminal or a
    file. Only a pipe is read, so nothing blocks and nothing foreign is taken."""
    path = tmp_path / "not-a-pipe"
    path.write_text('{"peer_token": "from a file"}')
    fd = os.open(path, os.O_RDONLY)
    try:
        monkeypatch.setattr(lifecycle, "_secrets", None)
        monkeypatch.setenv(SECRETS_FD_ENV, str(fd))
        assert lifecycle.take_secrets() == {}
    finally:
        os.close(fd)
