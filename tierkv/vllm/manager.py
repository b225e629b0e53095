"""vLLM's scheduler-side `OffloadingManager`, as a proxy to a tierkv node.

vLLM calls it on its scheduler thread, per key, for hundreds of requests a step,
and holds its `lock` across the step. What it may cost that thread is a *budget*
(`budget_ms` per step, shared by every call of the step): a call that needs the
broker waits for it at most as long as the step's budget has left, and otherwise
answers at once the way vLLM's own asynchronous lookups do (`rounds.py` and
`link.py` say what becomes of a round trip nobody waits for):

* **Lookups** (`lookups.py`): a request is looked up when vLLM adds it (`prefetch`,
  between steps), and again at each step's end while it waits in vLLM's queue (the
  first `prefetch_requests` of it; a preempted request goes back to its head), so
  the step that first scans it has fresh answers or waits once for them within the
  budget. Otherwise answered from what the broker said, else RETRY and asked at the
  end of the step, so the next step has the answer; a request told RETRY stays
  asked at each step's end until vLLM asks again (it asks a deferred request only
  once it has room for it, often steps later). The first
  `sync_lookups` requests of a step may get a round trip of their own (within the
  budget), answering the key asked and those the same scan asks next. A request
  told RETRY for want of an answer for `lookup_wait_ms`, or for blocks being written
  or promoted for `pending_wait_ms`, misses instead (vLLM computes). Every hit is
  pinned in the broker pass that found it, until vLLM loads it or for a few steps.
* **Stores**: `prepare_store` takes rows reserved ahead (`spares.py`: no round trip),
  or else reserves them in a round trip of its own (within the budget), and returns
  only the chunks this job will write: not the ones known present, not the ones this
  engine is writing already (another request's job), and None when the node has no
  room now or the budget is spent, so vLLM offers them again next step. A
  reservation is committed only by the job that made it, when vLLM says it stored
  (`complete_store`), and aborted if it failed.
* **The step's end** (`on_schedule_end`): one round trip that is not waited for,
  carrying what the step owes the broker (`holdings.py`: commits, releases, touches,
  finished requests) and its asked keys; its answers are taken at the next step.

`reset_cache` starts a new reset generation of the engine's namespace
(`identity.py`): nothing stored before it is this engine's hit again. It and
`shutdown` let go of everything this engine holds at the broker: reservations
aborted and pins released (those of copies still in flight at a reset once vLLM
says the workers are done with them, `on_reset_flushed`). A broker that does not
answer at all within `timeout_s` makes the manager answer MISS and store nothing for
`retry_s`; what it owes waits for the broker's return.

The manager is built from sides, one module each over one shared state
(`manager_state.py`, with `ManagerOptions`): lookups (`lookup_side.py`), loads
(`load_side.py`), stores (`store_side.py`), reset, fences and shutdown
(`reset_side.py`); requests and steps are here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from tierkv.client import RemoteError
from tierkv.vllm.load_side import LoadSide
from tierkv.vllm.lookup_side import LookupSide
from tierkv.vllm.lookups import NEVER, QUEUED_STEPS, asked_chains
from tierkv.vllm.manager_state import ManagerOptions
from tierkv.vllm.reset_side import ResetSide
from tierkv.vllm.rounds import Metrics
from tierkv.vllm.spares import WaitingStore
from tierkv.vllm.store_side import StoreSide
from tierkv.wire.protocol import MAX_GROUPS, MAX_STEP_KEYS

__all__ = ["ManagerOptions", "Metrics", "TierkvOffloadingManager"]

# Read over every request at each step's end: C-level getters, not generators.
_UNTIL, _ASKS = attrgetter("until"), attrgetter("asks")

FLUSH_KEYS = MAX_STEP_KEYS // 2  # asked keys per end-of-step round trip (the rest wait)
FLUSH_GROUPS = MAX_GROUPS // 2
IDLE_WAIT_S = 0.01  # an idle engine waiting on a slow broker asks again this often
IDLE_STALL_S = 5.0  # and for this long: past it the broker hangs (its supervisor's matter)


class TierkvOffloadingManager(LookupSide, LoadSide, StoreSide, ResetSide):
    """See the module docstring. One per vLLM scheduler; vLLM holds `lock` around
    every call but `shutdown`."""

    # -- requests and steps ----------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        context = self.tiers.context_of(req_context)
        if context is not None:
            self.holdings.context(context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # vLLM offered the request's last store before this (`_build_store_jobs`).
        waiting = self._waiting.ended(req_context.req_id)
        if waiting is not None:
            self._dropped(req_context.req_id, waiting)
        self._queued.pop(req_context.req_id, None)
        state = self._requests.pop(req_context.req_id, None)
        if state is not None:
            self._unpin(state, list(state.rows))
        self.holdings.finish(req_context.req_id)

    def _dropped(self, req_id: str, waiting: WaitingStore) -> None:
        """A request ended before its store found rows: its blocks are not stored."""
        self.rounds.stats.increase_counter(Metrics.DROPPED_BLOCKS, waiting.blocks)
        self._warn.warning("dropped", "tierkv: request %s ended before its store found rows "
                           "(%s): %d blocks not stored", req_id, waiting.why, waiting.blocks)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.rounds.catch_up()
        step = self._step
        self._requeue(context.preempted_req_ids)
        head = self._queue_head()
        now = time.monotonic()
        arrivals = self._arrivals_now(step)
        region = self.spares.region
        for req_id, state in self._requests.items():
            if state.expires > step:
                continue
            # A request vLLM deferred is asked about again only when it has room for
            # it, often steps later: until then its answers are kept fresh.
            deferred = req_id not in self._queued and self._deferred(state)
            waiting = req_id in head
            # An answer is its reply's, shared by its chunks (a few a request): each is
            # judged once, and the chunks are walked only if one of them expired.
            answers = state.answers.values()
            gone = set()
            for answer in dict(zip(map(id, answers), answers, strict=True)).values():
                if answer.until > step:
                    continue
                # A hit while its pin holds, a miss while nothing arrived at the node
                # since: no need to ask.
                if waiting and answer.region == region and (
                        answer.held_until > now or answer.arrivals == arrivals >= 0):
                    answer.until = step + QUEUED_STEPS
                else:
                    gone.add(id(answer))
            expired = [c for c, a in state.answers.items() if id(a) in gone] if gone else []
            self._unpin(state, expired)
            state.covered = state.covered and not expired
            for chunk in expired:
                del state.answers[chunk]
                if deferred:
                    state.asks[chunk] = None
            state.expires = min(map(_UNTIL, state.answers.values()), default=NEVER)
        self.spares.step_ended()
        self.spares.want(self._waiting.rows())
        owed = self.holdings.owed
        asked = any(map(_ASKS, self._requests.values()))
        due = owed and (self._idle or time.monotonic() - owed.since >= self.options.flush_s)
        if self.rounds.flush is None and not self.rounds.down and (
                asked or due or self.spares.short()):
            asks = self._take_asks()
            batch, carried = self._lookups(asks, until=step + 1, step=True)
            self.rounds.add_spares(batch, carried)
            flush = self.rounds.flush = self.rounds.send((batch, carried))
            for req_id, _, _ in asks:
                self._requests[req_id].in_flush = flush
        self._refresh_queue_head(step + 1)
        self._step = step + 1
        self.rounds.new_step()
        self._sync_left = self.options.sync_lookups
        self._flush_waited = False
        self._idle = False

    def _arrivals_now(self, step: int) -> int:
        """The broker's count of arrivals (`OpsResult.arrivals`) if it said it in the
        last `QUEUED_STEPS` steps (a miss serves that long after its answer), else -1:
        an engine that stopped hearing from the broker looks its misses up again."""
        if self.link.heard_at != self._heard_at:
            self._heard_at, self._heard_step = self.link.heard_at, step
        return self.link.arrivals if step - self._heard_step < QUEUED_STEPS else -1

    def _requeue(self, preempted: Iterable[str]) -> None:
        """vLLM puts a request it preempts back at the head of its queue, and scans it
        again once it has room: it is kept answered as a queued one is."""
        front = {}
        for req_id in preempted:
            state = self._requests.get(req_id)
            if state is not None:
                state.asked = False
                state.ahead = None  # it has more keys now
                state.covered = False
                state.pending_since = None
                front[req_id] = state.ctx
        if front:
            self._queued = {**front, **self._queued}

    def _take_asks(self) -> list[tuple[str, int, list[bytes]]]:
        """The asked keys for one round trip, per request and group, within the limits
        of one message (the rest stay asked)."""
        chains: list[tuple[str, int, list[bytes]]] = []
        keys = 0
        for req_id, state in self._requests.items():
            if not state.asks:
                continue
            for group, chain in asked_chains(state).items():
                if keys + len(chain) > FLUSH_KEYS or len(chains) >= FLUSH_GROUPS:
                    return chains
                chains.append((req_id, group, chain))
                keys += len(chain)
                for chunk in chain:
                    del state.asks[chunk]
        return chains

    def has_pending_work(self) -> bool:
        """vLLM asks this only when it has no request left: what is owed or asked goes
        at the end of the one more step a True buys. With a round trip out past
        `lookup_wait_ms` (a slow broker) it waits for it a little each time it is
        asked, rather than spin, and says no only once the broker seems hung
        (`IDLE_STALL_S`): had it said no while it owed the broker, vLLM would step it
        no more until a request came, and its stores' blocks would stay reserved,
        other engines told RETRY for them until the broker withdrew them
        (`broker.reservation_s`)."""
        self.rounds.catch_up()
        if self.rounds.down or self.link.stalled(IDLE_STALL_S):
            return False  # nothing to do until the broker answers: do not spin
        if self.link.stalled(self.options.lookup_wait_ms / 1e3):
            self.link.wait_oldest(IDLE_WAIT_S)
            self.rounds.catch_up()
        self._idle = bool(self.holdings.owed or self.rounds.flush is not None or any(
            s.asks for s in self._requests.values()))
        return self._idle

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats, self.rounds.stats = self.rounds.stats, OffloadingConnectorStats()
        return None if stats.is_empty() else stats

    def _take_step(self, step: Any) -> None:
        if self.enable_events and not isinstance(step, RemoteError):
            self._events.extend(self.tiers.events(step, self.keymap))
