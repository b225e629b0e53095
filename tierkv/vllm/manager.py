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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.client import Client, RemoteError
from tierkv.core.loglimit import RateLimitedLog
from tierkv.vllm.identity import EngineIdentity
from tierkv.vllm.jobs import TierkvLoadStoreSpec
from tierkv.vllm.layout import KeyMap
from tierkv.vllm.lookups import (
    AGAIN,
    HIT_STEPS,
    NEVER,
    QUEUED_STEPS,
    Answer,
    KnownPresent,
    RequestLookups,
    asked_chains,
    by_group,
    chain_for,
    defers,
    forget_misses,
    head_first,
    hits_in,
    read_answers,
)
from tierkv.vllm.prefill import PrefillRate
from tierkv.vllm.request_keys import request_keys
from tierkv.vllm.rounds import Carried, Metrics, Rounds
from tierkv.vllm.spares import TRUST_S, Spare, WaitingStore, WaitingStores
from tierkv.vllm.tiers import NodeTiers
from tierkv.wire.protocol import MAX_GROUPS, MAX_STEP_KEYS

log = logging.getLogger("tierkv.vllm")
# Read over every request at each step's end: C-level getters, not generators.
_UNTIL, _ASKS = attrgetter("until"), attrgetter("asks")

SHUTDOWN_LOCK_S = 5.0  # a step that raised may have left the lock held on this thread
FLUSH_KEYS = MAX_STEP_KEYS // 2  # asked keys per end-of-step round trip (the rest wait)
FLUSH_GROUPS = MAX_GROUPS // 2
IDLE_WAIT_S = 0.01  # an idle engine waiting on a slow broker asks again this often
IDLE_STALL_S = 5.0  # and for this long: past it the broker hangs (its supervisor's matter)


@dataclass(frozen=True, slots=True)
class ManagerOptions:
    """The scheduler-thread budget and the knobs around it (see the module docstring)."""

    budget_ms: float = 20.0
    retry_s: float = 5.0
    flush_s: float = 0.05  # owed operations wait at most this long for a round trip
    sync_lookups: int = 2
    max_lookup_keys: int = 2048  # chunks of one request in one lookup of its own
    lookup_wait_ms: float = 250.0  # a request waits this long for answers, then misses
    pending_wait_ms: float = 5000.0  # and this long for blocks being written or promoted
    spare_rows: int = 1024  # rows reserved ahead for stores, at most (`spares.py`)
    prefetch_requests: int = 64  # new requests looked up before vLLM asks, at most at once


