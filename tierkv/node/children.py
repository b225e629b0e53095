"""Which processes this node started: the evidence the broker needs before it kills
one (fencing).

A peer's hello names a pid, but a claim is not evidence: anyone who can reach the
broker's sockets could name any process. So the supervisor gives each child a
random token (in its environment, read once at start) and records, owner-only in
the run directory, the token with the pid and start time it saw itself. The broker
fences a peer by signal only if the peer's token is recorded there with the pid
and start time the process has now; any other peer is never signalled.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from tierkv.core.shm import process_start_time

TOKEN_ENV = "TIERKV_PEER_TOKEN"
FILE_NAME = "children.json"


def take_token() -> str:
    """This process's token, taken out of the environment so that its own children
    do not inherit it ("" when started by hand)."""
    return os.environ.pop(TOKEN_ENV, "")


@dataclass(frozen=True)
class StartedChild:
    name: str
    pid: int
    start_time: int


class ChildRegistry:
    """The supervisor's record of its children, one file in the run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / FILE_NAME
        self._children: dict[str, StartedChild] = {}
        self._lock = threading.Lock()  # the supervisor's watch loop and its stop

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(16)

    def add(self, token: str, name: str, pid: int) -> None:
        start_time = process_start_time(pid) or 0
        with self._lock:
            self._children[token] = StartedChild(name, pid, start_time)
            self._write()

    def remove_pid(self, pid: int) -> None:
        with self._lock:
            self._children = {t: c for t, c in self._children.items() if c.pid != pid}
            self._write()

    def clear(self) -> None:
        with self._lock:
            self._children.clear()
            self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        data = {t: [c.name, c.pid, c.start_time] for t, c in self._children.items()}
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        tmp.replace(self.path)


def verified_child(run_dir: Path, token: str, pid: int, start_time: int) -> bool:
    """Is (pid, start_time) a process this node's supervisor started and gave
    `token` to, still running as that very process?"""
    if not token or pid <= 0:
        return False
    try:
        data = json.loads((run_dir / FILE_NAME).read_text())
        name, recorded_pid, recorded_start = data[token]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if recorded_pid != pid or not recorded_start:
        return False
    if start_time and start_time != recorded_start:
        return False
    return process_start_time(pid) == recorded_start
