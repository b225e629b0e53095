"""Process lifetimes: the readiness handshake and the parent-death pipe.

A parent (the supervisor, or a test fixture) starts each child with two pipes:
- a ready pipe: the child writes one line when it is serving, so the parent can
  wait for readiness and for the child's exit together and fail fast on a crash;
- a lifeline: the parent holds the write end; when the parent dies, for any
  reason, the child reads EOF and stops by itself. No orphans;
- a secret pipe, when the parent has secrets for the child (a peer's token, the
  local S3 endpoint's key pair): written and closed by the parent before the child
  runs, read once by the child at start. Not the environment: a process's
  environment stays readable in /proc/<pid>/environ for its whole life (to every
  process of its user) and is inherited by its own children; not argv, which every
  user can read. Once read the pipe is gone, and nothing of the secret is left
  anywhere but in the child's memory.
The fds travel in environment variables, so the same child runs by hand without
them.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.node.logs import read_lines

#: The folder that holds `tierkv/`, `broker/` and `workers/` (a checkout, or site-packages).
SOURCE_ROOT = Path(__file__).resolve().parents[2]
READY_FD_ENV = "TIERKV_READY_FD"
LIFELINE_FD_ENV = "TIERKV_LIFELINE_FD"
SECRETS_FD_ENV = "TIERKV_SECRETS_FD"
SECRETS_MAX_BYTES = 16384  # far below a pipe's buffer: the parent's write never blocks
SECRETS_WAIT_S = 10.0  # a child waits this long at most for its parent to hand them over

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


_secrets: dict[str, str] | None = None


def take_secrets() -> dict[str, str]:
    """The secrets the parent handed this process (empty when started by hand, or
    by a parent that had none). The pipe is read once, at the first call, and
    closed; later calls return the same map."""
    global _secrets
    if _secrets is None:
        _secrets = _read_secrets(os.environ.pop(SECRETS_FD_ENV, None))
    return dict(_secrets)


def _read_secrets(fd_text: str | None) -> dict[str, str]:
    """Read the secret pipe to its end. Only a pipe is read (a stale variable naming
    some other fd, a terminal say, is ignored), and only for SECRETS_WAIT_S: the
    parent writes right after it recorded the child, and closes."""
    if fd_text is None:
        return {}
    try:
        fd = int(fd_text)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return {}
    except (ValueError, OSError):
        return {}
    chunks: list[bytes] = []
    deadline = time.monotonic() + SECRETS_WAIT_S
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                return {}  # the parent never finished: no secrets rather than a hang
            chunk = os.read(fd, SECRETS_MAX_BYTES)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError:
        return {}
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        secrets = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return {}
    if not isinstance(secrets, dict):
        return {}
    return {str(k): str(v) for k, v in secrets.items()}


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


# Set for every child of a supervisor: it shares the broker's pid namespace.
SUPERVISED_ENV = "TIERKV_SUPERVISED"


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child that must import this very tierkv,
    also when it runs from a checkout rather than an installed package."""
    env = dict(os.environ)
    env[SUPERVISED_ENV] = "1"
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
    secrets: Mapping[str, str] | None = None,
    on_started: Callable[[int], None] | None = None,
) -> Child:
    """Start a child with a ready pipe and a lifeline; its output is kept (and
    echoed to our stderr if `echo`, and handed line by line to `sink`: the node's
    log). Each line is cut to `tierkv.node.logs.LINE_BYTES`. `secrets` reach the
    child over a pipe (`take_secrets`), never its environment or command line;
    `on_started(pid)` runs before they are written, so whatever it records about the
    child (the supervisor's registry) exists before the child can present them."""
    data = json.dumps(dict(secrets)).encode() if secrets else b""
    if len(data) > SECRETS_MAX_BYTES:
        raise ValueError(f"secrets of {len(data)} bytes: at most {SECRETS_MAX_BYTES}")
    ready_r, ready_w = os.pipe()
    life_r, life_w = os.pipe()
    os.set_inheritable(ready_w, True)
    os.set_inheritable(life_r, True)
    child_env = dict(os.environ if env is None else env)
    child_env.pop(SECRETS_FD_ENV, None)  # never an fd of ours that the child lacks
    child_env[READY_FD_ENV] = str(ready_w)
    child_env[LIFELINE_FD_ENV] = str(life_r)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    passed = [ready_w, life_r]
    secrets_w: int | None = None
    if data:
        secrets_r, secrets_w = os.pipe()
        os.set_inheritable(secrets_r, True)
        passed.append(secrets_r)
        child_env[SECRETS_FD_ENV] = str(secrets_r)
    try:
        proc = subprocess.Popen(
            list(argv), env=child_env, pass_fds=tuple(passed),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a ^C to the parent's group reaches the parent only
        )
    except BaseException:
        if secrets_w is not None:
            os.close(secrets_w)
        raise
    finally:
        for fd in passed:
            os.close(fd)
    try:
        if on_started is not None:
            on_started(proc.pid)
        if secrets_w is not None:
            os.write(secrets_w, data)  # fits the pipe's buffer: never blocks
    except BaseException:
        proc.kill()  # nobody would own it
        proc.wait()
        for fd in (ready_r, life_w):
            os.close(fd)
        raise
    finally:
        if secrets_w is not None:
            os.close(secrets_w)  # the child reads to EOF: an early close hands it nothing
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


def stop(child: Child, timeout: float = 10.0, sig: int | None = 15) -> int | None:
    """SIGTERM (or `sig`; None: the caller sent it already), wait, then SIGKILL.
    Returns the exit code. Never signals twice: Python restores the default handler
    as it exits, so a second SIGTERM there kills a process that was stopping cleanly."""
    try:
        if child.proc.poll() is None:
            try:
                if sig is not None:
                    child.proc.send_signal(sig)
                return child.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored signal %d for %.0fs: killing it", child.name,
                            child.pid, signal.SIGTERM if sig is None else sig, timeout)
                child.proc.kill()
        return child.proc.wait(10)
    finally:
        child.close_fds()
