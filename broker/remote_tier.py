"""The broker's proxy of one secondary tier served by one or more tier processes.

To the `TieringManager` it is a `SecondaryTier` like any other. Underneath, jobs
wait in queues (promotions first: a request is waiting for them) and are sent at
the step's end to the tier processes that have credit: workers ask for work, so
the broker always knows who holds which job and nothing queues up for a dead
peer. Results arrive any time and are handed to the manager when it polls, once
per step.

When a tier process dies, its in-flight jobs fail (after the broker fenced it) and,
if it was the tier's last process, the tier leaves the index: lookups miss until a
process says hello again with its inventory.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from tierkv.core.errors import LOST, ErrorCode
from tierkv.core.keys import OffloadEvent, OffloadKey
from tierkv.tiers.base import Job, JobKind, JobResult, SecondaryTier
from tierkv.tiers.index import TierIndex
from tierkv.wire.protocol import Message, TierDoneBatch, TierHello, TierJobBatch

log = logging.getLogger("broker.tier")

Send = Callable[[bytes, Message], bool]
MAX_BATCH_JOBS = 256
EXISTS_BATCH_KEYS = 256


@dataclass(eq=False)
class _TierPeer:
    identity: bytes
    pid: int
    credit: int = 0
    reserve: int = 0  # credit that stores may not use: a quarter of the first grant
    ready: bool = False  # inventory received in full
    jobs: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _InFlight:
    identity: bytes
    job: Job
    deadline: float


class RemoteTier(SecondaryTier):
    def __init__(
        self,
        name: str,
        send: Send,
        clock: Callable[[], float],
        job_timeout_s: float = 30.0,
        negative_ttl_s: float = 2.0,
        fence_grace_s: float = 0.0,
    ) -> None:
        self.name = name
        self.type = "?"
        self._send = send
        self._clock = clock
        self.job_timeout_s = job_timeout_s
        self.fence_grace_s = fence_grace_s
        self.index = TierIndex(shared=False, negative_ttl=negative_ttl_s, clock=clock)
        self.capacity_bytes: int | None = None
        self._peers: dict[bytes, _TierPeer] = {}
        # A request waits on promotions and existence checks; nobody waits on a
        # cascade store. So they queue apart, and stores leave credit for them.
        self._urgent: deque[Job] = deque()  # promotions, existence checks
        self._others: deque[Job] = deque()  # stores and deletes
        self._in_flight: dict[int, _InFlight] = {}
        self._exists_ids = itertools.count(-1, -1)  # never a manager job id
        self._finished: list[JobResult] = []
        self._store_backlog = 0
        self._backend_stats: dict[bytes, dict[str, Any]] = {}
        self._failing_until: dict[bytes, float] = {}  # peer -> its breaker's cool-down end
        self._held: dict[bytes, list[tuple[Job, JobResult]]] = {}  # unfenced peer -> jobs
        self.failures: dict[str, int] = {}  # error code -> failed jobs
        self._events: list[OffloadEvent] = []
        self._counters: dict[str, float] = dict.fromkeys(
            ("jobs_sent", "jobs_failed", "stores", "stores_failed", "loads", "loads_failed",
             "bytes_stored", "bytes_loaded", "seconds_store", "seconds_load", "evictions",
             "exists_checks", "late_results", "peer_deaths", "corrupt_blocks"), 0
        )

    # -- SecondaryTier --------------------------------------------------------------

    @property
    def available(self) -> bool:
        return any(p.ready for p in self._peers.values())

    @property
    def failing(self) -> bool:
        """Every process of the tier reports its endpoint failing (an open circuit
        breaker, still cooling down): a promotion would fail at once, so its keys
        miss at once. After the cool-down a lookup may go through again: it is the
        trial request that closes the breaker."""
        now = self._clock()
        until = [self._failing_until.get(p.identity, 0.0) for p in self._peers.values()
                 if p.ready]
        return bool(until) and min(until) > now

    def lookup(self, key: OffloadKey) -> bool | None:
        if not self.available or self.failing:
            return False
        return self.index.lookup(key)

    def holds(self, key: OffloadKey) -> bool:
        return self.available and key in self.index.present

    def submit_store(self, job: Job) -> None:
        self._others.append(job)
        self._store_backlog += len(job.keys)

    @property
    def store_backlog(self) -> int:
        return self._store_backlog

    def submit_load(self, job: Job) -> None:
        self._urgent.append(job)

    def get_finished(self) -> list[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Recency in a remote tier is refreshed by its promotions; a touch that
        crossed a socket per engine step would cost more than it saves."""

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, Any]:
        return {
            "tier": self.name,
            "type": self.type,
            "blocks": len(self.index),
            "capacity_bytes": self.capacity_bytes,
            "processes": len(self._peers),
            "available": self.available,
            "failing": self.failing,
            "in_flight": len(self._in_flight),
            "held_jobs": self.held_jobs,
            "queued": len(self._urgent) + len(self._others),
            "checking": self.index.checking,
            **self._counters,
            "failures": dict(self.failures),
            "backend": [dict(s) for s in self._backend_stats.values()],
        }

    def drain(self, timeout: float = 30.0) -> bool:
        """Non-blocking here: the broker's loop keeps pumping until this is True."""
        return not self._in_flight and not self._urgent and not self._others

    def shutdown(self) -> None:
        self._urgent.clear()
        self._others.clear()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def arrivals(self) -> int | None:
        return self.index.arrivals

    # -- peers ---------------------------------------------------------------------

    def on_hello(self, identity: bytes, hello: TierHello) -> None:
        self.type = hello.type
        self.index.shared = hello.shared
        self.index.refreshed = hello.shared and hello.refresh_s > 0
        self.capacity_bytes = hello.capacity_bytes
        # Not ready for work until its whole inventory arrived (Inventory.last).
        self._peers[identity] = _TierPeer(identity, hello.pid)

    def on_inventory(self, identity: bytes, keys: list[bytes], last: bool) -> None:
        peer = self._peers.get(identity)
        if peer is None:
            return
        self.index.learn(keys)
        if last:
            peer.ready = True
            log.info("tier %s: process %d ready with %d blocks", self.name, peer.pid,
                     len(self.index))

    def on_credit(self, identity: bytes, credit: int) -> None:
        peer = self._peers.get(identity)
        if peer is not None:
            if not peer.reserve:
                peer.reserve = max(1, credit // 4)
            peer.credit += max(0, credit)

    def on_done(self, identity: bytes, batch: TierDoneBatch) -> None:
        peer = self._peers.get(identity)
        if peer is None:
            self._counters["late_results"] += len(batch.results)
            return
        peer.credit += max(0, batch.credit)
        for result in batch.results:
            entry = self._in_flight.get(result.job_id)
            if entry is None or entry.identity != identity:
                self._counters["late_results"] += 1  # late, forged, or someone else's
                continue
            del self._in_flight[result.job_id]
            peer.jobs.discard(result.job_id)
            self._complete(entry.job, result)

    def on_stats(self, identity: bytes, stats: dict[str, Any]) -> None:
        if identity in self._peers:
            self._backend_stats[identity] = stats
            capacity = stats.get("capacity_bytes")
            if isinstance(capacity, int) and capacity >= 0:  # a disk tier grows as space frees
                self.capacity_bytes = capacity
            retry_in = stats.get("breaker_retry_in_s")
            if stats.get("breaker") == "open" and isinstance(retry_in, (int, float)):
                self._failing_until[identity] = self._clock() + min(float(retry_in), 3600.0)
            else:
                self._failing_until.pop(identity, None)

    def peer_died(self, identity: bytes, reason: str, hold: bool = False) -> None:
        """The process is gone: its jobs fail. With `hold` (a silent process that
        could not be fenced) their results wait in `release_held`: the rows it reads
        or writes must not be reused while it may still touch them."""
        self._backend_stats.pop(identity, None)
        self._failing_until.pop(identity, None)
        peer = self._peers.pop(identity, None)
        if peer is None:
            return
        self._counters["peer_deaths"] += 1
        for job_id in list(peer.jobs):
            entry = self._in_flight.pop(job_id)
            result = JobResult(job_id, False, error_code=ErrorCode.UNAVAILABLE,
                               error=f"tier process {peer.pid} of {self.name} died: {reason}")
            if hold:
                self._held.setdefault(identity, []).append((entry.job, result))
            else:
                self._complete(entry.job, result)
        if not self._peers:
            # The tier leaves the index until a process comes back with its inventory.
            self.index.present.clear()
            for key in self.index.clear_pending_checks():
                self.index.checked((), [key])
            self._fail_queued(f"no process serves tier {self.name}")

    def release_held(self, identity: bytes) -> None:
        """The unfenced process is gone: its held jobs end now."""
        for job, result in self._held.pop(identity, ()):
            self._complete(job, result)

    @property
    def held_jobs(self) -> int:
        return sum(len(jobs) for jobs in self._held.values())

    def credit(self, gap: float) -> None:
        """The broker did not listen for `gap` seconds: its view of the deadlines moves
        with it (the tier process still fails a late job itself)."""
        self._in_flight = {job_id: replace(entry, deadline=entry.deadline + gap)
                           for job_id, entry in self._in_flight.items()}

    def overdue(self, now: float) -> set[bytes]:
        """Peers holding a job `fence_grace_s` past its deadline: hung, to be fenced.
        A live tier fails what it has not started by the deadline and reports it
        within the grace; only one stuck inside a job does not."""
        limit = now - self.fence_grace_s
        return {e.identity for e in self._in_flight.values() if limit > e.deadline}

    # -- dispatch (end of step) ---------------------------------------------------------

    def dispatch(self) -> None:
        """Send queued jobs and existence checks to processes with credit."""
        checks = self.index.take_checks()
        for i in range(0, len(checks), EXISTS_BATCH_KEYS):
            keys = tuple(checks[i : i + EXISTS_BATCH_KEYS])
            self._urgent.append(Job(next(self._exists_ids), keys, (), JobKind.EXISTS))
            self._counters["exists_checks"] += len(keys)
        if not self._peers:
            self._fail_queued(f"no process serves tier {self.name}")
            return
        peers = [p for p in self._peers.values() if p.ready and p.credit > 0]
        if not peers:
            return
        batches: dict[bytes, list[Job]] = {}
        now = self._clock()
        for queue, reserve in ((self._urgent, 0), (self._others, None)):
            while queue and peers:
                peer = max(peers, key=lambda p: p.credit)  # the least loaded
                if reserve is None and peer.credit <= peer.reserve:
                    break  # the rest of the credit is kept for urgent jobs
                job = queue.popleft()
                peer.credit -= 1
                peer.jobs.add(job.job_id)
                self._in_flight[job.job_id] = _InFlight(peer.identity, job,
                                                        now + self.job_timeout_s)
                batches.setdefault(peer.identity, []).append(job)
                if peer.credit <= 0:
                    peers.remove(peer)
        for identity, jobs in batches.items():
            for i in range(0, len(jobs), MAX_BATCH_JOBS):
                chunk = jobs[i : i + MAX_BATCH_JOBS]
                deadlines = [self._in_flight[j.job_id].deadline for j in chunk]
                if not self._send(identity, TierJobBatch(chunk, deadlines)):
                    self.peer_died(identity, "unreachable")
                    break
            self._counters["jobs_sent"] += len(jobs)

    # -- results -------------------------------------------------------------------

    def _complete(self, job: Job, result: JobResult) -> None:
        c = self._counters
        if result.evicted_keys:
            self.index.discard(result.evicted_keys)
            c["evictions"] += len(result.evicted_keys)
            self._events.append(OffloadEvent("removed", tuple(result.evicted_keys), self.name))
        if not result.success:
            c["jobs_failed"] += 1
            cause = result.error_code.value if result.error_code else "unknown"
            self.failures[cause] = self.failures.get(cause, 0) + 1
        if job.kind is JobKind.EXISTS:
            self.index.checked(result.successful_keys, job.keys)
            return
        if job.kind is JobKind.STORE:
            self._store_backlog -= len(job.keys)
            c["stores"] += len(result.successful_keys)
            c["stores_failed"] += len(job.keys) - len(result.successful_keys)
            c["bytes_stored"] += result.bytes_moved
            c["seconds_store"] += result.seconds
            if result.successful_keys:
                self.index.add(result.successful_keys)
                self._events.append(
                    OffloadEvent("stored", tuple(result.successful_keys), self.name)
                )
        elif job.kind is JobKind.PROMOTION:
            c["loads"] += len(result.successful_keys)
            c["bytes_loaded"] += result.bytes_moved
            c["seconds_load"] += result.seconds
            failed = set(job.keys) - set(result.successful_keys)
            c["loads_failed"] += len(failed)
            if result.error_code is ErrorCode.CORRUPT:
                c["corrupt_blocks"] += len(failed)
            if result.error_code in LOST:
                self.index.discard(failed)
        if job.kind is not JobKind.DELETE:
            self._finished.append(result)

    def _fail_queued(self, reason: str) -> None:
        for queue in (self._urgent, self._others):
            while queue:
                job = queue.popleft()
                self._complete(job, JobResult(job.job_id, False,
                                              error_code=ErrorCode.UNAVAILABLE, error=reason))
