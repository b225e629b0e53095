"""The control plane's answers ahead of a busy host's other work (`realtime_priority`).

On a host whose cores are all busy (an engine's tokenizers, a data loader), the
fair scheduler may put each thread a round trip wakes (the client's libzmq I/O
thread, the broker's, the broker's loop, the waiting caller) behind running
processes for a time slice: with 4 busy processes on 2 cores a 0.15 ms lookup had
a p99 of 5 to 8 ms. Nice values barely help under EEVDF (-15 on every thread: p99
still 6 to 16x p50); the real-time class does.

The broker puts all of its threads in the class for its whole life (they sleep
until a message comes). A client gives its socket a libzmq context of its own,
whose threads are in the class, and lifts the calling thread only while it waits,
so an engine's own work never runs above the host's. Going back to its class, the
caller may then wait for the busy processes' turn (p99 15x p50 in `tierkv bench
control`); an engine whose thread is in the class throughout (`chrt -r 1`) is left
as it is, and gets 2 to 3x. Every change sets SCHED_RESET_ON_FORK: nothing started
from a lifted thread inherits the class. A process not allowed the class (it needs
CAP_SYS_NICE or an `RLIMIT_RTPRIO`, `ulimit -r`, of at least the priority) says so
once and runs as before.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from types import TracebackType

import zmq

log = logging.getLogger(__name__)

MAX_PRIORITY = 99
_RT_POLICIES = (os.SCHED_FIFO, os.SCHED_RR)


def check_priority(priority: int) -> str | None:
    """Why `priority` is not a valid setting, or None."""
    if isinstance(priority, bool) or not isinstance(priority, int) \
            or not 0 <= priority <= MAX_PRIORITY:
        return f"must be an integer 0..{MAX_PRIORITY} (0: normal scheduling), got {priority!r}"
    return None


_SAID: set[str] = set()  # who was refused: said once per process


def _refused(who: str, priority: int, error: OSError) -> None:
    if who in _SAID:
        return
    _SAID.add(who)
    log.warning("%s: realtime_priority %d asked, but this process may not use SCHED_RR "
                "(%s; it needs CAP_SYS_NICE or `ulimit -r` of at least %d): normal "
                "scheduling", who, priority, error.strerror, priority)


def enter_realtime(priority: int, who: str) -> bool:
    """Put every thread of this process in SCHED_RR at `priority` (0: leave them),
    but for those already in a real-time class (libzmq's, started so by
    `lift_context`); threads started later are not (reset-on-fork reaches threads
    too). False, logged once, where the process may not."""
    if priority <= 0:
        return False
    param = os.sched_param(priority)
    try:
        for tid in sorted(_threads()):
            try:
                if _policy(tid) not in _RT_POLICIES:
                    _lift(tid, param)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    except OSError as e:
        _refused(who, priority, e)
        return False
    return True


def lift_context(ctx: zmq.Context, priority: int, who: str) -> bool:
    """Have libzmq start `ctx`'s I/O and reaper threads in SCHED_RR at `priority`: set
    before its first socket starts them. Only where the process may (libzmq aborts
    when it cannot apply them); False, logged once, where not."""
    if priority <= 0:
        return False
    if not allowed(priority):
        _refused(who, priority, PermissionError(errno.EPERM, os.strerror(errno.EPERM)))
        return False
    ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_RR)
    ctx.set(zmq.THREAD_PRIORITY, priority)
    return True


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _policy(tid: int) -> int:
    """The thread's scheduling class, without the reset-on-fork flag."""
    return os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK


def _lift(tid: int, param: os.sched_param) -> None:
    os.sched_setscheduler(tid, os.SCHED_RR | os.SCHED_RESET_ON_FORK, param)


class WaitBoost:
    """`with boost:` around a wait for the broker: the waiting thread is in SCHED_RR
    at `priority` for the wait and back in its own class after. A thread already in a
    real-time class is left as it is. Costs three system calls a wait; nothing at 0.
    Start no thread inside: it would get the reset-on-fork class with the lifted
    thread's priority as glibc records it, which libzmq's threads fail to apply
    (an abort in `thread.cpp`)."""

    def __init__(self, priority: int, who: str = "client") -> None:
        self.priority = priority
        self.who = who
        self._param = os.sched_param(priority)
        self._lifted = threading.local()

    def __enter__(self) -> None:
        lifted = self._stack()
        if self.priority <= 0:
            lifted.append(None)
            return
        policy = _policy(0)
        if policy in _RT_POLICIES:  # already there (lifted by an outer wait, or its own)
            lifted.append(None)
            return
        try:
            _lift(0, self._param)
        except OSError as e:
            _refused(self.who, self.priority, e)
            self.priority = 0
            lifted.append(None)
            return
        lifted.append(policy)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        policy = self._stack().pop()
        if policy is not None:
            os.sched_setscheduler(0, policy, os.sched_param(0))

    def _stack(self) -> list[int | None]:
        """Per thread, per open wait: the class to go back to (None: nothing to undo)."""
        stack: list[int | None] | None = getattr(self._lifted, "stack", None)
        if stack is None:
            stack = self._lifted.stack = []
        return stack


def allowed(priority: int) -> bool:
    """Whether this process may put a thread in SCHED_RR at `priority` (tried on a
    thread of its own that ends at once)."""
    result: list[bool] = []

    def attempt() -> None:
        try:
            _lift(0, os.sched_param(priority))
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=attempt, name="tierkv-realtime-probe")
    thread.start()
    thread.join(5.0)
    return bool(result and result[0])
