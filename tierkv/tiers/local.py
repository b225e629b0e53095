"""A secondary tier that runs its backend inside the owner's process.

This is tierkv used as a library (as vLLM's in-process tiering is): the broker's
`TieringManager` can drive a `LocalTier` directly, and the orchestrator tests do.
In the service the same backend runs in a tier process instead, behind the
broker's proxy; both use `JobRunner` for the data path and `TierIndex` for what
the tier holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from tierkv.core.errors import LOST
from tierkv.core.keys import OffloadEvent, OffloadKey
from tierkv.tiers.backend import TierBackend
from tierkv.tiers.base import BlockRows, Job, JobKind, JobResult, SecondaryTier
from tierkv.tiers.index import TierIndex
from tierkv.tiers.runner import JobRunner


class LocalTier(SecondaryTier):
    def __init__(
        self,
        backend: TierBackend,
        rows: BlockRows,
        name: str | None = None,
        threads: int = 0,
        auto_complete: bool = True,
        negative_ttl: float = 2.0,
    ) -> None:
        if threads and not auto_complete:
            raise ValueError("auto_complete=False holds jobs for the caller; it needs threads=0")
        self.name = name or backend.type_name
        self.backend = backend
        self.auto_complete = auto_complete
        self._runner = JobRunner(backend, rows, threads=threads)
        self.index = TierIndex(shared=backend.shared, negative_ttl=negative_ttl)
        self.index.add(backend.inventory())
        self._held: list[Job] = []
        self._store_backlog = 0
        self._jobs: dict[int, Job] = {}
        self._exists_jobs: dict[int, tuple[OffloadKey, ...]] = {}
        self._exists_ids = itertools.count(-1, -1)  # negative: never a manager job id
        self._events: list[OffloadEvent] = []
        self._counters: dict[str, float] = dict.fromkeys(
            ("stores", "stores_failed", "loads", "loads_failed", "bytes_stored",
             "bytes_loaded", "seconds_store", "seconds_load", "evictions", "exists_checks"), 0
        )

    # -- SecondaryTier ---------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> bool | None:
        found = self.index.lookup(key)
        checks = self.index.take_checks()
        if checks:
            job = Job(next(self._exists_ids), tuple(checks), (), JobKind.EXISTS)
            self._exists_jobs[job.job_id] = job.keys
            self._counters["exists_checks"] += len(checks)
            self._runner.submit(job)
        return found

    def holds(self, key: OffloadKey) -> bool:
        return key in self.index.present

    def submit_store(self, job: Job) -> None:
        self._submit(job)

    def submit_load(self, job: Job) -> None:
        self._submit(job)

    def get_finished(self) -> list[JobResult]:
        finished = []
        for result in self._runner.take_finished():
            asked = self._exists_jobs.pop(result.job_id, None)
            if asked is not None:
                self.index.checked(result.successful_keys, asked)
                continue
            job = self._jobs.pop(result.job_id)
            if job.kind is JobKind.STORE:
                self._store_backlog -= len(job.keys)
            self._account(job, result)
            finished.append(result)
        return finished

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.backend.touch(keys)

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, Any]:
        return {
            "tier": self.name,
            "type": self.backend.type_name,
            "blocks": len(self.index),
            "in_flight": self.in_flight,
            "capacity_bytes": self.backend.capacity(),
            **self._counters,
            **self.backend.stats(),
        }

    def drain(self, timeout: float = 30.0) -> bool:
        self.complete_pending()
        return self._runner.drain(timeout)

    def shutdown(self) -> None:
        self._held.clear()
        self._runner.close()
        self._runner.rows = None  # drop views of the region before its map closes
        self.backend.close()

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    @property
    def arrivals(self) -> int | None:
        return self.index.arrivals

    @property
    def store_backlog(self) -> int:
        return self._store_backlog

    # -- test hook -----------------------------------------------------------------

    def complete_pending(self) -> int:
        """Run the jobs held back by `auto_complete=False`. Returns how many."""
        held, self._held = self._held, []
        for job in held:
            self._runner.submit(job)
        return len(held)

    # -- helpers -------------------------------------------------------------------

    def _submit(self, job: Job) -> None:
        self._jobs[job.job_id] = job
        if job.kind is JobKind.STORE:
            self._store_backlog += len(job.keys)
        if self.auto_complete:
            self._runner.submit(job)
        else:
            self._held.append(job)

    def _account(self, job: Job, result: JobResult) -> None:
        c = self._counters
        if result.evicted_keys:
            self.index.discard(result.evicted_keys)
            c["evictions"] += len(result.evicted_keys)
            self._events.append(OffloadEvent("removed", result.evicted_keys, self.name))
        if job.kind is JobKind.STORE:
            c["stores"] += len(result.successful_keys)
            c["stores_failed"] += len(job.keys) - len(result.successful_keys)
            c["bytes_stored"] += result.bytes_moved
            c["seconds_store"] += result.seconds
            if result.successful_keys:
                self.index.add(result.successful_keys)
                self._events.append(OffloadEvent("stored", result.successful_keys, self.name))
        elif job.kind is JobKind.PROMOTION:
            c["loads"] += len(result.successful_keys)
            c["bytes_loaded"] += result.bytes_moved
            c["seconds_load"] += result.seconds
            failed = set(job.keys) - set(result.successful_keys)
            c["loads_failed"] += len(failed)
            if result.error_code in LOST:
                self.index.discard(failed)
