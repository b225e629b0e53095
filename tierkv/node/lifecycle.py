"""Process lifetimes: the readiness handshake and the parent-death pipe.

A parent (the supervisor, or a test fixture) starts each child with two pipes:
- a ready pipe: the child writes one line when it is serving, so the parent can
  wait for readiness and for the child's exit together and fail fast on a crash;
- a lifeline: the parent holds the write end; when the parent dies, for any
  reason, the child reads EOF and stops by itself. No orphans.
The fds travel in environment variables, so the same child runs by hand without
them.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.node.logs import read_lines

#: The folder that holds `tierkv/`, `broker/` and `workers/` (a checkout, or site-packages).
SOURCE_ROOT = Path(__file__).resolve().parents[2]
READY_FD_ENV = "TIERKV_READY_FD"
LIFELINE_FD_ENV = "TIERKV_LIFELINE_FD"

log = logging.getLogger("tierkv.node.lifecycle")


# -- child side ------------------------------------------------------------------------


def notify_ready(detail: str = "") -> None:
    """Tell the parent we are serving (no-op when started by hand)."""
    fd = os.environ.pop(READY_FD_ENV, None)
    if fd is None:
        return
    try:
        os.write(int(fd), f"ready {detail}\n".encode())
        os.close(int(fd))
    except OSError:
        pass


def lifeline_fd() -> int | None:
    """The fd that reads EOF when the parent dies (poll it with the sockets)."""
    fd = os.environ.get(LIFELINE_FD_ENV)
    return int(fd) if fd is not None else None


def parent_gone(fd: int) -> bool:
    """True if the lifeline has closed (call when poll says it is readable)."""
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# -- parent side -----------------------------------------------------------------------


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child that must import this very tierkv,
    also when it runs from a checkout rather than an installed package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


class ChildFailed(RuntimeError):
    """A child exited or did not become ready; the message has its last lines."""


@dataclass(eq=False)
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen
    ready_fd: int | None
    lifeline_w: int
    started_at: float
    log_lines: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))
    ready: bool = False
    bytes_logged: int = 0  # everything the child wrote so far
    ready_detail: str = ""
    _reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, n: int = 20) -> str:
        return "\n".join(list(self.log_lines)[-n:])

    def close_fds(self) -> None:
        for fd in (self.ready_fd, self.lifeline_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.ready_fd = None


def spawn(
    name: str,
    argv: Sequence[str],
    env: dict[str, str] | None = None,
    log_lines: int = 40,
    echo: bool = False,
    sink: Callable[[str], None] | None = None,
) -> Child:
    """Start a child with a ready pipe and a lifeline; its output is kept (and
    echoed to our stderr if `echo`, and handed line by line to `sink`: the node's
    log). Each line is cut to `tierkv.node.logs.LINE_BYTES`."""
    ready_r, ready_w = os.pipe()
    life_r, life_w = os.pipe()
    os.set_inheritable(ready_w, True)
    os.set_inheritable(life_r, True)
    child_env = dict(os.environ if env is None else env)
    child_env[READY_FD_ENV] = str(ready_w)
    child_env[LIFELINE_FD_ENV] = str(life_r)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        proc = subprocess.Popen(
            list(argv), env=child_env, pass_fds=(ready_w, life_r),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a ^C to the parent's group reaches the parent only
        )
    finally:
        os.close(ready_w)
        os.close(life_r)
    child = Child(name, list(argv), proc, ready_r, life_w, time.monotonic())
    child.log_lines = collections.deque(maxlen=log_lines)
    child._reader = threading.Thread(target=_pump, args=(child, echo, sink), daemon=True,
                                     name=f"log-{name}")
    child._reader.start()
    return child


def _pump(child: Child, echo: bool, sink: Callable[[str], None] | None) -> None:
    """Drain the child's output for as long as it runs: a pump that stopped would
    block the child on a full pipe, so a failing sink or echo only loses lines."""
    assert child.proc.stdout is not None
    for line in read_lines(child.proc.stdout):
        child.bytes_logged += len(line) + 1
        child.log_lines.append(line)
        try:
            if sink is not None:
                sink(line)
            if echo:
                os.write(2, (line + "\n").encode())
        except (OSError, ValueError):
            pass


def wait_ready(children: Sequence[Child], timeout: float) -> None:
    """Wait until every child said ready; raise ChildFailed, naming the child, its
    exit code and its last lines, as soon as one exits or the timeout passes."""
    deadline = time.monotonic() + timeout
    waiting = {c.ready_fd: c for c in children if not c.ready and c.ready_fd is not None}
    while waiting:
        for child in waiting.values():
            code = child.proc.poll()
            if code is not None:
                time.sleep(0.1)  # let the log pump catch the last lines
                raise ChildFailed(
                    f"{child.name} (pid {child.pid}) exited with code {code} before it was "
                    f"ready; its last lines:\n{child.tail()}"
                )
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(c.name for c in waiting.values())
            tails = "\n".join(f"--- {c.name}:\n{c.tail(10)}" for c in waiting.values())
            raise ChildFailed(f"not ready within {timeout:.0f}s: {names}\n{tails}")
        readable, _, _ = select.select(list(waiting), [], [], min(left, 0.1))
        for fd in readable:
            child = waiting.pop(fd)
            data = os.read(fd, 4096)
            os.close(fd)
            child.ready_fd = None
            if data.startswith(b"ready"):
                child.ready = True
                child.ready_detail = data.decode(errors="replace").strip()[6:]
            else:
                waiting_code = child.proc.wait(timeout=5)
                raise ChildFailed(
                    f"{child.name} (pid {child.pid}) exited with code {waiting_code} before "
                    f"it was ready; its last lines:\n{child.tail()}"
                )


def stop(child: Child, timeout: float = 10.0, sig: int = 15) -> int | None:
    """SIGTERM (or `sig`), wait, then SIGKILL. Returns the exit code."""
    try:
        if child.proc.poll() is None:
            try:
                child.proc.send_signal(sig)
                return child.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored signal %d for %.0fs: killing it", child.name,
                            child.pid, sig, timeout)
                child.proc.kill()
        return child.proc.wait(10)
    finally:
        child.close_fds()
