"""Which processes this node started: the evidence the broker needs before it kills
one (fencing).

A peer's hello names a pid, but a claim is not evidence: anyone who can reach the
broker's sockets could name any process. So the supervisor gives each child a
random token and records, owner-only in the run directory, a digest of the token
with the child's name and the pid and start time it saw itself. The broker trusts
a peer (admits it, and may fence it by signal) only if its token's digest is
recorded there, and then takes the pid and start time from the record, never from
the claim; any other peer is never signalled.

The token travels over the secret pipe of `tierkv.node.lifecycle` (read once at
start, then gone), not the environment: a process's environment stays readable
in /proc for its whole life to every process of its user, and is inherited by the
processes it starts. The record holds only digests, so reading it (it is the
supervisor's and the broker's, but any process of the user could) yields no token.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from tierkv.core.shm import process_start_time
from tierkv.node.lifecycle import take_secrets

TOKEN_SECRET = "peer_token"  # this process's token, in the secrets its parent handed it
FILE_NAME = "children.json"


def take_token() -> str:
    """The token the supervisor handed this process over its secret pipe ("" when
    started by hand)."""
    return take_secrets().get(TOKEN_SECRET, "")


def token_digest(token: str) -> str:
    """What the record keeps of a token: enough to check one, nothing to present."""
    return hashlib.sha256(token.encode()).hexdigest()


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
            self._children[token_digest(token)] = StartedChild(name, pid, start_time)
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


def child_by_token(run_dir: Path, token: str) -> StartedChild | None:
    """The child this node's supervisor started and gave `token` to, if it still runs
    as that very process (its recorded pid, with the recorded start time); None for
    any other token. Pid and start time come from the record, never from a claim."""
    if not token:
        return None
    try:
        data = json.loads((run_dir / FILE_NAME).read_text())
        name, pid, start_time = data[token_digest(token)]
        child = StartedChild(str(name), int(pid), int(start_time))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if child.pid <= 0 or not child.start_time:
        return None
    return child if process_start_time(child.pid) == child.start_time else None


def verified_child(run_dir: Path, token: str, pid: int, start_time: int) -> bool:
    """Is (pid, start_time) a process this node's supervisor started and gave
    `token` to, still running as that very process?"""
    child = child_by_token(run_dir, token)
    if child is None or child.pid != pid:
        return False
    return not start_time or start_time == child.start_time


def tier_secret(path: Path, create: bool = True) -> str:
    """The tier secret: what a tier process started outside the supervisor proves in
    its hello. Made (0600, random) by the broker when the file does not exist; a file
    other users could read, or that belongs to another user, is refused."""
    if create and not path.exists():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
    try:
        st = path.stat()
    except FileNotFoundError:
        return ""
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"tier secret file {path} must belong to this user with mode "
                              f"0600 (it is {oct(st.st_mode & 0o777)})")
    return path.read_text().strip()