class TierkvOffloadingManager(OffloadingManager):
    """See the module docstring. One per vLLM scheduler; vLLM holds `lock` around
    every call but `shutdown`."""

    def __init__(self, client: Client, identity: EngineIdentity, group_ids: Sequence[int],
                 window_groups: Collection[int] = (), tiers: Sequence[tuple[str, str]] = (),
                 options: ManagerOptions = ManagerOptions(), *,
                 enable_events: bool = False) -> None:
        self.identity = identity
        self.group_ids = list(group_ids)  # vLLM's offloaded groups, in spec order
        self.window_groups = frozenset(window_groups)  # scanned from the end
        self.tiers = NodeTiers(tiers)
        self.options = options
        self.enable_events = enable_events
        self.generation = 0
        self.keymap = KeyMap(identity.namespace(0))
        self.rounds = Rounds(client, options.budget_ms, options.retry_s, self._take_lookups,
                             self._take_step, options.spare_rows, self._not_stored)
        self.spares = self.rounds.spares
        self.present = KnownPresent()
        self._waiting = WaitingStores()  # stores that got no rows in their step
        # What recomputing costs this engine (`tierkv.vllm.prefill`), set by the spec;
        # the connector sends it with every step's lookups.
        self.prefill: PrefillRate | None = None
        self.key_tokens = 0  # tokens one chunk (a node key) covers
        self._stored_now: set[bytes] = set()  # chunks this engine stored since the step's end
        self.link = self.rounds.link
        self.holdings = self.rounds.holdings
        self._lock = threading.Lock()
        self._requests: dict[str, RequestLookups] = {}
        self._loading: dict[str, dict[bytes, list[bytes]]] = {}  # req -> chunk -> pins
        self._fenced: list[list[bytes]] = []  # pins of loads in flight at a reset
        self._fenced_writes: list[list[bytes]] = []  # reservations in flight at a reset
        self._step = 0
        self._sync_left = options.sync_lookups
        self._flush_waited = False  # this step waited for the end-of-step answers
        self._idle = False
        self._events: list[OffloadingEvent] = []
        self._queued: dict[str, ReqContext] = {}  # added, not scanned by vLLM yet, in order
        self._warn = RateLimitedLog(log)

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    # -- lookups ---------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        state = self._state(req_context)
        answer = state.answers.get(key)
        if answer is None or answer.until < self._step:
            self.rounds.catch_up()
            answer = state.answers.get(key)
            if answer is None or answer.until < self._step:
                answer = self._answer_now(state, key)
        elif answer.status is LookupResult.MISS and self.present.has(self.keymap.key(key)):
            answer = self._answer_again(state, key, answer)
        if not state.asked:  # queued until now (an answer it waited for above serves)
            state.asked = True
            self._queued.pop(req_context.req_id, None)
        if answer is None:
            now = time.monotonic()
            if state.waiting_since is None:
                state.waiting_since = now
            elif now - state.waiting_since > self.options.lookup_wait_ms / 1e3:
                return LookupResult.MISS  # the broker is slow: computing beats waiting
            state.asks[key] = None
            return LookupResult.RETRY
        state.waiting_since = None
        if answer.status not in AGAIN:
            return answer.status
        # Since vLLM was first told to wait for a block (another key's hit does not
        # end that: its scan asks every key up to this one at each step).
        now = time.monotonic()
        if state.pending_since is None:
            state.pending_since = now
        elif now - state.pending_since > self.options.pending_wait_ms / 1e3:
            # Written by an engine that stopped (the broker ends it only after
            # `broker.owner_timeout_s`) or promoted from a slow tier: computing beats
            # waiting longer.
            return LookupResult.MISS
        state.asks[key] = None
        return answer.status

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        state = self._requests.get(req_context.req_id)
        answer = state.answers.get(key) if state is not None else None
        return self.tiers.hit_source(answer.source if answer is not None else None)

    def _answer_again(self, state: RequestLookups, key: bytes, stale: Answer) -> Answer:
        """A miss this engine has seen stored since it was answered (a queued request's
        answers serve steps): the request's answers that are not hits are dropped
        (they hold nothing, and are as old) and looked up now if the step's budget
        allows; otherwise they stand (computed, never a step of waiting). A miss
        again: the node evicted it since, and it is no longer known present."""
        dropped = forget_misses(state)
        answer = self._answer_now(state, key)
        if answer is None:
            state.answers.update(dropped)
            return stale
        if answer.status is LookupResult.MISS:
            self.present.forget(self.keymap.key(key))
        return answer

    def _answer_now(self, state: RequestLookups, key: bytes) -> Answer | None:
        """An answer this step can give without going past its budget, or None."""
        if self.rounds.down:
            return Answer(LookupResult.MISS, self._step)
        prefetch, state.prefetch = state.prefetch, None
        if prefetch is not None and self.rounds.wait(prefetch, abandon=False):
            self.rounds.catch_up()
            answer = state.answers.get(key)
            if answer is not None and answer.until >= self._step:
                return answer
        flush = self.rounds.flush
        if flush is not None and state.in_flush is flush and not self._flush_waited:
            self._flush_waited = True  # it carries this request's asked keys
            if self.rounds.wait(flush, abandon=False):
                self.rounds.catch_up()
                answer = state.answers.get(key)
                if answer is not None and answer.until >= self._step:
                    return answer
        if self._sync_left <= 0 or state.synced == self._step or not self.rounds.can_wait():
            return None
        self._sync_left -= 1
        state.synced = self._step
        chains = chain_for(state.ctx, key, state.answers, self.window_groups,
                           self.options.max_lookup_keys)
        call = self.rounds.send(self._lookups(
            [(state.ctx.req_id, g, c) for g, c in chains.items()], until=self._step))
        if not self.rounds.wait(call):
            return None
        self.rounds.apply(call)
        answer = state.answers.get(key)
        return answer if answer is not None and answer.until >= self._step else None

    def prefetch(self, ctx: ReqContext) -> None:
        """Look a new request's keys up now, before vLLM asks (it adds requests between
        steps): the answers are there, or on their way, when its first scan comes, so
        it is admitted in the step that first asks for it. Every key from the first,
        per group; pins of hits vLLM's own prefix cache makes needless go after
        `HIT_STEPS`. At most `prefetch_requests` are out at once: a long queue added
        at once must not start promotions (and evictions) for requests that will not
        run for many steps; those are looked up when the step scans them. A request
        that waits in vLLM's queue (it runs once a running one makes room, often steps
        later) has its answers kept fresh while it is among the first
        `prefetch_requests` of the queue (`_refresh_queue_head`)."""
        self._queued[ctx.req_id] = ctx
        if self.rounds.down or len(self.rounds.prefetches) >= self.options.prefetch_requests:
            return
        state = self._state(ctx)
        picked = self._chains_ahead(state)
        if picked:
            state.prefetch = self.rounds.prefetch(self._lookups(picked, until=self._step,
                                                                owed=False))
            state.coming = {k for _, _, keys in picked for k in keys}

    def _chains_ahead(self, state: RequestLookups) -> list[tuple[str, int, list[bytes]]]:
        """A request's keys to look up before vLLM asks: from its first, per group, at
        most `max_lookup_keys` (a sliding-window group's last ones)."""
        if state.ahead is not None:
            return state.ahead
        ctx = state.ctx
        positions = request_keys(ctx)
        most = self.options.max_lookup_keys
        picked = []
        for group, chain in by_group(positions).items():
            chain.sort(key=positions.__getitem__)
            chain = chain[-most:] if group in self.window_groups else chain[:most]
            picked.append((ctx.req_id, group, chain))
        state.ahead = picked
        state.ahead_keys = frozenset(k for _, _, keys in picked for k in keys)
        return picked

    def _refresh_queue_head(self, until: int) -> None:
        """Look up again, in a round trip of their own, the keys without an answer for
        step `until` of the first `prefetch_requests` requests in vLLM's queue: vLLM
        asks about them once running requests make room (often many in one step), and
        they are answered in the step that asks. With them, the misses of a request
        whose keys this engine stored in the step (its misses serve steps, and many
        requests share a prefix). Not a request a slower tier serves
        (its blocks are being promoted, or were): each look-up would start its
        promotions again, and a CPU tier too small for the queue would evict blocks
        promoted for one queued request to promote another's."""
        stored_now, self._stored_now = self._stored_now, set()
        if self.rounds.down:
            return
        stale: list[tuple[RequestLookups, set[bytes]]] = []
        chains = []
        for ctx in self._queue_head().values():
            state = self._state(ctx)
            if state.tiered:
                continue  # looked up again, it would start promotions for it again
            answers = state.answers
            ahead = self._chains_ahead(state)
            if stored_now and not stored_now.isdisjoint(state.ahead_keys):
                forget_misses(state)  # a miss of it may be one this engine just stored
            if answers.keys() >= state.ahead_keys:
                continue  # every key answered (the common case: a subset test in C)
            # Keys of its last look-up still on their way are not asked twice.
            coming = state.coming if state.prefetch is not None and not state.prefetch.done \
                else ()
            missing = [(req_id, group, lacking) for req_id, group, chain in ahead
                       if (lacking := [k for k in chain if k not in answers
                                       and k not in coming])]
            if missing:
                stale.append((state, {k for _, _, keys in missing for k in keys} | set(coming)))
                chains.extend(missing)
        if chains:
            call = self.rounds.prefetch(self._lookups(chains, until=until, owed=False))
            for state, keys in stale:
                state.prefetch, state.coming = call, keys

    def _lookups(self, chains: Iterable[tuple[str, int, list[bytes]]], until: int,
                 step: bool = False, owed: bool = True) -> tuple[Any, Carried]:
        """A round trip of lookups (their answers serve through step `until`)."""
        batch, carried = self.rounds.open(self.generation, step, owed)
        for req_id, group, chain in chains:
            # Sliding-window groups key by key; full attention a leading run, whose
            # promotions stop at its first miss.
            batch.lookup(self.keymap.keys(chain), req_id, status=group in self.window_groups,
                         pin=True)
            carried.lookups.append((req_id, chain, until))
        return batch, carried

    def _take_lookups(self, carried: Carried, results: Sequence[Any] | None,
                      told: bool) -> None:
        """A call's lookup answers: kept for their requests if `told` (the call was
        waited for, or is the step's own round trip), still of this generation and
        not out of date; otherwise their pins are let go at once."""
        keymap = self._keymap_of(carried.generation)
        at = carried.owed_slots
        for i, (req_id, chain, until) in enumerate(carried.lookups):
            found = results[at + i] if results is not None else None
            if isinstance(found, RemoteError):
                self._warn.warning("lookup", "tierkv refused a lookup: %s", found)
                found = None
            if found is not None and found.region and found.region != self.spares.region:
                self.spares.drop_all()  # another region: the broker restarted, they are void
                self.spares.region = found.region
            state = self._requests.get(req_id)
            if until < self._step and state is not None and (
                    req_id in self._queued or self._deferred(state)):
                until = self._step  # late, but the freshest there is for it
            # A queued request's misses serve as long as its hits: it is looked up
            # again whenever its answers expire, until vLLM scans it.
            served = until + QUEUED_STEPS - 1 if req_id in self._queued else until
            answers, rows = read_answers(chain, found, served, carried.opened,
                                         hits_until=until + HIT_STEPS - 1)
            pins = keymap.keys(rows)
            self.holdings.pinned(pins)
            if (not told or state is None or carried.generation != self.generation
                    or until < self._step):
                self.holdings.release(pins)
                continue
            self.rounds.stats.increase_counter(Metrics.LOOKUP_KEYS, len(chain))
            kept, asks = state.answers, state.asks
            if kept:  # answers replaced: their pins go (a set operation, in C)
                self._unpin(state, kept.keys() & answers.keys())
            kept.update(answers)
            state.rows.update(rows)
            if asks:
                for chunk in asks.keys() & answers.keys():
                    del asks[chunk]
            self.present.add_all(pins)
            state.tiered = state.tiered or defers(found, len(chain))
            state.expires = min(state.expires, served)
            self.rounds.stats.increase_counter(Metrics.HIT_KEYS, len(pins))

    def _unpin(self, state: RequestLookups, chunks: Iterable[bytes]) -> None:
        """Let go of the pins the request's hits among `chunks` hold."""
        rows = state.rows
        self.holdings.release(self.keymap.keys(
            chunk for chunk in chunks if rows.pop(chunk, None) is not None))

    # -- loads -----------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey],
                     req_context: ReqContext) -> LoadStoreSpec:
        req_id = req_context.req_id
        state = self._requests.get(req_id)
        loading = self._loading.setdefault(req_id, {})
        chunks = list(keys)
        if state is None:
            answers: list[Answer | None] = [None] * len(chunks)
            rows = [-1] * len(chunks)
        else:  # what the chunks' lookups said, claimed (list comprehensions, in C)
            answers = [state.answers.pop(c, None) for c in chunks]
            rows = [state.rows.pop(c, -1) for c in chunks]
        # The load's region: its first hit's (a hit of another is no row of this job).
        region = next((a.region for a in answers if a is not None and a.region), "")
        if (chunks and min(rows) >= 0 and hits_in(answers, region)
                and loading.keys().isdisjoint(chunks)):  # the common case
            loading.update(zip(chunks, ([pin] for pin in self.keymap.keys(chunks)), strict=True))
        else:
            rows = [self._claim_row(req_id, chunk, answer, row, region, loading)
                    for chunk, answer, row in zip(chunks, answers, rows, strict=True)]
        return TierkvLoadStoreSpec(self._chunks_per_group(chunks), rows, region, req_id)

    def _claim_row(self, req_id: str, chunk: bytes, answer: Answer | None, row: int,
                   region: str, loading: dict[bytes, list[bytes]]) -> int:
        """A chunk's row for a load job, its pin now the load's; -1 for one that was
        not a pinned hit in `region`: vLLM loads only what lookup called a hit, and
        should it not, the worker fails the job (a miss, recomputed) rather than read
        another key's row."""
        if answer is None or answer.status is not LookupResult.HIT or (
                answer.region != region) or row < 0:
            self._warn.warning("load", "prepare_load of a key that was not a hit "
                               "(request %s)", req_id)
            if row >= 0:
                self.holdings.release([self.keymap.key(chunk)])
            return -1
        loading[chunk] = [*loading.get(chunk, ()), self.keymap.key(chunk)]
        return row

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.holdings.touch(self.keymap.keys(self._tail_first(keys, req_context)))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        loading = self._loading.get(req_context.req_id)
        if not loading:
            return
        # Tail first: the broker counts a finished read as a use, the last most recent,
        # so a prefix's head stays the last to go (a lookup stops at the first miss).
        self.holdings.release([pin for chunk in self._tail_first(keys, req_context)
                               for pin in loading.pop(chunk, ())])
        if not loading:
            del self._loading[req_context.req_id]

    # -- stores ----------------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        self.rounds.catch_up()
        req_id = req_context.req_id
        if self.rounds.down:
            self._waiting.refused(req_id, len(keys), "the broker was unavailable")
            return None
        holdings, keymap, present = self.holdings, self.keymap, self.present
        offered = [bytes(k) for k in keys]
        todo: list[bytes] = []
        there: list[bytes] = []
        for chunk in offered:
            key = keymap.key(chunk)
            if present.has(key):
                there.append(chunk)
            elif not holdings.busy(chunk, [key]):
                todo.append(chunk)
        if there:
            holdings.touch(keymap.keys(self._tail_first(there, req_context)))
        if not todo:
            self._waiting.stored(req_id)
            return self._nothing_to_store()
        spares = self._spares_for(req_id, len(todo))
        if len(spares) == len(todo):
            self._waiting.stored(req_id)
            return self._reserved(todo, req_id, [s.row for s in spares], self.spares.region,
                                  req_context, [s.key for s in spares])
        region = self.spares.region  # the spares' (a reply may void them)
        rest = todo[len(spares):]
        reply = self._reserve_rest(req_id, rest)
        if spares and self.spares.region != region:
            # The broker restarted: the spares taken are void (not given back), and the
            # rows just reserved are let go of (offered again, the job gets fresh ones).
            if not isinstance(reply, str):
                self.holdings.commit([k for k, row in zip(keymap.keys(rest), reply.block_ids,
                                                          strict=True) if row >= 0], False)
            reply = "the broker restarted"
        elif isinstance(reply, str):
            self.spares.give_back(spares)
        if isinstance(reply, str):
            self._waiting.refused(req_id, len(todo), reply)
            return None  # offered again next step
        self._waiting.stored(req_id)
        return self._reserved(todo, req_id, [s.row for s in spares] + list(reply.block_ids),
                              reply.region, req_context, [s.key for s in spares])

    def _spares_for(self, req_id: str, n: int) -> list[Spare]:
        """Up to `n` spare rows for a store; none while the broker has been silent
        `TRUST_S` (it may have restarted: the store's own reservation, answered, says
        so). A store that waits for rows waits first for the end-of-step round trip
        that reserves spares for it (`SpareRows.want`), within the step's budget."""
        flush = self.rounds.flush
        if req_id in self._waiting and flush is not None and self.rounds.can_wait():
            if self.rounds.wait(flush, abandon=False):
                self.rounds.catch_up()
        if time.monotonic() - self.link.heard_at > TRUST_S:
            return []
        return self.spares.take(n)

    def _reserve_rest(self, req_id: str, chunks: list[bytes]) -> Any:
        """Reserve rows for `chunks` in a round trip of its own, within the step's
        budget: the broker's reply, or why there are none (a string)."""
        if not self.rounds.can_wait():
            self.rounds.stats.increase_counter(Metrics.OVER_BUDGET)
            return "the step's budget_ms was spent"
        batch, carried = self.rounds.open(self.generation)
        carried.reserve = self.keymap.keys(chunks)
        batch.reserve(carried.reserve, req_id)
        call = self.rounds.send((batch, carried))
        if not self.rounds.wait(call):
            return "the broker did not answer within the step's budget_ms"
        self.rounds.apply(call)
        reply = call.results[-1] if call.results is not None else None
        if reply is None or isinstance(reply, RemoteError) or not reply.ok:
            if isinstance(reply, RemoteError):
                self._warn.warning("reserve", "tierkv refused a reservation: %s", reply)
            self.rounds.stats.increase_counter(Metrics.REFUSED_BLOCKS, len(carried.reserve))
            if isinstance(reply, RemoteError):
                return f"refused: {reply}"
            return "the broker did not answer" if reply is None else "no room in the CPU tier"
        return reply

    def _reserved(self, todo: list[bytes], req_id: str, rows: Sequence[int], region: str,
                  ctx: ReqContext, spares: Sequence[bytes] = ()) -> PrepareStoreOutput:
        """The chunks a reservation gave rows to are this job's; the others are
        present (a use of them) or not admitted. With `spares`, the first chunks' rows
        are those spare rows' (`spares.py`), committed as the chunks' keys."""
        stored: list[bytes] = []
        stored_rows: list[int] = []
        present: list[bytes] = []
        for i, (chunk, row) in enumerate(zip(todo, rows, strict=True)):
            if row >= 0:
                key = self.keymap.key(chunk)
                if i < len(spares):
                    self.holdings.reserved(chunk, req_id, [spares[i]], written_as=key)
                else:
                    self.holdings.reserved(chunk, req_id, [key])
                stored.append(chunk)
                stored_rows.append(row)
            else:
                present.append(chunk)
        if present:
            self.holdings.touch(self.keymap.keys(self._tail_first(present, ctx)))
        self.rounds.stats.increase_counter(Metrics.STORED_BLOCKS, len(stored))
        if not stored:
            return self._nothing_to_store()
        spec = TierkvLoadStoreSpec(self._chunks_per_group(stored), stored_rows, region,
                                   req_id, stored)
        return PrepareStoreOutput(keys_to_store=[OffloadKey(k) for k in stored],
                                  store_spec=spec, evicted_keys=[])

    def _nothing_to_store(self) -> PrepareStoreOutput:
        return PrepareStoreOutput(keys_to_store=[], evicted_keys=[],
                                  store_spec=TierkvLoadStoreSpec(self._chunks_per_group(())))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        # Tail first: a commit inserts into the node's policy, the last most recent.
        for chunk in self._tail_first(keys, req_context):
            chunk = bytes(chunk)
            key = self.holdings.end_store(chunk, req_context.req_id, success)
            if success and key is not None:
                self.present.add(key)
                self._stored_now.add(chunk)

    def _not_stored(self, keys: list[bytes]) -> None:
        """Keys a store wrote whose commit the broker refused: not present, so a later
        offer of them stores them again."""
        for key in keys:
            self.present.forget(key)

    def storing(self, spec: TierkvLoadStoreSpec) -> bool:
        """Whether the store job of `spec` still holds a reservation."""
        return any(self.holdings.writing.get(c) is not None
                   and self.holdings.writing[c].req_id == spec.req_id for c in spec.chunks)

    def store_failed(self, spec: TierkvLoadStoreSpec) -> None:
        """A worker could not write the job of `spec`: its rows are aborted (called by
        `TierkvConnector` before vLLM reports the job complete)."""
        for chunk in spec.chunks:
            self.holdings.end_store(chunk, spec.req_id, False)

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
        for req_id, state in self._requests.items():
            if state.expires > step:
                continue
            # A request vLLM deferred is asked about again only when it has room for
            # it, often steps later: until then its answers are kept fresh.
            deferred = req_id not in self._queued and self._deferred(state)
            waiting = req_id in head
            expired = []
            for chunk, answer in state.answers.items():
                if answer.until > step:
                    continue
                # (A hit's answer is its reply's: extending it extends its siblings',
                # which the same test would extend.)
                if waiting and answer.held_until > now and answer.region == self.spares.region:
                    answer.until = step + QUEUED_STEPS  # its pin holds: no need to ask
                    continue
                expired.append(chunk)
            self._unpin(state, expired)
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

    def _queue_head(self) -> dict[str, ReqContext]:
        """The first `prefetch_requests` requests of vLLM's queue: kept answered until
        it scans them (`_refresh_queue_head`), their hits held while the broker holds
        their pins (`on_schedule_end`)."""
        return dict(islice(self._queued.items(), self.options.prefetch_requests))

    def _requeue(self, preempted: Iterable[str]) -> None:
        """vLLM puts a request it preempts back at the head of its queue, and scans it
        again once it has room: it is kept answered as a queued one is."""
        front = {}
        for req_id in preempted:
            state = self._requests.get(req_id)
            if state is not None:
                state.asked = False
                state.ahead = None  # it has more keys now
                state.pending_since = None
                front[req_id] = state.ctx
        if front:
            self._queued = {**front, **self._queued}

    def _deferred(self, state: RequestLookups) -> bool:
        """vLLM was told RETRY for the request, has not been answered since, and will
        still wait for an answer (`lookup_wait_ms`)."""
        since = state.waiting_since
        return since is not None and time.monotonic() - since <= self.options.lookup_wait_ms / 1e3

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

    def held(self) -> dict[str, int]:
        """What this engine holds at the node now, by its own account: rows its
        stores are writing, pins it has not released, the copies a cache reset left
        in flight (`on_reset_flushed`), and operations it still owes the broker."""
        holdings = self.holdings
        return {"writing": len(holdings.writing), "pins": sum(holdings.pins.values()),
                "fenced": len(self._fenced) + len(self._fenced_writes),
                "owed": int(bool(holdings.owed))}

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats, self.rounds.stats = self.rounds.stats, OffloadingConnectorStats()
        return None if stats.is_empty() else stats

    def reset_cache(self) -> None:
        """vLLM's prefix caches are reset (its weights change): a new generation of
        this engine's namespace, so nothing stored before is its hit again (other
        engines keep theirs). Pins it holds for answers go now; those of loads and the
        reservations of stores vLLM submitted go once the workers are done with them
        (`on_reset_flushed`)."""
        self.rounds.catch_up()
        for state in self._requests.values():  # keyed with this generation's keymap
            self._unpin(state, list(state.rows))
            state.answers.clear()
            state.asks.clear()
        self.generation += 1
        self.keymap = KeyMap(self.identity.namespace(self.generation))
        self._fenced.extend(k for loading in self._loading.values()
                            for k in loading.values())
        self._loading.clear()
        self._fenced_writes.extend(r.keys for r in self.holdings.writing.values())
        self.holdings.writing.clear()

    def on_reset_flushed(self) -> None:
        for keys in self._fenced:
            self.holdings.release(keys)
        for keys in self._fenced_writes:
            self.holdings.commit(keys, False)
        self._fenced, self._fenced_writes = [], []

    def shutdown(self) -> None:
        """Let go of everything at the broker, then close the connection (the broker
        ends this engine as its owner). Called without the lock; it takes it, unless a
        step that raised left it held, which must not hang the engine's exit."""
        locked = self._lock.acquire(timeout=SHUTDOWN_LOCK_S)
        try:
            self.rounds.catch_up()
            self.on_reset_flushed()
            for req_id in list(self._requests):
                self.on_request_finished(self._requests[req_id].ctx)
            for loading in self._loading.values():
                for keys in loading.values():
                    self.holdings.release(keys)
            self._loading.clear()
            self.holdings.let_go_of_everything()
            self.holdings.commit(self.spares.drop_all(), False)
        finally:
            try:
                self.rounds.finish(self.generation, self.link.client.timeout)
            finally:
                if locked:
                    self._lock.release()

    def _take_step(self, step: Any) -> None:
        if self.enable_events and not isinstance(step, RemoteError):
            self._events.extend(self.tiers.events(step, self.keymap))

    # -- plumbing --------------------------------------------------------------------

    def _state(self, ctx: ReqContext) -> RequestLookups:
        state = self._requests.get(ctx.req_id)
        if state is None:
            state = self._requests[ctx.req_id] = RequestLookups(ctx)
        return state

    def _keymap_of(self, generation: int) -> KeyMap:
        if generation == self.generation:
            return self.keymap
        return KeyMap(self.identity.namespace(generation))

    def _chunks_per_group(self, keys: Iterable[bytes]) -> list[int]:
        counts = dict.fromkeys(self.group_ids, 0)
        for group, chunks in by_group(keys).items():
            counts[group] += len(chunks)
        return list(counts.values())

    @staticmethod
    def _tail_first(keys: Iterable[bytes], ctx: ReqContext) -> list[bytes]:
        """`keys` from the request's last block to its first (a set's order is none)."""
        return head_first(keys, ctx)[::-1]
