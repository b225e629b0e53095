"""The manager's round trips to the broker, within the scheduler step's budget.

Every round trip carries what the engine owes the broker first (`holdings.py`), then
its own business: lookups, at most one reserve (a store's, or at the step's end the
spare rows' of `spares.py`), and at the step's end the step; a new request's lookups
(`prefetch`) go alone, owing nothing, so they never wait for what is owed. The
manager waits for one only as long as the step's budget has left (`wait`); one it
gave up is settled when it comes back (`catch_up`, on the scheduler thread): its
owed operations confirmed or owed again, its lookups' pins released, its reserved
rows aborted. One that gets no reply within `timeout_s` marks the broker down for
`retry_s`. A reply from another broker than the spare rows' (a restart: its region is
new) voids them; a commit of spare rows refused `not_owner` or `stale_region` (they
were reserved at a broker that is gone) voids the others too, and the blocks written
into them are no longer known present, so a later offer stores them again.

Runs on the scheduler thread, under the manager's lock.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

from tierkv.client import Batch, BrokerUnavailable, Client, RemoteError
from tierkv.core.errors import ErrorCode
from tierkv.core.loglimit import RateLimitedLog
from tierkv.vllm.holdings import Holdings, Owed
from tierkv.vllm.link import BrokerLink, Call
from tierkv.vllm.spares import SpareRows

log = logging.getLogger("tierkv.vllm")


class Metrics:
    """Names of what the manager reports (declared by `TierkvOffloadingSpec`)."""

    LOOKUP_KEYS = "vllm:tierkv_lookup_keys"
    HIT_KEYS = "vllm:tierkv_hit_keys"
    STORED_BLOCKS = "vllm:tierkv_stored_blocks"
    REFUSED_BLOCKS = "vllm:tierkv_store_refused_blocks"
    DROPPED_BLOCKS = "vllm:tierkv_store_dropped_blocks"
    ROUND_TRIPS = "vllm:tierkv_round_trips"
    ROUND_TRIP_SECONDS = "vllm:tierkv_round_trip_seconds"
    BROKER_FAILURES = "vllm:tierkv_broker_failures"
    OVER_BUDGET = "vllm:tierkv_over_budget_calls"


@dataclass(slots=True)
class Carried:
    """What a call's batch holds, in result order: owed operations, lookups (request,
    chunks, the last step their answers serve), at most one reserve, the step."""

    owed: Owed
    owed_slots: int
    generation: int
    lookups: list[tuple[str, list[bytes], int]] = field(default_factory=list)
    reserve: list[bytes] | None = None  # the tierkv keys a reserve asked for
    step: bool = False
    spares: list[bytes] = field(default_factory=list)  # spare keys reserved (`spares.py`)
    new_spares: int = 0  # of which new (the rest renewed)
    spares_slot: int = -1  # their reserve's result slot
    opened: float = field(default_factory=time.monotonic)  # before the broker saw it


TakeLookups = Callable[[Carried, Sequence[Any] | None, bool], None]
# A commit of spare rows refused so: they were reserved at a broker that is gone.
VOID_SPARES = frozenset({ErrorCode.NOT_OWNER.value, ErrorCode.STALE_REGION.value})


class Rounds:
    """Round trips of one manager: its link, what it holds and owes, its budget."""

    def __init__(self, client: Client, budget_ms: float, retry_s: float,
                 take_lookups: TakeLookups, take_step: Callable[[Any], None],
                 spare_rows: int = 0,
                 not_stored: Callable[[list[bytes]], None] = lambda keys: None) -> None:
        self.link = BrokerLink(client)
        self.holdings = Holdings()
        self.spares = SpareRows(spare_rows)
        self.stats = OffloadingConnectorStats()
        self.flush: Call | None = None  # the end-of-step round trip, until applied
        self.prefetches: deque[Call] = deque()  # lookups of new requests, until applied
        self.budget_ms = budget_ms
        self.retry_s = retry_s
        self._take_lookups = take_lookups
        self._take_step = take_step
        self._not_stored = not_stored  # keys a refused commit did not store
        self._budget_s = budget_ms / 1e3
        self._down_until = 0.0
        self._warn = RateLimitedLog(log)

    # -- the budget ------------------------------------------------------------------------

    def new_step(self) -> None:
        self._budget_s = self.budget_ms / 1e3

    @property
    def budget_left(self) -> bool:
        return self._budget_s > 0

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def can_wait(self) -> bool:
        """A round trip of its own could be waited for now."""
        return self._budget_s > 0 and not self.down

    # -- calls ---------------------------------------------------------------------------

    def open(self, generation: int, step: bool = False,
             owed: bool = True) -> tuple[Batch, Carried]:
        """A batch that first carries everything owed (unless not `owed`: a batch of
        lookups only, which may share a round trip with others)."""
        batch = self.link.batch()
        if not owed:
            return batch, Carried(Owed(), 0, generation)
        taken = self.holdings.take()
        return batch, Carried(taken, taken.add_to(batch), generation, step=step)

    def prefetch(self, made: tuple[Batch, Carried]) -> Call:
        """Send lookups nobody waits for yet (see `catch_up`)."""
        batch, carried = made
        call = self.link.send(batch, carried)
        self.prefetches.append(call)
        return call

    def add_spares(self, batch: Batch, carried: Carried) -> None:
        """Reserve spare rows in `batch` (renewals and the demand's new ones), and
        let go of those beyond the demand."""
        spares = self.spares
        let_go = spares.surplus() + spares.take_stale()
        if let_go:
            self.holdings.commit(let_go, False)
        keys, new = spares.to_reserve(spares.now())
        if keys:
            carried.spares, carried.new_spares, carried.spares_slot = keys, new, len(batch)
            batch.reserve(keys)

    def send(self, made: tuple[Batch, Carried]) -> Call:
        batch, carried = made
        if carried.step:
            batch.step()
        return self.link.send(batch, carried)

    def wait(self, call: Call, abandon: bool = True) -> bool:
        """Wait for `call` within the step's budget; False if it is still out (then
        abandoned, unless `abandon` is False)."""
        start = time.perf_counter()
        done = call.wait(max(self._budget_s, 0.0))
        self._budget_s -= time.perf_counter() - start
        if done or not abandon:
            return done
        if call.abandon():
            self.stats.increase_counter(Metrics.OVER_BUDGET)
            return False
        return True

    def catch_up(self) -> None:
        """Take the end-of-step round trip's answers if they came, and settle calls
        that came back after nobody waited for them."""
        self.link.pump()
        prefetches = self.prefetches
        while prefetches and prefetches[0].done:
            self.apply(prefetches.popleft())
        if self.flush is not None and self.flush.done:
            call, self.flush = self.flush, None
            self.apply(call)
        for call in self.link.take_late():
            self.apply(call, told=False)

    def apply(self, call: Call, told: bool = True) -> None:
        """A call ended: settle what it carried (`told` False: the step that sent it
        went on without it, so its answers and reservations are let go)."""
        carried: Carried = call.carried
        results = call.results
        self.spares.new_region(self.link.region)
        if call.error is not None:
            lost = isinstance(call.error, BrokerUnavailable)
            self._failed(call.error)
            self.holdings.settle(carried.owed, None if lost
                                 else [call.error] * carried.owed_slots)
            if carried.reserve is not None and lost:
                self.holdings.lost_reservations(carried.reserve)
            if carried.spares:
                self.spares.reserved(carried.spares, carried.new_spares, None, "",
                                     self.spares.now())
                if lost:
                    self.holdings.lost_reservations(carried.spares[len(carried.spares)
                                                                   - carried.new_spares:])
            self._take_lookups(carried, None, False)
            return
        assert results is not None
        self.stats.increase_counter(Metrics.ROUND_TRIPS)
        self.stats.observe_histogram(Metrics.ROUND_TRIP_SECONDS,
                                     time.monotonic() - call.sent_at)
        self._void_spares(carried.owed, results)
        self.holdings.settle(carried.owed, results[:carried.owed_slots])
        self._take_lookups(carried, results, told)
        if carried.reserve is not None and not told:
            reply = results[-1]
            if not isinstance(reply, RemoteError) and reply.ok:
                self.holdings.given_up(k for k, r in zip(carried.reserve, reply.block_ids,
                                                         strict=True) if r >= 0)
        if carried.spares:
            self._take_spares(carried, results[carried.spares_slot])
        if carried.step:
            self._take_step(results[-1])

    def _void_spares(self, owed: Owed, results: Sequence[Any]) -> None:
        """Commits of spare rows the broker does not hold (`VOID_SPARES`): those
        blocks were not stored, and the other spares, as old, are let go of (those of
        a broker that is gone were forgotten already: `SpareRows.new_region`), so the
        next stores reserve fresh rows."""
        at = len(owed.commits)
        for group, result in zip(owed.commits_as, results[at:], strict=False):
            if (isinstance(result, RemoteError) and result.code in VOID_SPARES
                    and not group.again):  # (one sent again: its first try may have done it)
                self.holdings.commit(self.spares.drop_all(), False)
                self._not_stored(group.written_as)

    def _take_spares(self, carried: Carried, reply: Any) -> None:
        refused = isinstance(reply, RemoteError) or not reply.ok
        if isinstance(reply, RemoteError) and reply.code != "quota":
            self._warn.warning("spares", "tierkv refused spare rows: %s", reply)
        self.spares.reserved(carried.spares, carried.new_spares,
                             None if refused else reply.block_ids,
                             "" if refused else reply.region, self.spares.now())

    def finish(self, generation: int, timeout_s: float) -> None:
        """Send what is owed and wait for it (shutdown: no step budget), then close
        the connection, which tells the broker this engine is gone."""
        if self.flush is not None:
            self.flush.wait(timeout_s)
        for call in self.prefetches:
            call.wait(timeout_s)
        self.catch_up()
        if self.holdings.owed:
            call = self.send(self.open(generation))
            if call.wait(timeout_s):
                self.apply(call)
            else:
                log.warning("tierkv: the broker did not answer at shutdown; it lets go of "
                            "what this engine held when the connection closes")
        self.link.close()

    def _failed(self, error: Exception) -> None:
        self.stats.increase_counter(Metrics.BROKER_FAILURES)
        if isinstance(error, BrokerUnavailable):
            self._down_until = time.monotonic() + self.retry_s
            self._warn.warning("broker", "tierkv broker unavailable (%s): no hits and no "
                               "stores for %.0fs", error, self.retry_s)
        else:
            self._warn.warning("refused", "tierkv refused a round trip: %s", error)
