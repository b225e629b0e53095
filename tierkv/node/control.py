"""`tierkv up --detach` and `tierkv down`: a node started in the background, and
stopped without hunting for a pid.

Which process is the node's supervisor is decided by the kernel, not by a file a
killed run may have left: the supervisor holds an exclusive `flock` on
`supervisor.lock` in the run directory for its whole life (`preflight`), and
/proc/locks names the holder. `down` sends that process SIGTERM, the same clean
stop as ^C (broker first, then the rest), and waits for it to exit.

`up --detach` starts the supervisor in a new session with a ready pipe
(`tierkv.node.lifecycle`) and its output on a pipe of ours: it returns once the
whole node is up, or prints what the supervisor said when it did not start. Once
ready, the supervisor points its own stdout and stderr at /dev/null (its log is
the node's log file) so that nothing it writes later depends on us.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.node.config import Config
from tierkv.node.lifecycle import READY_FD_ENV, child_environment, notify_ready
from tierkv.node.status import STATUS_FILE, running
from tierkv.wire.sockets import check_run_dir

LOCK_FILE = "supervisor.lock"  # held by the supervisor for its whole life (preflight)
OUTPUT_LINES = 40  # of a detached supervisor that did not start: the last lines shown


class NotRunning(RuntimeError):
    """No supervisor serves this instance."""


@dataclass
class Stopped:
    instance: str
    supervisor_pid: int
    children: dict[str, int] = field(default_factory=dict)  # name -> pid, as it last wrote
    left: list[str] = field(default_factory=list)  # children still running after it exited
    elapsed_s: float = 0.0


def supervisor_pid(config: Config) -> int | None:
    """The pid of the process that holds this instance's claim, or None. Raises
    RunDirError when the run directory is not this user's alone."""
    if not check_run_dir(config.run_path):
        return None
    path = config.run_path / LOCK_FILE
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    try:
        holder = _flock_holder(st.st_dev, st.st_ino)
    except OSError:  # no /proc/locks here: ask the lock itself
        holder = _probe(path)
    if holder is not None:
        return holder if holder > 0 else _pid_in(path)
    return None


def _probe(path: Path) -> int | None:
    """0 if someone holds the claim, None if not. Only where /proc/locks is missing:
    the probe holds the lock for an instant, and a `tierkv up` in that instant would
    be refused."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0
    finally:
        os.close(fd)  # releases a lock it got
    return None


def _flock_holder(dev: int, ino: int) -> int | None:
    """The pid /proc/locks names for a granted flock on (dev, ino); 0 when the holder
    is not visible from here (another pid namespace); None when none is held."""
    wanted = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            # "1: FLOCK  ADVISORY  WRITE 4242 00:2a:1234 0 EOF"; waiters carry "->"
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == wanted:
                try:
                    return int(parts[4])
                except ValueError:
                    return 0
    return None


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def down(config: Config, timeout_s: float) -> Stopped:
    """Stop the node serving `config`'s instance cleanly and wait until its
    supervisor exited. Raises NotRunning, or TimeoutError (the node is still
    stopping; nothing more is done to it)."""
    pid = supervisor_pid(config)
    if pid is None:
        raise NotRunning(f"instance {config.instance!r} is not running: no supervisor holds "
                         f"{config.run_path / LOCK_FILE}")
    children = _children(config, pid)
    started = time.monotonic()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it just exited
    except PermissionError:
        raise NotRunning(f"instance {config.instance!r} is served by pid {pid}, which is not "
                         f"yours to stop") from None
    while _alive(pid):
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(
                f"node {config.instance!r} (supervisor pid {pid}) is still stopping after "
                f"{timeout_s:.0f}s (--timeout); its log: {config.run_path / 'node.log'}")
        time.sleep(0.05)
    left = [name for name, (child, start) in children.items() if running(child, start)]
    return Stopped(config.instance, pid, {n: c for n, (c, _) in children.items()}, left,
                   time.monotonic() - started)


def _children(config: Config, pid: int) -> dict[str, tuple[int, int]]:
    """name -> (pid, start time) of the supervisor's children, as it last wrote them."""
    try:
        status = json.loads((config.run_path / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if status.get("pid") != pid:
        return {}
    return {c["name"]: (c["pid"], c.get("start_time", 0)) for c in status.get("children", [])}


def _alive(pid: int) -> bool:
    return running(pid, 0)


# -- up --detach -------------------------------------------------------------------


@dataclass
class Detached:
    pid: int
    log_path: Path


def detach(config: Config, config_path: str | None, verbose: int, timeout_s: float) -> Detached:
    """Start `tierkv up` in the background and return once the node is up. Raises
    RuntimeError with the supervisor's last lines when it exits first, or when it
    is not up within `timeout_s` (then it is stopped)."""
    argv = [sys.executable, "-m", "tierkv.node.supervise", "--quiet-children", "--detached",
            *(["-c", str(Path(config_path).resolve())] if config_path else []),
            *["-v"] * verbose]
    ready_r, ready_w = os.pipe()
    env = child_environment({READY_FD_ENV: str(ready_w)})
    try:
        proc = subprocess.Popen(argv, env=env, pass_fds=(ready_w,), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)  # not ours: ^C here never reaches it
    finally:
        os.close(ready_w)
    assert proc.stdout is not None
    output = _Output()
    watching = [ready_r, proc.stdout.fileno()]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            for fd in select.select(watching, [], [], 0.2)[0]:
                if fd != ready_r:
                    output.read(fd)
                elif os.read(ready_r, 4096).startswith(b"ready"):
                    return Detached(proc.pid, config.run_path / "node.log")
                else:
                    watching.remove(ready_r)  # closed unready: it is exiting
            if proc.poll() is not None:
                output.read_rest(proc.stdout.fileno())
                raise RuntimeError(f"the node did not start (the supervisor exited with code "
                                   f"{proc.returncode}):\n{output.tail()}")
            if time.monotonic() > deadline:
                proc.terminate()  # it stops what it started
                proc.wait(60)
                raise RuntimeError(f"the node was not up within {timeout_s:.0f}s (--timeout); "
                                   f"stopped. The supervisor's last lines:\n{output.tail()}")
    finally:
        os.close(ready_r)
        proc.stdout.close()


class _Output:
    """The last lines a starting supervisor wrote."""

    def __init__(self) -> None:
        self.data = b""

    def read(self, fd: int) -> bool:
        chunk = os.read(fd, 65536)
        self.data = (self.data + chunk)[-65536:]
        return bool(chunk)

    def read_rest(self, fd: int) -> None:
        while select.select([fd], [], [], 0.5)[0] and self.read(fd):
            pass

    def tail(self) -> str:
        lines = self.data.decode(errors="replace").splitlines()
        return "\n".join(lines[-OUTPUT_LINES:])


def detached_ready() -> None:
    """In the detached supervisor, once the node is up: let go of the starter's
    pipe (every later line is in the node's log) and tell it we are ready."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    finally:
        os.close(devnull)
    notify_ready("node up")
