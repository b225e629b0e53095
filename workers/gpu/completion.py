"""Waiting for copies to finish without polling: one thread per direction blocks on
the end marker of its oldest job, reports it, and wakes the worker's loop.

Why threads: querying CUDA events from the socket loop means waking it every
fraction of a millisecond while a job runs (a core at 100 % on a small machine),
or reporting late. A thread blocked in ``cudaEventSynchronize`` on an event made
with ``blocking=True`` sleeps in the driver until the GPU signals it (an event
without that flag may spin), releases the GIL while it waits, and costs nothing
while copies run. Jobs of one direction run in submission order on their
streams, so the oldest job of a direction always finishes first.

The markers are behind a two-method seam (`EndMarker`): CUDA events in the CUDA
backend, plain threading primitives in the CPU tests, which drive this module with
real threads. A marker that raises means a CUDA error, which is sticky for the
context: that job and every job queued or added later fails as "fatal" until the
worker restarts.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierkv.core.errors import ErrorCode
from tierkv.wire.protocol import TransferOutcome
from workers.gpu.jobs import DIRECTIONS, failed

log = logging.getLogger("tierkv.completion")


class EndMarker(Protocol):
    def synchronize(self) -> None:
        """Block until the job's work finished; raise RuntimeError on a device error."""


@dataclass
class PendingJob:
    job_id: int
    nbytes: int
    end: EndMarker
    device_seconds: Callable[[], float]  # called once `end` completed
    keep: list[Any] = field(default_factory=list)  # buffers alive until the job is done


class CompletionWaiter:
    """Jobs in flight per direction, and the threads that wait for them.

    `add`, `poll`, `wait_idle` and `close` are called from the worker's main thread;
    `notify` is called from the waiting threads each time a job finished.
    `bind_thread` runs first on each waiting thread (CUDA: make the worker's device
    current there, so no runtime call creates a context on another GPU)."""

    def __init__(self, name: str, notify: Callable[[], None],
                 bind_thread: Callable[[], None] = lambda: None) -> None:
        self._notify = notify
        self._bind = bind_thread
        self._cond = threading.Condition()
        self._queues: dict[str, deque[PendingJob]] = {d: deque() for d in DIRECTIONS}
        self._done: deque[TransferOutcome] = deque()
        self._stopping = False
        self.broken: str | None = None
        self._threads = [
            threading.Thread(target=self._run, args=(d,), name=f"{name}-{d}", daemon=True)
            for d in DIRECTIONS
        ]
        for t in self._threads:
            t.start()

    # -- main thread -----------------------------------------------------------------

    def add(self, direction: str, job: PendingJob) -> None:
        with self._cond:
            if self.broken is not None or self._stopping:
                self._done.append(failed(job.job_id, ErrorCode.FATAL,
                                         self.broken or "transfer engine closing"))
                self._notify()
                return
            self._queues[direction].append(job)
            self._cond.notify_all()

    def poll(self) -> list[TransferOutcome]:
        """Finished jobs, each once; never blocks."""
        with self._cond:
            out = list(self._done)
            self._done.clear()
        return out

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job is in flight (True) or `timeout` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not any(self._queues.values()), timeout)

    def fail_all(self, reason: str) -> None:
        """Every job in flight, and every later one, fails with `reason`."""
        with self._cond:
            self._fail_all_locked(reason)
        self._notify()

    def close(self, timeout: float) -> bool:
        """Wait up to `timeout` for the jobs in flight, fail what is left, stop the
        threads. True if everything finished in time."""
        finished = self.wait_idle(timeout)
        with self._cond:
            if not finished:
                self._fail_all_locked(f"copies did not finish within {timeout:.0f} s "
                                      "(transfer engine closing)")
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=max(0.1, timeout))
        return finished

    # -- waiting threads -----------------------------------------------------------

    def _run(self, direction: str) -> None:
        try:
            self._bind()
        except Exception as e:  # a device that cannot be made current: nothing works
            log.exception("completion thread for %s could not bind its device", direction)
            self.fail_all(f"completion thread: {type(e).__name__}: {e}")
        queue = self._queues[direction]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or bool(queue))
                if not queue:
                    return  # stopping, nothing left
                job = queue[0]
            try:
                job.end.synchronize()
                outcome = TransferOutcome(job_id=job.job_id, success=True,
                                          bytes_moved=job.nbytes,
                                          seconds=job.device_seconds())
            except RuntimeError as e:
                self.fail_all(f"CUDA error: {e}")
                continue
            with self._cond:
                if queue and queue[0] is job:  # fail_all may have taken it meanwhile
                    queue.popleft()
                    self._done.append(outcome)
                self._cond.notify_all()
            self._notify()

    def _fail_all_locked(self, reason: str) -> None:
        if self.broken is None:
            log.error("%s; failing every job until the worker restarts", reason)
            self.broken = reason
        for q in self._queues.values():
            while q:
                self._done.append(failed(q.popleft().job_id, ErrorCode.FATAL, reason))
        self._cond.notify_all()
