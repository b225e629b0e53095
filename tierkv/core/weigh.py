"""The load-or-recompute rule inside a lookup (`tierkv.core.costs` says what it
weighs): which part of a request's leading run to promote, how long the request may
wait for it, and the promotions made for later requests while a tier is idle.

`LoadOrRecompute` is the part of `TieringManager` that holds this concern; it
works on the manager's own state (the CPU tier, the promotions in flight, the
tiers' cost lines), declared below.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from tierkv.core.costs import Recompute, TierCosts, best_split
from tierkv.core.keys import OffloadKey
from tierkv.core.primary import PrimaryTier
from tierkv.core.recompute import Skipped, WaitBounds
from tierkv.tiers.base import SecondaryTier

BACKGROUND_JOB_BLOCKS = 64  # the most blocks one background promotion of a tier brings

ReqId = str | None


class LoadOrRecompute:
    """The rule's methods of `TieringManager` (a mixin: the state is the manager's)."""

    primary: PrimaryTier
    tiers: list[SecondaryTier]
    costs: list[TierCosts]
    block_bytes: int
    clock: Callable[[], float]
    _promoting: dict[OffloadKey, int]
    _job_of: dict[OffloadKey, int]
    _queued_promotions: dict[tuple[int, ReqId], list[OffloadKey]]
    _skipped: Skipped
    _waits: WaitBounds
    _counters: dict[str, int]

    def _find_holder(self, key: OffloadKey,
                     allowed: Container[str] | None = None) -> tuple[int | None, bool]:
        raise NotImplementedError  # the manager's

    def _start_promotion(self, key: OffloadKey, tier: int, req_id: ReqId,
                         lookup: Sequence[OffloadKey]) -> bool:
        raise NotImplementedError  # the manager's

    def _weigh(self, keys: list[OffloadKey], start: int, req_id: ReqId,
               allowed: Container[str] | None,
               recompute: Recompute) -> tuple[bool, bool, tuple[int, ...]]:
        """`_scan` of a leading run for a request that says what recomputing costs it:
        only the prefix of the run that beats recomputing is promoted (`best_split`),
        and the request waits for it at most its bound. Returns (pending, retry, keys
        skipped per tier)."""
        primary, bb, now = self.primary, self.block_bytes, self.clock()
        counts = [0] * len(self.tiers)
        run: list[tuple[OffloadKey, int]] = []  # (key, the tier to promote it from, or -1)
        arrivals: list[float] = []
        unknown = False
        for key in keys[start:]:
            if primary.contains(key):
                run.append((key, -1))
                arrivals.append(0.0 if primary.is_ready(key) else self._arrival(key, now))
                continue
            holder, unknown = self._find_holder(key, allowed)
            if holder is None:
                break
            counts[holder] += 1
            run.append((key, holder))
            arrivals.append(self.costs[holder].eta(counts[holder] * bb, now))
        m, _ = best_split(arrivals, recompute)
        slower = self._skipped.note(run[m:])
        if slower:
            self._counters["slower_than_recompute"] += sum(slower)
            self._explore(run[m:], slower, recompute, keys)
        retry = unknown and m == len(run)  # the run may go on: ask again after the check
        pending = False
        waited = 0  # keys it waits on that are being promoted (the bound is for those)
        for key, holder in run[:m]:
            if holder < 0:
                if not primary.is_ready(key):
                    pending = True
                    waited += key in self._promoting
                continue
            if not self._start_promotion(key, holder, req_id, keys):
                retry = True  # no CPU room now (see `_scan`)
                break
            pending, waited = True, waited + 1
        if req_id is None:
            return pending, retry, slower
        if not waited:
            # Nothing promoted to wait for (a block another engine is writing is
            # bounded by that engine's own wait, `pending_wait_ms` in tierkv.vllm).
            if self._waits.end(req_id):
                # It waited, and now computes: what is still on its way overran.
                self._counters["promotions_overrun"] += sum(
                    1 for key, _ in run if key in self._promoting)
            return pending, retry, slower
        if self._waits.past(req_id, now, recompute.wait_bound(waited)):
            # Past its bound: it computes, and the promotions land for later requests.
            self._counters["promotions_overrun"] += waited
            return False, False, slower
        return pending, retry, slower

    def _explore(self, skipped: Sequence[tuple[OffloadKey, int]], counts: Sequence[int],
                 recompute: Recompute, lookup: Sequence[OffloadKey]) -> None:
        """Promote, in the background, the first keys a lookup left to recompute from
        each idle tier: as many as that tier is expected to bring in the time the
        engine takes to recompute them (at least one). The request does not wait for
        them; its engine will not store them again (they are present), later requests
        find them, and the tier's line is measured even while every lookup skips it
        (a tier priced too slow would otherwise never be tried)."""
        busy = {t for t, _ in self._queued_promotions}
        for t, n in enumerate(counts):
            costs = self.costs[t]
            if not n or t in busy or costs.queued_bytes:
                continue
            line = costs.line
            room = (recompute.seconds(n) - line.latency_s) * line.bandwidth / self.block_bytes
            most = max(1, min(BACKGROUND_JOB_BLOCKS, int(room)))
            started = 0
            for key, holder in skipped:
                if holder != t:
                    continue
                if started >= most or not self._start_promotion(key, t, None, lookup):
                    break
                self._skipped.forget(t, key)
                started += 1
            self._counters["background_promotions"] += started

    def _arrival(self, key: OffloadKey, now: float) -> float:
        """Expected seconds until a key in the CPU tier but not readable is: its
        promotion's remaining time, or none for a block an engine is storing."""
        tier = self._promoting.get(key)
        if tier is None:
            return 0.0
        job = self._job_of.get(key)
        costs = self.costs[tier]
        return costs.eta(self.block_bytes, now) if job is None else costs.remaining(job, now)

    def _start_background(self) -> None:
        """Promote keys that requests skipped as slower than recomputing, from each
        tier with no promotion of its own queued or out (so a request's loads never
        wait behind these), a few blocks at a time. A key asked for once is brought
        only into free CPU rows; one asked for again may evict (it is being reused)."""
        busy = {t for t, _ in self._queued_promotions}
        skipped, primary = self._skipped, self.primary
        for t, tier in enumerate(self.tiers):
            if not skipped.any(t) or t in busy or self.costs[t].queued_bytes:
                continue
            started = 0
            # The most recently skipped first, and only a few looked at per step.
            for key, times in skipped.newest(t, 4 * BACKGROUND_JOB_BLOCKS):
                if primary.contains(key) or not tier.holds(key):
                    skipped.forget(t, key)
                    continue
                if times < 2 and primary.free_blocks == 0:
                    continue
                if not self._start_promotion(key, t, None, ()):
                    break  # no CPU room now
                skipped.forget(t, key)
                started += 1
                if started >= BACKGROUND_JOB_BLOCKS:
                    break
            self._counters["background_promotions"] += started
