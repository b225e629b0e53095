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
* **Leases**: a promoted block stays protected (a reader) until its request loads
  it, the request is finished, or `lease_steps` steps pass, so promotions for
  queued requests cannot evict each other's landed, unread blocks.
* **Failed promotions** make the key a miss in that tier, never an endless retry:
  until it is stored again when the tier lost it (not found, corrupt), and for a
  back-off otherwise (a dead process, a timeout, an endpoint down: the key may be
  fine). The back-off is per tier, doubles while its promotions keep failing and
  resets on a promotion that lands; a tier that says it is unavailable (an open
  circuit breaker) answers every lookup as a miss at once.

Runs on one thread (the broker's loop); nothing here blocks except `reset`, which
drains the tiers.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.core.errors import LOST
from tierkv.core.keys import OffloadEvent, OffloadKey
from tierkv.core.loglimit import RateLimitedLog
from tierkv.core.primary import BlockStateError, PrepareStoreOutput, PrimaryTier
from tierkv.tiers.base import Job, JobKind, JobResult, SecondaryTier

log = logging.getLogger("tierkv.core.tiering")
PROMOTION_BACKOFF_S = 1.0  # a key whose promotion failed (not lost) waits this long first
PROMOTION_BACKOFF_MAX_S = 60.0  # and at most this long, while its tier keeps failing

ReqId = str | None


@dataclass(frozen=True, slots=True)
class Lookup:
    hits: int  # leading keys ready in the CPU tier
    pending: bool  # some scanned key is on its way: ask again next step


@dataclass(frozen=True, slots=True)
class _PromotionJob:
    tier: int
    req_id: ReqId
    keys: tuple[OffloadKey, ...]


class TieringManager:
    def __init__(
        self,
        primary: PrimaryTier,
        tiers: Sequence[SecondaryTier] = (),
        *,
        lease_steps: int = 32,
        region: Any = None,
        failed_key_memory: int = 100_000,
        max_cascade_backlog: int | None = None,
        promotion_backoff_s: float = PROMOTION_BACKOFF_S,
        promotion_backoff_max_s: float = PROMOTION_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_steps < 1:
            raise ValueError(f"lease_steps must be >= 1, got {lease_steps}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"secondary tier names must be unique, got {names}")
        self.primary = primary
        self.tiers = list(tiers)
        self.lease_steps = lease_steps
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
        # req -> key -> expiry step; each lease holds one reader on the CPU block.
        self._leases: dict[ReqId, dict[OffloadKey, int]] = {}
        self._expiring: dict[int, list[tuple[ReqId, OffloadKey]]] = defaultdict(list)
        # (tier, key) whose promotion failed -> until when it is a miss in that tier
        # (inf: the tier lost it; a miss there until it is stored again).
        self._failed: OrderedDict[tuple[int, OffloadKey], float] = OrderedDict()
        self._failed_key_memory = failed_key_memory
        self.clock = clock
        self.promotion_backoff_s = promotion_backoff_s
        self.promotion_backoff_max_s = promotion_backoff_max_s
        self._backoff = [0.0] * len(self.tiers)  # per tier: the current back-off
        self._backoff_until = [0.0] * len(self.tiers)  # and when its spell ends
        self._warn = RateLimitedLog(log)
        self._counters: dict[str, int] = dict.fromkeys(
            ("lookups_pending", "promotions_started", "promotions_landed", "promotions_failed",
             "promotions_refused", "promotions_cancelled", "cascades_queued", "cascades_skipped",
             "cascade_keys_failed",
             "unknown_job_results", "leases_expired"), 0
        )
        self._promoted_from: dict[str, int] = dict.fromkeys(names, 0)
        # key -> the tier a promotion brought it from, until its first load: what an
        # engine did not recompute is counted once, by the tier it came from.
        self._origin: dict[OffloadKey, int] = {}

    # -- the scheduler-facing operations --------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey], req_id: ReqId = None) -> Lookup:
        self._poll_once()
        primary = self.primary
        hits = primary.lookup(list(keys))
        pending = False
        may_promote = True  # False once a key's existence is still being checked
        for key in keys[hits:]:
            if primary.contains(key):
                if not primary.is_ready(key):
                    pending = True  # being promoted or stored: readable soon
                continue
            holder, unknown = self._find_holder(key)
            if holder is None:
                if not unknown:
                    break  # no tier holds it: the prefix ends here
                pending, may_promote = True, False
                continue
            if not may_promote:
                pending = True
                continue
            pending = True
            if not self._start_promotion(key, holder, req_id):
                # Every CPU block is busy (being written, read or cascaded): that
                # passes, and loading beats recomputing, so the engine asks again.
                break
        if pending:
            self._counters["lookups_pending"] += 1
        return Lookup(hits, pending)

    def prepare_store(
        self, keys: Iterable[OffloadKey], req_id: ReqId = None
    ) -> PrepareStoreOutput | None:
        self._poll_once()
        out = self.primary.prepare_store(keys)
        if out is not None:
            self._forget_origin(out.evicted_keys)
        return out

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """End a store from the GPU. Keys being promoted are not the caller's to end."""
        keys = list(keys)
        promoting = [k for k in keys if k in self._promoting]
        if promoting:
            raise BlockStateError(
                f"complete_store: key {promoting[0].hex()} is being promoted, not stored"
            )
        changed = self.primary.complete_store(keys, success)
        if success and changed:
            self._queue_cascade(changed, source=None)

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
        leases = self._leases.get(req_id)
        if leases:
            mine = [k for k in keys if leases.pop(k, None) is not None]
            self.primary.release(mine)  # the load's own reader protects them now
            if not leases:
                del self._leases[req_id]
        return block_ids, sources

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self.primary.complete_load(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.primary.touch(keys)
        for tier in self.tiers:
            tier.touch(keys)

    def finish(self, req_id: ReqId) -> None:
        """The request is done: its leases end and its unsent promotions are cancelled."""
        leases = self._leases.pop(req_id, None)
        if leases:
            self.primary.release(list(leases))
        for (tier, req), keys in list(self._queued_promotions.items()):
            if req == req_id:
                del self._queued_promotions[(tier, req)]
                for key in keys:
                    del self._promoting[key]
                self.primary.complete_store(keys, success=False)
                self._counters["promotions_cancelled"] += len(keys)

    def step(self) -> None:
        """End the step: apply completions (once), expire leases, flush jobs."""
        self._poll_once()
        self._expire_leases()
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
        return {
            "step": self.step_count,
            "cpu": self.primary.stats(),
            "tiers": {
                t.name: {**t.stats(), "promoted_blocks": self._promoted_from[t.name]}
                for t in self.tiers
            },
            "tiering": {
                **self._counters,
                "promotions_in_flight": len(self._promoting),
                "cascades_in_flight": len(self._cascades),
                "leases": sum(len(v) for v in self._leases.values()),
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
        for keys in [*cascaded, *self._queued_cascades.values(),
                     *(list(leases) for leases in self._leases.values())]:
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
        for leases in self._leases.values():
            self.primary.release(list(leases))
        self._leases.clear()
        self._expiring.clear()
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

    def _find_holder(self, key: OffloadKey) -> tuple[int | None, bool]:
        """The first tier that holds `key`, and whether some tier does not know yet."""
        unknown = False
        for t, tier in enumerate(self.tiers):
            if self._failed and self._backing_off(t, key):
                continue
            found = tier.lookup(key)
            if found:
                return t, unknown
            if found is None:
                unknown = True
        return None, unknown

    def _start_promotion(self, key: OffloadKey, tier: int, req_id: ReqId) -> bool:
        out = self.primary.prepare_store([key], filtered=False)
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
            for key in result.successful_keys:
                self._failed.pop((tier, key), None)
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
        if failed:
            self._promotion_failed(promotion.tier, failed, result)
        if not landed:
            return
        self._backoff[promotion.tier] = 0.0  # the tier serves again
        self.primary.complete_store(landed, success=True)
        self._origin.update(dict.fromkeys(landed, promotion.tier))
        self._counters["promotions_landed"] += len(landed)
        self._promoted_from[self.tiers[promotion.tier].name] += len(landed)
        self._queue_cascade(landed, source=promotion.tier)
        if promotion.req_id is not None:
            self.primary.acquire(landed)
            leases = self._leases.setdefault(promotion.req_id, {})
            expiry = self.step_count + self.lease_steps
            for key in landed:
                if key in leases:  # already leased for this request: one reader is enough
                    self.primary.release([key])
                leases[key] = expiry
                self._expiring[expiry].append((promotion.req_id, key))

    def _expire_leases(self) -> None:
        for req_id, key in self._expiring.pop(self.step_count, ()):
            leases = self._leases.get(req_id)
            if leases is None or leases.get(key) != self.step_count:
                continue  # loaded, finished or renewed meanwhile
            del leases[key]
            if not leases:
                del self._leases[req_id]
            self.primary.release([key])
            self._counters["leases_expired"] += 1

    def _forget_origin(self, evicted: Iterable[OffloadKey]) -> None:
        for key in evicted:
            self._origin.pop(key, None)

    def _promotion_failed(self, t: int, failed: list[OffloadKey], result: JobResult) -> None:
        self.primary.complete_store(failed, success=False)
        self._counters["promotions_failed"] += len(failed)
        code = result.error_code
        if code in LOST:
            # The tier lost these keys: a miss there until they are stored again.
            until = math.inf
        else:
            # A dead process, a timeout, an endpoint down: the keys may be fine, the
            # tier is not. Its keys miss for a back-off that grows once per spell.
            now = self.clock()
            if now >= self._backoff_until[t]:
                self._backoff[t] = min(max(2 * self._backoff[t], self.promotion_backoff_s),
                                       self.promotion_backoff_max_s)
                self._backoff_until[t] = now + self._backoff[t]
            until = self._backoff_until[t]
        for key in failed:
            self._failed[(t, key)] = until
            self._failed.move_to_end((t, key))
        while len(self._failed) > self._failed_key_memory:
            self._failed.popitem(last=False)
        name = self.tiers[t].name
        self._warn.warning((name, code), "promotion of %d key(s) from %s failed: %s",
                           len(failed), name, result.error or "no reason given")

    def _backing_off(self, t: int, key: OffloadKey) -> bool:
        """Is `key` a miss in tier `t` because its promotion from there failed?"""
        until = self._failed.get((t, key))
        if until is None:
            return False
        if until > self.clock():
            return True
        del self._failed[(t, key)]  # the back-off is over: the tier may be asked again
        return False
