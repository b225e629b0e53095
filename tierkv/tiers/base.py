"""The broker-side interface of one secondary tier, and the job types it runs.

A `SecondaryTier` is what the `TieringManager` talks to: an in-process tier
(`LocalTier`) or, in the service, the broker's proxy of remote tier processes.
Every method runs on the owner's single thread (the broker's poll loop) and must
never block: work is submitted, and results are collected once per step with
`get_finished`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierkv.core.errors import ErrorCode
from tierkv.core.keys import OffloadEvent, OffloadKey


class JobKind(enum.StrEnum):
    STORE = "store"  # CPU tier -> secondary tier (a cascade)
    PROMOTION = "promotion"  # secondary tier -> CPU tier
    EXISTS = "exists"  # does the tier hold these keys (shared tiers)?
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class Job:
    job_id: int
    keys: tuple[OffloadKey, ...]
    block_ids: tuple[int, ...]  # CPU-tier rows, co-indexed with keys (empty for exists/delete)
    kind: JobKind
    req_id: str | None = None


@dataclass(frozen=True, slots=True)
class JobResult:
    job_id: int
    success: bool  # every key succeeded
    successful_keys: tuple[OffloadKey, ...] = ()  # for partial results (and exists: present)
    bytes_moved: int = 0
    seconds: float = 0.0
    error_code: ErrorCode | None = None
    error: str = ""
    evicted_keys: tuple[OffloadKey, ...] = field(default=())  # the tier dropped these


class BlockRows(Protocol):
    """Zero-copy access to CPU-tier rows: `SharedRegion` or an in-memory stand-in."""

    @property
    def block_bytes(self) -> int: ...

    def block(self, block_id: int) -> memoryview: ...


class SecondaryTier(ABC):
    """One secondary tier as the broker's `TieringManager` sees it.

    Runs on the broker's single thread; no method may block.
    """

    name: str

    @abstractmethod
    def lookup(self, key: OffloadKey) -> bool | None:
        """True if the tier holds `key`, False if not, None if an existence check is
        under way (shared tiers ask asynchronously; ask again on a later step)."""

    def holds(self, key: OffloadKey) -> bool:
        """Known to hold `key` already (no existence check is started)."""
        return self.lookup(key) is True

    @abstractmethod
    def submit_store(self, job: Job) -> None:
        """Queue a copy of `job.block_ids` rows into the tier under `job.keys`."""

    @abstractmethod
    def submit_load(self, job: Job) -> None:
        """Queue a copy of `job.keys` from the tier into the `job.block_ids` rows."""

    @abstractmethod
    def get_finished(self) -> list[JobResult]:
        """Results of jobs that ended since the last call (each job exactly once)."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """The keys were used: move them up in the tier's own eviction order."""

    @abstractmethod
    def take_events(self) -> list[OffloadEvent]: ...

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def drain(self, timeout: float = 30.0) -> bool:
        """Let in-flight jobs finish (their results stay for `get_finished`).
        Returns False if `timeout` passed first. The only call that may wait."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop and release every view of the CPU-tier rows. Idempotent."""

    @property
    def in_flight(self) -> int:
        return 0

    @property
    def arrivals(self) -> int | None:
        """Keys the tier came to hold other than by the node's stores, counted since
        it started (`TierIndex.arrivals`); None when it cannot tell."""
        return None

    @property
    def store_backlog(self) -> int:
        """Keys submitted for storing whose results were not handed out yet."""
        return 0
