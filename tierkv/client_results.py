"""What a `tierkv.client.Client` call returns, and the errors it raises: plain
records that the client, its `Batch` and the engines reading them share, kept apart
from the socket code so that a reader of the results needs none of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.core.keys import OffloadEvent
from tierkv.wire.protocol import TransferResult

JobResult = TransferResult


@dataclass(slots=True)  # not frozen: an engine step builds hundreds of them
class Lookup:
    hits: int  # leading keys ready in the CPU tier (leased to the request, if named)
    pending: bool  # ask again next step: promotions are on their way (or see retry)
    retry: bool = False  # nothing could start now (no CPU room, existence unknown)
    statuses: list[str] | None = None  # per key, when asked: miss, hit, pending, retry
    sources: list[str | None] | None = None  # per key: the tier a hit was promoted from
    rows: list[int] | None = None  # per key, when pinned: the hit's CPU block id, else -1
    region: str = ""  # when pinned: the CPU region the rows name (`SharedRegion.generation`)
    pin_s: float = 0.0  # when pinned: how long the broker holds the pins (`broker.pin_s`)
    # Per tier: leading keys it holds that were not promoted, loading them being
    # expected to take longer than recomputing them (see `Client.recompute_rate`).
    slower: dict[str, int] | None = None
    # The reply's `OpsResult.arrivals`: while it does not move, a miss here stays one
    # (when it was said, not what was answered: not compared).
    arrivals: int = field(default=-1, compare=False)

    def __repr__(self) -> str:
        extra = "".join(f", {name}={getattr(self, name)!r}"
                        for name in ("retry", "statuses", "sources", "rows", "slower")
                        if getattr(self, name))
        return f"Lookup(hits={self.hits}, pending={self.pending}{extra})"


@dataclass(frozen=True, slots=True)
class Store:
    job_id: int | None  # None when no key needed storing, or the store was refused
    keys_accepted: list[bytes]
    refused: bool = False  # no room could be made (blocks busy): try again later


@dataclass(frozen=True, slots=True)
class Load:
    job_id: int
    # Of the loaded keys, how many a promotion brought from each secondary tier
    # (counted once per promoted block, at its first load); the rest were CPU hits.
    sources: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reserve:
    """CPU blocks to write for the keys, co-indexed (-1: nothing to write, the key is
    present or not admitted); `ok` False: no room now, nothing was reserved."""

    block_ids: list[int]
    ok: bool
    evicted: list[bytes] = field(default_factory=list)
    region: str = ""  # the CPU region the ids name (`SharedRegion.generation`)


@dataclass(frozen=True, slots=True)
class Step:
    finished: list[JobResult]
    events: list[OffloadEvent]
    step: int = 0
    # Keys of this client's events the broker dropped since the last step or poll
    # (a client that steps seldom: its queue is bounded, the oldest go first). Not 0:
    # `events` has holes, and a view of the tiers built from them is incomplete.
    events_dropped: int = 0


# The names DESIGN's public API used before protocol v2.
LookupResult, StoreResult, LoadResult, StepResult = Lookup, Store, Load, Step


class BrokerUnavailable(ConnectionError):
    """No reply from the broker within the call's timeout."""


class RemoteError(RuntimeError):
    """The broker refused a request."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
