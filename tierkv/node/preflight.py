"""What a supervisor settles before it writes or removes anything.

A second `tierkv up` of an instance that is already running must be refused
without touching the running node: it once overwrote the run directory's
node.toml and deleted supervisor.json before it noticed, and the live node's next
restart of its disk tier came up on the other config's (empty) root. So "already
running" is decided first, by two facts that need no cooperation from the running
node's files:

- `InstanceClaim`: an exclusive `flock` on `supervisor.lock` in the run directory,
  held for the node's whole life (the kernel drops it when the holder dies, so a
  killed supervisor leaves no stale claim);
- a shared-memory region of the instance with a live owner (a broker of the same
  instance started from another run directory, or by hand).

Then the checks that need this machine (`check_here`): each tier's local checks (a
disk root exists) and a free metrics port, each one error naming the key and the
file, before any process starts.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from tierkv.core.shm import region_name, remove_stale_region
from tierkv.node.config import Config, ConfigError, check_tiers_here


class AlreadyRunning(RuntimeError):
    """This instance is served by a live node; nothing was touched."""


class InstanceClaim:
    """The exclusive claim of one run directory, held until `release` (or death)."""

    def __init__(self, run_path: Path) -> None:
        self.path = run_path / "supervisor.lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, instance: str) -> None:
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise AlreadyRunning(
                f"instance {instance!r} is already running (supervisor pid {holder}, run "
                f"directory {self.path.parent}); nothing was changed. Stop it first, or give "
                f"this node another instance name") from None
        os.ftruncate(fd, 0)  # ours now: say who holds it
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def check_no_live_region(instance: str) -> None:
    """Refuse when a live broker of `instance` holds its region (from any run
    directory). A region whose owner is dead is removed: no node uses it."""
    name = region_name(instance)
    path = Path("/dev/shm") / name.lstrip("/")
    if not path.exists():
        return
    remove_stale_region(instance)
    if path.exists():
        raise AlreadyRunning(
            f"instance {instance!r} is already running: its shared memory {name} has a live "
            f"owner (a broker started from another run directory or by hand); nothing was "
            f"changed")


def check_here(config: Config) -> None:
    """The checks that need this machine, before any process starts."""
    check_tiers_here(config)
    port = config.broker.metrics_port
    if port:
        problem = port_problem("127.0.0.1", port)
        if problem:
            raise ConfigError(f"{config.source}: broker.metrics_port = {port}: {problem}")


def port_problem(host: str, port: int) -> str | None:
    """Why the metrics endpoint could not bind `host:port` now, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the metrics server binds: a port only in TIME_WAIT is free to it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"{host}:{port} is already in use (choose another port, or 0: no metrics)"
            return f"cannot bind {host}:{port} ({e.strerror or e})"
    return None
