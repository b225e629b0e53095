"""Runs tier jobs against a backend: the data path shared by the tier process and
the in-process `LocalTier`.

Each job is split into tasks: a task per key, or, for stores and loads, a run of
as many consecutive keys as the backend asks for (`TierBackend.batch_keys`: a disk
moves a run of adjacent slots in one request). With `threads > 0` the tasks run on
a pool of worker threads (blocking I/O such as `pwrite`/`preadv` and HTTP releases
the GIL), loads before stores before existence checks, so a promotion a request is
waiting for is not stuck behind a cascade nobody waits for. With `threads == 0`
a job runs synchronously inside `submit` (deterministic tests).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.keys import OffloadKey
from tierkv.tiers.backend import TierBackend
from tierkv.tiers.base import BlockRows, Job, JobKind, JobResult
from tierkv.wire.wakeup import Wakeup

log = logging.getLogger("tierkv.tiers.runner")

# Lower runs first: a request waits on promotions and existence checks, nobody on a
# cascade store or a delete.
_PRIORITY = {JobKind.PROMOTION: 0, JobKind.EXISTS: 0, JobKind.STORE: 1, JobKind.DELETE: 2}


@dataclass(eq=False)
class _JobState:
    job: Job
    remaining: int
    deadline: float = 0.0  # time.monotonic(); 0: none
    started: float = field(default_factory=time.perf_counter)
    ok: list[bool] = field(default_factory=list)
    bytes_moved: int = 0
    error_code: ErrorCode | None = None
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.ok = [False] * len(self.job.keys)


class JobRunner:
    def __init__(self, backend: TierBackend, rows: BlockRows | None, threads: int = 0,
                 wakeup: Wakeup | None = None) -> None:
        self.backend = backend
        self.rows = rows
        self.threads = threads
        self.wakeup = wakeup  # notified whenever a result is ready
        self._done: deque[JobResult] = deque()
        # (priority, order, job, first key, end key); a None job stops a worker
        self._tasks: queue.PriorityQueue[tuple[int, int, _JobState | None, int, int]] = (
            queue.PriorityQueue()
        )
        self._seq = itertools.count()
        self._in_flight = 0
        self._idle = threading.Condition()
        self._workers = [
            threading.Thread(target=self._work, name=f"tier-io-{i}", daemon=True)
            for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, job: Job, deadline: float = 0.0) -> None:
        """Queue `job`. A key not started by `deadline` (time.monotonic()) fails with
        `timeout` instead of running: behind a long queue the broker would rather
        hear "too late" than wait, and fence a live process, for work nobody awaits."""
        if job.kind in (JobKind.STORE, JobKind.PROMOTION) and len(job.block_ids) != len(job.keys):
            raise ValueError(
                f"job {job.job_id}: {len(job.keys)} keys but {len(job.block_ids)} block ids"
            )
        state = _JobState(job, remaining=len(job.keys), deadline=deadline)
        if not job.keys:
            self._finish(self._result(state))
            return
        with self._idle:
            self._in_flight += 1
        step = self._run_length(job)
        if not self._workers:
            for i in range(0, len(job.keys), step):
                self._run_task(state, i, min(len(job.keys), i + step))
            return
        prio = _PRIORITY[job.kind]
        for i in range(0, len(job.keys), step):
            self._tasks.put((prio, next(self._seq), state, i, min(len(job.keys), i + step)))

    def _run_length(self, job: Job) -> int:
        """Keys per task: for stores and loads at most the backend's run, the job
        split in even parts (32 keys in runs of 31 would be 16 + 16, not 31 + 1)."""
        if job.kind not in (JobKind.STORE, JobKind.PROMOTION) or self.rows is None:
            return 1
        most = max(1, self.backend.batch_keys(self.rows.block_bytes))
        parts = -(-len(job.keys) // most)
        return -(-len(job.keys) // parts)

    def report(self, result: JobResult) -> None:
        """A result decided without running the job (refused, too late)."""
        self._finish(result)

    def _finish(self, result: JobResult) -> None:
        self._done.append(result)
        if self.wakeup is not None:
            self.wakeup.notify()

    def take_finished(self) -> list[JobResult]:
        results = []
        while self._done:
            results.append(self._done.popleft())
        return results

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        for _ in self._workers:
            self._tasks.put((99, next(self._seq), None, 0, 0))
        for worker in self._workers:
            worker.join(timeout=10)
        self._workers = []

    # -- worker side -----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            _, _, state, start, end = self._tasks.get()
            if state is None:
                return
            self._run_task(state, start, end)

    def _run_task(self, state: _JobState, start: int, end: int) -> None:
        """Keys `start:end` of a job; the one that runs its last key reports it."""
        job = state.job
        outcomes: list[tuple[bool, ErrorCode | None, str]]
        moved = 0
        try:
            if state.deadline and time.monotonic() > state.deadline:
                raise TierError(ErrorCode.TIMEOUT, "deadline passed before this key started")
            if end - start == 1:
                moved = self._run_key(job, start, job.keys[start])
                outcomes = [(True, None, "")]
            else:
                outcomes, moved = self._run_many(job, start, end)
        except TierError as e:
            outcomes = [(False, e.code, e.message)] * (end - start)
        except Exception as e:  # a backend bug must not kill the worker thread
            log.exception("backend %s failed on key %s", self.backend.type_name,
                          job.keys[start].hex())
            outcomes = [(False, ErrorCode.FATAL, f"{type(e).__name__} in backend")] * (end - start)
        with state.lock:
            for i, (ok, code, message) in enumerate(outcomes, start):
                state.ok[i] = ok
                if not ok and state.error_code is None:
                    state.error_code, state.error = code, message
            state.bytes_moved += moved
            state.remaining -= end - start
            last = state.remaining == 0
        if last:
            if job.kind is JobKind.STORE and any(state.ok):
                self._sync(state)
            self._finish(self._result(state))
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def _run_many(self, job: Job, start: int, end: int
                  ) -> tuple[list[tuple[bool, ErrorCode | None, str]], int]:
        """A run of a store or load job in one backend call."""
        keys = job.keys[start:end]
        views = [self._row(b) for b in job.block_ids[start:end]]
        if job.kind is JobKind.STORE:
            errors: Sequence[TierError | None] = self.backend.store_many(keys, views,
                                                                         pinned=job.keys)
        else:
            errors = self.backend.load_many(keys, views)
        if len(errors) != len(keys):
            raise TierError(ErrorCode.FATAL, f"backend {self.backend.type_name} answered "
                                             f"{len(errors)} of {len(keys)} keys")
        moved = sum(len(v) for v, e in zip(views, errors, strict=True) if e is None)
        return [(True, None, "") if e is None else (False, e.code, e.message)
                for e in errors], moved

    def _sync(self, state: _JobState) -> None:
        """The job's stores become durable together; if that fails none is reported."""
        try:
            self.backend.sync()
        except Exception as e:
            code = e.code if isinstance(e, TierError) else ErrorCode.FATAL
            log.error("backend %s could not make a store job durable: %s",
                      self.backend.type_name, e)
            state.ok = [False] * len(state.ok)
            state.error_code, state.error = code, f"sync failed: {e}"

    def _run_key(self, job: Job, index: int, key: OffloadKey) -> int:
        backend = self.backend
        if job.kind is JobKind.STORE:
            view = self._row(job.block_ids[index])
            backend.store(key, view, pinned=job.keys)
            return len(view)
        if job.kind is JobKind.PROMOTION:
            view = self._row(job.block_ids[index])
            backend.load(key, view)
            return len(view)
        if job.kind is JobKind.EXISTS:
            if not backend.exists(key):
                raise TierError(ErrorCode.NOT_FOUND, "absent")
            return 0
        backend.delete(key)
        return 0

    def _row(self, block_id: int) -> memoryview:
        if self.rows is None:
            raise TierError(ErrorCode.FATAL, "this runner has no CPU-tier rows")
        return self.rows.block(block_id)

    def _result(self, state: _JobState) -> JobResult:
        job = state.job
        ok_keys = tuple(k for k, ok in zip(job.keys, state.ok, strict=True) if ok)
        evicted = tuple(self.backend.take_evicted()) if job.kind is JobKind.STORE else ()
        success = len(ok_keys) == len(job.keys)
        if job.kind is JobKind.EXISTS:
            success = True  # a missing key is an answer, not a failure
        return JobResult(
            job_id=job.job_id,
            success=success,
            successful_keys=ok_keys,
            bytes_moved=state.bytes_moved,
            seconds=time.perf_counter() - state.started,
            error_code=None if success else state.error_code,
            error="" if success else state.error,
            evicted_keys=evicted,
        )
