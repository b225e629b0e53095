"""The tiering orchestrator: the CPU tier over an ordered list of secondary tiers.

What it adds to `PrimaryTier` (semantics: DESIGN, "Block states and the rules that
keep data safe"):

* **Cascade**: a block that becomes ready in the CPU tier is stored to every
  secondary tier that does not hold it. Each pending cascade holds a reader on the
  CPU block until that tier's completion is applied, whatever the outcome.
* **Staged promotion**: `lookup` scans the keys after the CPU hits up to the first
  key no tier holds; each key a secondary tier holds gets a CPU block in `writing`
  and a load from that tier. The lookup says `pending` while any scanned key is in
  flight, or while no CPU block can be made free for one (all are busy: that
  passes); bytes are never reported as hits before they are readable.
* **Once per step**: tier completions are polled at most once per step (on the
  first operation of the step, or at its end) and applied there; promotions and
  cascades are flushed at the step's end, one job per (tier, request) for
  promotions and one per tier for cascades. Latency that follows: with a tier that
  completes at once, a key promoted in step N is a hit in step N+1, and a cascade's
  reader is released in step N+1.
* **Leases** (`tierkv.core.leases`): the blocks a lookup reports as hits to a
  request, and the blocks promoted for one, stay protected (a reader) until the
  request loads them, finishes, or `lease_s` passes since it last asked, so
  another request (or engine) cannot evict them between the lookup and the load.
* **Load or recompute** (`tierkv.core.costs`): when the engine says what
  recomputing costs it, a lookup promotes only the part of its leading run whose
  expected arrival (each tier's measured line, its queue, a stall in progress) beats
  recomputing it; the rest is a miss for this request now, counted per tier
  (`slower_than_recompute`). A request waits for its promotions at most about their
  recompute time: past it, the lookup answers without them (`promotions_overrun`),
  and they land for later requests. What was skipped is promoted in the background
  while its tier has nothing else to do, a few blocks at a time.
* **Failed promotions** make the key a miss in that tier, never an endless retry
  (`tierkv.core.backoff`); a tier that says it is unavailable (an open circuit
  breaker) answers every lookup as a miss at once.

Runs on one thread (the broker's loop); nothing here blocks except `reset`, which
drains the tiers.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.core.backoff import PROMOTION_BACKOFF_MAX_S, PROMOTION_BACKOFF_S, PromotionBackoff
from tierkv.core.costs import Recompute, TierCosts, prior_for
from tierkv.core.keys import OffloadEvent, OffloadKey
from tierkv.core.leases import Leases
from tierkv.core.loglimit import RateLimitedLog
from tierkv.core.policies.hints import RequestHints
from tierkv.core.primary import BlockStateError, PrepareStoreOutput, PrimaryTier
from tierkv.core.recompute import Skipped, WaitBounds
from tierkv.core.weigh import LoadOrRecompute
from tierkv.tiers.base import Job, JobKind, JobResult, SecondaryTier

log = logging.getLogger("tierkv.core.tiering")
QUEUE_PREFETCH = 8  # waiting requests whose missing blocks are promoted ahead of time

ReqId = str | None


@dataclass(frozen=True, slots=True)
class Lookup:
    hits: int  # leading keys ready in the CPU tier
    pending: bool  # ask again next step: some scanned key is on its way (or see retry)
    retry: bool = False  # nothing could start now (no CPU room, existence unknown)
    # Per tier (by index), leading keys it holds that were not promoted: loading them
    # was expected to take longer than recomputing them. Empty: none.
    slower: tuple[int, ...] = ()


# Per-key statuses of `TieringManager.lookup_keys` (also the wire's).
MISS, HIT, PENDING, RETRY = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class _PromotionJob:
    tier: int
    req_id: ReqId
    keys: tuple[OffloadKey, ...]


class TieringManager(LoadOrRecompute):
    def __init__(
        self,
        primary: PrimaryTier,
        tiers: Sequence[SecondaryTier] = (),
        *,
        lease_s: float = 10.0,
        region: Any = None,
        failed_key_memory: int = 100_000,
        max_cascade_backlog: int | None = None,
        promotion_backoff_s: float = PROMOTION_BACKOFF_S,
        promotion_backoff_max_s: float = PROMOTION_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
        block_bytes: int = 0,
        cost_priors: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"secondary tier names must be unique, got {names}")
        self.primary = primary
        self.tiers = list(tiers)
        self.region = region  # closed after the tiers at shutdown, if given
        # A tier slower than the traffic must not pin the whole CPU tier with blocks
        # waiting to be cascaded to it: past this many keys in its backlog, new
        # blocks skip that tier (counted). None: no limit (every block cascades).
        self.max_cascade_backlog = max_cascade_backlog
        self.step_count = 0
        self._job_ids = itertools.count(1)
        self._polled = False
        # In flight, by job id.
        self._cascades: dict[int, tuple[int, tuple[OffloadKey, ...]]] = {}
        self._promotions: dict[int, _PromotionJob] = {}
        # Queued during the step, flushed at its end.
        self._queued_cascades: dict[int, list[OffloadKey]] = defaultdict(list)
        self._queued_promotions: dict[tuple[int, ReqId], list[OffloadKey]] = defaultdict(list)
        self._promoting: dict[OffloadKey, int] = {}  # key -> tier, queued or in flight
        # Blocks a request was told about (hits, landed promotions), held for it.
        self.leases = Leases(primary, lease_s, clock)
        self.clock = clock
        self._failed = PromotionBackoff(len(self.tiers), clock, promotion_backoff_s,
                                        promotion_backoff_max_s, failed_key_memory)
        self._warn = RateLimitedLog(log)
        self._counters: dict[str, int] = dict.fromkeys(
            ("lookups_pending", "promotions_started", "promotions_landed", "promotions_failed",
             "promotions_refused", "promotions_cancelled", "cascades_queued", "cascades_skipped",
             "cascade_keys_failed",
             "unknown_job_results"), 0
        )
        self._promoted_from: dict[str, int] = dict.fromkeys(names, 0)
        # key -> the tier a promotion brought it from, until its first load: what an
        # engine did not recompute is counted once, by the tier it came from.
        self._origin: dict[OffloadKey, int] = {}
        # The load-or-recompute rule: a line per tier, fitted from its promotions, in
        # bytes (a region's row when the size is not given: one unit per block).
        self.block_bytes = block_bytes or (region.layout.page_size * region.layout.world_size
                                           if region is not None else 1)
        if cost_priors is None:
            cost_priors = [prior_for(getattr(t, "type", "") or getattr(
                getattr(t, "backend", None), "type_name", "")) for t in self.tiers]
        if len(cost_priors) != len(self.tiers):
            raise ValueError(f"{len(cost_priors)} cost priors for {len(self.tiers)} tiers")
        self.costs = [TierCosts(*prior) for prior in cost_priors]
        self._job_of: dict[OffloadKey, int] = {}  # promoted key -> its job, once sent
        self._waits = WaitBounds()
        self._skipped = Skipped(len(self.tiers))
        for name in ("slower_than_recompute", "promotions_overrun", "background_promotions"):
            self._counters[name] = 0

    # -- the scheduler-facing operations --------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey], req_id: ReqId = None,
               tiers: Container[str] | None = None,
               hints: RequestHints | None = None,
               recompute: Recompute | None = None) -> Lookup:
        """How many leading keys are CPU hits, and whether to ask again: keys after
        the hits are scanned up to the first one no tier holds, and each a tier
        holds starts a promotion. The hits are leased to `req_id` (if given) until
        it loads them, finishes, or `lease_s` passes. `tiers`: the secondary tiers
        this request may be served from (None: all); `hints`: what the engine says
        of the request (advice for the policy); `recompute`: what recomputing costs
        it (None: every promotion is worth it)."""
        if not self._polled:
            self._poll_once()
        keys = keys if isinstance(keys, list) else list(keys)
        if req_id is not None:
            self.primary.note_request(req_id, keys, hints, self.clock())
        hits = self.primary.lookup(keys)
        if hits and req_id is not None:
            self.leases.lease(req_id, keys[:hits])
        pending = retry = False
        slower: tuple[int, ...] = ()
        if hits < len(keys) and (self.tiers or self.primary.contains(keys[hits])):
            if recompute is None:
                pending, retry = self._scan(keys, hits, req_id, tiers, None)
            else:
                pending, retry, slower = self._weigh(keys, hits, req_id, tiers, recompute)
        if pending or retry:
            self._counters["lookups_pending"] += 1
        return Lookup(hits, pending or retry, retry, slower)

    def lookup_keys(self, keys: Sequence[OffloadKey], req_id: ReqId = None,
                    tiers: Container[str] | None = None,
                    hints: RequestHints | None = None,
                    recompute: Recompute | None = None) -> tuple[Lookup, list[int]]:
        """`lookup` with a status per key (MISS, HIT, PENDING, RETRY), each key on
        its own: for engines whose layers do not need a leading run (sliding window,
        hybrid models). Every key a tier holds starts a promotion; CPU hits are
        leased as in `lookup`."""
        self._poll_once()
        keys = keys if isinstance(keys, list) else list(keys)
        if req_id is not None:
            self.primary.note_request(req_id, keys, hints, self.clock())
        ready = self.primary.is_ready
        status = [HIT if ready(k) else MISS for k in keys]
        hit_keys = [k for k, st in zip(keys, status, strict=True) if st == HIT]
        if hit_keys and req_id is not None:
            self.leases.lease(req_id, hit_keys)
        hits = self.primary.lookup(keys)
        pending, retry = self._scan(keys, 0, req_id, tiers, status, recompute)
        return Lookup(hits, pending or retry, retry), status

    def source_of(self, key: OffloadKey) -> str | None:
        """The tier a promotion brought `key` from, until its first load (else None:
        it was stored into the CPU tier, or was loaded since)."""
        tier = self._origin.get(key)
        return None if tier is None else self.tiers[tier].name

    def _scan(self, keys: list[OffloadKey], start: int, req_id: ReqId,
              allowed: Container[str] | None, status: list[int] | None,
              recompute: Recompute | None = None) -> tuple[bool, bool]:
        """Promote what the keys from `start` need. Without `status`: a leading run,
        up to the first key no tier holds. With it: every key, its status set (and,
        with `recompute`, a tier's keys promoted only while the tier's expected time
        for them beats recomputing them). Returns (pending, retry)."""
        primary = self.primary
        pending = retry = False
        may_promote = True  # False once a key's existence is still being checked
        chosen = [0] * len(self.tiers)  # per tier: keys promoted by this lookup
        now = self.clock() if recompute is not None else 0.0
        for i in range(start, len(keys)):
            key = keys[i]
            if status is not None and status[i] == HIT:
                continue
            if primary.contains(key):
                if primary.is_ready(key):
                    continue  # a hit after a gap (leading-run mode)
                pending = True  # being promoted or stored: readable soon
                if status is not None:
                    status[i] = PENDING
                continue
            holder, unknown = self._find_holder(key, allowed)
            if holder is None:
                if unknown:  # a shared tier is asked whether it holds the key
                    retry, may_promote = True, False
                    if status is None:
                        break  # one existence check per request and lookup, no more
                    status[i] = RETRY
                    continue
                if status is None:
                    break  # no tier holds it: the prefix ends here
                continue
            if not may_promote:
                retry = True
                if status is not None:
                    status[i] = RETRY
                continue
            if recompute is not None:
                n = chosen[holder] + 1
                if self.costs[holder].eta(n * self.block_bytes, now) >= recompute.seconds(n):
                    self._skipped.note([(key, holder)])
                    self._counters["slower_than_recompute"] += 1
                    continue  # its status stays MISS: the engine computes it
                chosen[holder] = n
            if not self._start_promotion(key, holder, req_id, keys):
                # Every CPU block is busy (being written, read or cascaded): that
                # passes, and loading beats recomputing, so the engine asks again.
                retry = True
                if status is None:
                    break
                status[i] = RETRY
                may_promote = False
                continue
            pending = True
            if status is not None:
                status[i] = PENDING
        return pending, retry

    def prepare_store(
        self, keys: Iterable[OffloadKey], req_id: ReqId = None
    ) -> PrepareStoreOutput | None:
        self._poll_once()
        out = self.primary.prepare_store(keys)
        if out is not None:
            self._forget_origin(out.evicted_keys)
        return out

    def complete_store(self, keys: Iterable[OffloadKey],
                       success: bool = True) -> list[OffloadKey]:
        """End a store from the GPU; returns the keys it ended (`PrimaryTier`'s). Keys
        being promoted are not the caller's to end."""
        keys = list(keys)
        promoting = [k for k in keys if k in self._promoting]
        if promoting:
            raise BlockStateError(
                f"complete_store: key {promoting[0].hex()} is being promoted, not stored"
            )
        changed = self.primary.complete_store(keys, success)
        if success and changed:
            self._queue_cascade(changed, source=None)
        return changed

    @property
    def arrivals(self) -> int | None:
        """Keys the secondary tiers came to hold since they started other than by
        this node's stores (`SecondaryTier.arrivals`); None when one cannot tell.
        With clients' stores (`broker.arrivals`), the only way a key no tier held
        becomes a hit."""
        found = [t.arrivals for t in self.tiers]
        return None if None in found else sum(found)  # type: ignore[arg-type]

    def prepare_load(self, keys: Sequence[OffloadKey], req_id: ReqId = None) -> list[int]:
        return self.prepare_load_from(keys, req_id)[0]

    def prepare_load_from(
        self, keys: Sequence[OffloadKey], req_id: ReqId = None
    ) -> tuple[list[int], dict[str, int]]:
        """`prepare_load`, and how many of the keys a promotion brought from each
        secondary tier since they were last loaded (the rest were already in the CPU
        tier). Each promoted block is counted once, at its first load."""
        self._poll_once()
        block_ids = self.primary.prepare_load(keys)
        sources: dict[str, int] = {}
        for key in keys:
            tier = self._origin.pop(key, None)
            if tier is not None:
                name = self.tiers[tier].name
                sources[name] = sources.get(name, 0) + 1
        mine = self.leases.take(req_id, keys)
        if mine:
            self.primary.release(mine)  # the load's own reader protects them now
        return block_ids, sources

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self.primary.complete_load(keys)

    def waiting(self, requests: list[list[OffloadKey]]) -> None:
        """The key chains of the requests waiting in the engine's queue (first to be
        scheduled first): advice for the policy, and what it would miss of the first
        `QUEUE_PREFETCH` of them is promoted from the tiers that hold it now, so the
        lookup that admits them finds it ready."""
        self.primary.note_queue(requests, self.clock())
        if not self.tiers:
            return
        for chain in requests[:QUEUE_PREFETCH]:
            hits = self.primary.lookup(chain)
            if hits < len(chain):
                self._scan(chain, hits, None, None, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.primary.touch(keys)
        for tier in self.tiers:
            tier.touch(keys)

    def finish(self, req_id: ReqId) -> None:
        """The request is done: its leases end and its unsent promotions are cancelled."""
        if req_id is not None:
            self.leases.end(req_id)
            self.primary.note_finish(req_id, self.clock())
            self._waits.end(req_id)
        for (tier, req), keys in list(self._queued_promotions.items()):
            if req == req_id:
                del self._queued_promotions[(tier, req)]
                for key in keys:
                    del self._promoting[key]
                self.primary.complete_store(keys, success=False)
                self._counters["promotions_cancelled"] += len(keys)

    def finish_all(self, prefix: str) -> int:
        """Finish every request whose id starts with `prefix` (a client that ended:
        its leases and unsent promotions go). Returns how many."""
        requests = {r for r in self.leases.requests() if r.startswith(prefix)}
        requests.update(r for _, r in self._queued_promotions if r and r.startswith(prefix))
        for req_id in requests:
            self.finish(req_id)
        return len(requests)

    def step(self) -> None:
        """End the step: apply completions (once), expire leases, flush jobs."""
        self._poll_once()
        self.leases.expire()
        self._flush()
        self.step_count += 1
        self._polled = False

    # -- observation -----------------------------------------------------------------

    def take_events(self) -> list[OffloadEvent]:
        events = self.primary.take_events()
        for tier in self.tiers:
            events.extend(tier.take_events())
        return events

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "step": self.step_count,
            "cpu": self.primary.stats(),
            "tiers": {
                t.name: {**t.stats(), "promoted_blocks": self._promoted_from[t.name],
                         "slower_than_recompute": self._skipped.counts[i],
                         "load_cost": self.costs[i].as_dict(now)}
                for i, t in enumerate(self.tiers)
            },
            "tiering": {
                **self._counters,
                "promotions_in_flight": len(self._promoting),
                "cascades_in_flight": len(self._cascades),
                "leases": len(self.leases),
                "leases_expired": self.leases.expired,
            },
        }

    @property
    def in_flight(self) -> int:
        return len(self._cascades) + len(self._promotions)

    def check_invariants(self) -> None:
        """Assert what the block states promise (tests and `stats(check=True)`)."""
        primary = self.primary
        primary.check_invariants()
        for key in self._promoting:
            assert primary.contains(key) and not primary.is_ready(key), (
                f"key {key.hex()} is being promoted but is not a writing block")
        owed: dict[OffloadKey, int] = {}
        cascaded = [keys for _, keys in self._cascades.values()]
        for keys in [*cascaded, *self._queued_cascades.values(), list(self.leases.held_keys())]:
            for key in keys:
                owed[key] = owed.get(key, 0) + 1
        for key, n in owed.items():
            assert primary.readers(key) >= n, (
                f"key {key.hex()} has {primary.readers(key)} readers, {n} owed")

    # -- lifetime --------------------------------------------------------------------

    def reset(self, timeout: float = 30.0) -> None:
        """Drain every tier, drop queued work and leases, clear the CPU tier.
        Secondary tiers keep their data."""
        for key_list in self._queued_cascades.values():
            self.primary.release(key_list)
        self._queued_cascades.clear()
        for keys in self._queued_promotions.values():
            for key in keys:
                del self._promoting[key]
            self.primary.complete_store(keys, success=False)
        self._queued_promotions.clear()
        for tier in self.tiers:
            if not tier.drain(timeout):
                log.warning("tier %s did not drain within %.1fs", tier.name, timeout)
        self._polled = False
        self._poll_once()
        self.leases.clear()
        self._forget_origin(self.primary.clear())

    def shutdown(self) -> None:
        """Stop the secondary tiers first (they hold views of the rows), then close
        the region if this manager was given it."""
        for tier in self.tiers:
            try:
                tier.shutdown()
            except Exception:
                log.exception("shutting down tier %s", tier.name)
        if self.region is not None:
            self.region.close()
            if getattr(self.region, "is_owner", False):
                self.region.unlink()
            self.region = None

    # -- internals -------------------------------------------------------------------

    def _find_holder(self, key: OffloadKey,
                     allowed: Container[str] | None = None) -> tuple[int | None, bool]:
        """The first tier that holds `key`, and whether some tier does not know yet."""
        unknown = False
        for t, tier in enumerate(self.tiers):
            if allowed is not None and tier.name not in allowed:
                continue
            if self._failed and self._failed.backing_off(t, key):
                continue
            found = tier.lookup(key)
            if found:
                return t, unknown
            if found is None:
                unknown = True
        return None, unknown

    def _start_promotion(self, key: OffloadKey, tier: int, req_id: ReqId,
                         lookup: Sequence[OffloadKey]) -> bool:
        # Never evict what this very lookup reports as hits (or is promoting).
        out = self.primary.prepare_store([key], filtered=False, protect=lookup)
        if out is not None:
            self._forget_origin(out.evicted_keys)
        if out is None or not out.keys_to_store:
            self._counters["promotions_refused"] += 1
            return False
        self._promoting[key] = tier
        self._queued_promotions[(tier, req_id)].append(key)
        self._counters["promotions_started"] += 1
        return True

    def _queue_cascade(self, keys: list[OffloadKey], source: int | None) -> None:
        for t, tier in enumerate(self.tiers):
            if t == source:
                continue
            todo = [k for k in keys if not tier.holds(k)]
            if self.max_cascade_backlog is None:
                room = len(todo)
            else:
                queued = len(self._queued_cascades.get(t, ()))
                room = self.max_cascade_backlog - tier.store_backlog - queued
            if len(todo) > room:
                self._counters["cascades_skipped"] += len(todo) - max(0, room)
                todo = todo[: max(0, room)]
            if todo:
                self.primary.acquire(todo)
                self._queued_cascades[t].extend(todo)
                self._counters["cascades_queued"] += len(todo)

    def _flush(self) -> None:
        primary = self.primary
        self._start_background()
        for t, keys in self._queued_cascades.items():
            job = Job(next(self._job_ids), tuple(keys),
                      tuple(primary.block_id(k) for k in keys), JobKind.STORE)  # type: ignore[misc]
            self._cascades[job.job_id] = (t, job.keys)
            self.tiers[t].submit_store(job)
        self._queued_cascades.clear()
        for (t, req_id), keys in self._queued_promotions.items():
            job = Job(next(self._job_ids), tuple(keys),
                      tuple(primary.block_id(k) for k in keys),  # type: ignore[misc]
                      JobKind.PROMOTION, req_id)
            self._promotions[job.job_id] = _PromotionJob(t, req_id, job.keys)
            self._job_of.update(dict.fromkeys(job.keys, job.job_id))
            self.costs[t].started(job.job_id, self.clock(), len(keys) * self.block_bytes)
            self.tiers[t].submit_load(job)
        self._queued_promotions.clear()

    def _poll_once(self) -> None:
        if self._polled:
            return
        self._polled = True
        for t, tier in enumerate(self.tiers):
            for result in tier.get_finished():
                self._apply(t, result)

    def _apply(self, t: int, result: JobResult) -> None:
        cascade = self._cascades.pop(result.job_id, None)
        if cascade is not None:
            tier, keys = cascade
            self.primary.release(keys)
            self._counters["cascade_keys_failed"] += len(keys) - len(result.successful_keys)
            self._failed.stored(tier, result.successful_keys)
            return
        promotion = self._promotions.pop(result.job_id, None)
        if promotion is None or promotion.tier != t:
            if promotion is not None:
                self._promotions[result.job_id] = promotion
            self._counters["unknown_job_results"] += 1
            log.error("tier %s reported unknown job %d", self.tiers[t].name, result.job_id)
            return
        self._land(promotion, result)

    def _land(self, promotion: _PromotionJob, result: JobResult) -> None:
        ok = set(result.successful_keys)
        landed = [k for k in promotion.keys if k in ok]
        failed = [k for k in promotion.keys if k not in ok]
        for key in promotion.keys:
            self._promoting.pop(key, None)
            self._job_of.pop(key, None)
        self.costs[promotion.tier].finished(result.job_id, self.clock(), bool(landed))
        if failed:
            self._promotion_failed(promotion.tier, failed, result)
        if not landed:
            return
        self._failed.served(promotion.tier)
        self.primary.complete_store(landed, success=True)
        self._origin.update(dict.fromkeys(landed, promotion.tier))
        self._counters["promotions_landed"] += len(landed)
        self._promoted_from[self.tiers[promotion.tier].name] += len(landed)
        self._queue_cascade(landed, source=promotion.tier)
        if promotion.req_id is not None:
            self.leases.lease(promotion.req_id, landed)

    def _forget_origin(self, evicted: Iterable[OffloadKey]) -> None:
        for key in evicted:
            self._origin.pop(key, None)

    def _promotion_failed(self, t: int, failed: list[OffloadKey], result: JobResult) -> None:
        self.primary.complete_store(failed, success=False)
        self._counters["promotions_failed"] += len(failed)
        self._failed.failed(t, failed, result.error_code)
        name = self.tiers[t].name
        self._warn.warning((name, result.error_code), "promotion of %d key(s) from %s "
                           "failed: %s", len(failed), name, result.error or "no reason given")
