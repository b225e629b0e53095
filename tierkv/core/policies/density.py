"""Hit density: evict the block expected to give the fewest hits per unit of cache time.

What it does. Every cached block belongs to a *class* of what is observable about
it, and for each class the policy learns online when blocks come back: the
distribution of the time from a block's last use to its next one (its return time),
from the blocks that are used again while cached *and* from those that come back
after being evicted (a ghost history remembers evicted keys, their class and last
use, for `history` times the capacity and at least 65,536 keys). Blocks not back
yet count as censored at their current age (Kaplan-Meier), so a class whose blocks
stop returning is seen at once, not when its ghosts expire. For a block of age `a`
(time since its last use, counted in block accesses) the policy then knows the best
hit density it can offer: over every horizon `T`, the probability of a return
before `T` divided by the cache time the block holds until it returns or `T`
passes. The victim is the oldest block of the class whose oldest block has the
lowest such density (LHD, Beckmann et al., NSDI'18, with the eviction age chosen
optimally instead of observed, and classes kept in LRU order for speed).

Nothing is tuned to a trace: the curves are learned per workload. Where recency is
everything, density falls with age in every class and the policy is LRU with a
better choice of which class gives way; where most blocks never return and the rest
come back much later, the classes that return are kept and the others go first.

Classes. A session's private blocks are classed by the session's turn (0, 1, 2, 3+)
and its hint state; a request's last block (usually partial, so rarely reused) has
its own class; blocks named by two sessions (a system prompt, a document) are
*shared* and classed by use count (fewer than 4, 4+), whatever a hint says. The
session and turn come from `note_request`: from the engine's `RequestHints` when it
sends them, else from the key chains themselves (a request that names the last full
block of an earlier request continues that request's session). Without
`note_request` a block's class is its use count. Hint states:

* `continues=True`: the session will come back: its blocks join the "continuing"
  classes, or the "soon" classes when `expected_next_s`/`ttl_s` is within the
  cache's turnover time (the time `capacity` block accesses take).
* `continues=False`: the session is over: its blocks join the "finished" classes,
  which go first once the policy has seen that they are not reused.
* The waiting queue (`note_queue`): the leading cached run of every queued request
  (what that request will hit) is kept above everything else until the request is
  served. Blocks behind the first missing one are not protected: the prefix rule
  makes them useless to that request. (Those keys are also the prefetch
  candidates: `PrimaryTier.note_queue` returns the missing ones.)

Trust. Hint classes are learned like any other, so a hint that is always wrong is
learned as the opposite signal and a random one as noise; the queue's protection is
switched off while fewer than a quarter of the blocks it protected were then used.
A missing hint is the no-hint class. Hints never affect correctness.

Order. A request's blocks are ordered deepest first when it finishes, so a class
gives up a chain from its end: evicting a parent first would leave its cached
children unreachable (the prefix rule).

Cost. Each class is an `OrderedDict` of its blocks in order of last use. An eviction
compares the oldest block of each non-empty class (one table lookup each), then
keeps taking from the chosen class while its oldest block is worth less than the
runner-up was (for at most 32 evictions) before comparing again: O(1) amortized
per call, O(classes) at most. The tables are rebuilt (numpy, O(classes x bins^2),
about a millisecond) every `capacity / 2` accesses (at least 1024, at most 65,536).
Memory: a record of seven fields per cached block; an evicted block keeps its
record, less its value, as its ghost until the ghost expires.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Container, Hashable, Iterable
from typing import Any, TypeVar

import numpy as np

from tierkv.core.policies.base import CachePolicy
from tierkv.core.policies.density_classes import (
    _CLS,
    _INFO,
    _KEY,
    _SESSION,
    _SHARED,
    _STAMP,
    _TAIL,
    _USES,
    _VAL,
    N_CLASSES,
    QUEUED,
    SHARED_FEW,
    SHARED_MANY,
    TAIL_CLASS,
    RequestNotes,
    _classify,
    _Noted,
)
from tierkv.core.policies.density_curves import (
    _HI,
    _LO,
    _MID,
    NBINS,
    age_bin,
    age_bins,
    densities,
    distinct_densities,
)

# The curves' names, where the policy's tests import them from.
__all__ = ["_HI", "_LO", "_MID", "NBINS", "HitDensityPolicy", "age_bin", "age_bins",
           "densities", "distinct_densities"]

DECAY = 0.95  # weight of the older samples at each rebuild
HISTORY = 4.0  # ghosts: this many times the capacity ...
MIN_HISTORY = 1 << 16  # ... and at least this many
PRIOR_EVENTS = 2.0  # weight of the pooled curve in each class
REPICK = 32  # evictions taken from one class before the classes are compared again
_RING = 1024  # stamp buckets of the censoring counts (2**10: see `_live`)
_MASK = _RING - 1
_SLOTS = np.arange(_RING)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class HitDensityPolicy(RequestNotes[K], CachePolicy[K, V]):
    name = "hitdensity"

    def __init__(self, capacity: int, *, history: float = HISTORY, decay: float = DECAY) -> None:
        super().__init__(capacity)
        if not 0.0 < decay <= 1.0 or history < 0:
            raise ValueError(f"need 0 < decay <= 1 and history >= 0, got {decay}, {history}")
        self.decay = decay
        self.ghost_limit = max(round(history * capacity), MIN_HISTORY)
        # key -> its record, while cached and, as its ghost, after its eviction until
        # the ghost expires (first in, first out: `_fifo`).
        self._rec: dict[K, tuple[Any, ...]] = {}
        # Per class, its cached keys in order of last use (oldest first) -> records.
        self._lists: list[OrderedDict[K, tuple[Any, ...]]] = [
            OrderedDict() for _ in range(N_CLASSES)]
        self._fifo: deque[tuple[Any, ...]] = deque()
        self._remember = self._fifo.append
        self._gone = 0  # ghosts that came back or expired; ghosts = evictions - gone
        self._expire_at = self.ghost_limit  # evictions beyond which ghosts are too many
        self._clock = 0
        # Return-time samples per class and age bin: returns, and ghosts forgotten
        # without a return; folded into the numpy arrays at each rebuild.
        self._returns = np.zeros((N_CLASSES, NBINS))
        self._expired = np.zeros((N_CLASSES, NBINS))
        self._new_returns = [[0.0] * NBINS for _ in range(N_CLASSES)]
        self._new_expired = [[0.0] * NBINS for _ in range(N_CLASSES)]
        self._density = [[0.0] * NBINS for _ in range(N_CLASSES)]
        self.interval = max(1024, min(capacity // 2, 1 << 16))
        self._next_update = self.interval
        # Samples not resolved yet (cached blocks and ghosts), per class, in a ring of
        # stamp buckets of 2**shift accesses; censored at their age at each rebuild.
        self._shift = max(6, (self.interval // 8).bit_length() - 1)
        self._live = [0] * (N_CLASSES * _RING)  # [class << 10 | slot]
        self._live_span = (_RING - 64) << self._shift  # older samples are dropped
        self._cleared = 0  # ring buckets up to here are clean
        self._victim = 0  # the class evictions are taken from, until `_repick_at`
        self._repick_at = 0
        self._bar = math.inf  # the runner-up's density at the last comparison
        self.evictions = 0
        self.updates = 0
        # Requests: key -> (hint state, session, last key of the request, turn bucket).
        self._ctx: dict[K, tuple[int, Any, Any, int]] = {}
        self._reqs: OrderedDict[Hashable, _Noted[K]] = OrderedDict()
        # Sessions seen in the key chains: the last full block of a request ->
        # (session, turn); a request naming it continues that session.
        self._ends: OrderedDict[K, tuple[Any, int]] = OrderedDict()
        self._ends_limit = self.ghost_limit + capacity
        self._sessions = 0
        self._rate: float | None = None  # clock ticks per second of `now`
        self._rate_mark: tuple[float, int] | None = None
        # Queue: keys a queued request will hit; trust in the queue (EWMA of outcomes).
        self._queued: set[K] = set()
        self._leaving: set[K] = set()  # left the queue at the last step, not used yet
        self.queue_trust = 1.0
        self._clear_ring()

    # -- the key operations -------------------------------------------------------

    def get(self, key: K) -> V | None:
        rec = self._rec.get(key)
        if rec is not None and key in self._lists[rec[1]]:  # not a ghost
            return rec[0]
        return None

    def insert(self, key: K, value: V) -> None:
        clock = self._clock
        ctx = self._ctx.get(key) if self._ctx else None
        rec: tuple[Any, ...]
        if ctx is None:
            rec = (value, 0, clock, 1, 0, None, key)
        else:
            info = ctx[0] | (ctx[3] << 3) | (_TAIL if ctx[2] == key else 0)
            rec = (value, _classify(1, info, ctx[1]), clock, 1, info, ctx[1], key)
        ghost = self._rec.setdefault(key, rec)
        if ghost is not rec:
            if key in self._lists[ghost[1]]:
                raise KeyError(f"key already present: {key!r}")
            rec = self._returned(key, ghost, rec, ctx)
        cls = rec[1]
        self._lists[cls][key] = rec
        self._live[cls << 10 | ((clock >> self._shift) & _MASK)] += 1
        self._clock = clock + 1
        if clock >= self._next_update:
            self._update()

    def _returned(self, key: K, ghost: tuple[Any, ...], rec: tuple[Any, ...],
                  ctx: Any) -> tuple[Any, ...]:
        """A key stored again after its eviction: a return in its ghost's class, and
        the new record takes over the ghost's history."""
        self._gone += 1
        self._expire_at += 1
        stamp = ghost[_STAMP]
        age = rec[_STAMP] - stamp
        cls = self._learned(ghost)
        self._new_returns[cls][age_bin(age)] += 1.0
        if age < self._live_span:
            self._live[cls << 10 | ((stamp >> self._shift) & _MASK)] -= 1
        uses = ghost[_USES] + 1
        session = ghost[_SESSION]
        if session is None:
            session = rec[_SESSION]
        elif session is not _SHARED and ctx is not None and ctx[1] != session:
            session = _SHARED  # named by another session before
        info = rec[_INFO] if ctx is not None else (uses - 1 if uses < 3 else 2) << 3
        rec = (rec[_VAL], _classify(uses, info, session), rec[_STAMP], uses, info, session, key)
        self._rec[key] = rec
        return rec

    def remove(self, key: K) -> None:
        rec = self._rec.get(key)
        if rec is not None and key in self._lists[rec[_CLS]]:
            del self._rec[key]
            del self._lists[rec[_CLS]][key]
            self._queued.discard(key)
            if self._clock - rec[_STAMP] < self._live_span:
                self._live[self._learned(rec) << 10 | ((rec[_STAMP] >> self._shift) & _MASK)] -= 1

    def touch(self, keys: Iterable[K]) -> None:
        recs, lists, returns, ctxs = self._rec, self._lists, self._new_returns, self._ctx
        live, shift, span = self._live, self._shift, self._live_span
        queued = self._queued or self._leaving
        clock = self._clock
        for key in keys:
            rec = recs.get(key)
            if rec is None:
                continue
            cls = rec[1]
            entries = lists[cls]
            if key not in entries:
                continue  # a ghost
            stamp = rec[2]
            age = clock - stamp
            b = age.bit_length()
            i = b if b < 2 else (b << 1) | ((age >> (b - 2)) & 1)
            uses = rec[3]
            if cls == QUEUED:  # learned in the class it had before the queue
                learned = _classify(uses, rec[4], rec[5])
            else:
                learned = cls
            if queued and (key in queued or key in self._leaving):
                self._used_from_queue(key)
            returns[learned][i if i < NBINS else NBINS - 1] += 1.0
            if age < span:
                live[learned << 10 | ((stamp >> shift) & _MASK)] -= 1
            uses += 1
            session = rec[5]
            ctx = ctxs.get(key) if ctxs else None
            if ctx is None:
                info = (rec[4] & 3) | ((uses - 1 if uses < 3 else 2) << 3)
            else:
                info = ctx[0] | (ctx[3] << 3) | (_TAIL if ctx[2] == key else 0)
                if session is None:
                    session = ctx[1]
                elif session is not _SHARED and session != ctx[1]:
                    session = _SHARED
            if session is _SHARED:
                new = SHARED_FEW if uses < 4 else SHARED_MANY
            elif info & _TAIL:
                new = TAIL_CLASS
            else:
                new = (info & 3) * 4 + (info >> 3)
            recs[key] = rec = (rec[0], new, clock, uses, info, session, key)
            if new == cls:
                entries[key] = rec
                entries.move_to_end(key)
            else:
                del entries[key]
                lists[new][key] = rec
            live[new << 10 | ((clock >> shift) & _MASK)] += 1
            clock += 1
        self._clock = clock

    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        if n == 1:  # the common case, straight through
            for _ in range(2):
                if self.evictions >= self._repick_at:
                    pick = self._pick(protected)
                    if pick is None:
                        return None
                    self._victim = pick[0]
                    self._repick_at = self.evictions + (REPICK if pick[0] != QUEUED else 1)
                entries = self._lists[self._victim]
                if not entries:
                    self._repick_at = 0
                    continue
                key, rec = entries.popitem(False)
                if key in protected:
                    entries[key] = rec
                    entries.move_to_end(key, last=False)
                    break
                cls = rec[1]
                if cls != QUEUED:
                    # Keep taking from this class while its oldest block is worth
                    # less than the runner-up's was at the last comparison.
                    age = self._clock - rec[2]
                    b = age.bit_length()
                    i = b if b < 2 else (b << 1) | ((age >> (b - 2)) & 1)
                    if self._density[cls][i if i < NBINS else NBINS - 1] > self._bar:
                        entries[key] = rec
                        entries.move_to_end(key, last=False)
                        self._repick_at = 0
                        continue
                else:
                    self._queued.discard(key)
                self._remember(rec)  # it stays in `_rec` as its ghost
                evictions = self.evictions = self.evictions + 1
                if evictions > self._expire_at or not evictions & 63:
                    self._expire()
                return [(key, rec[0])]
        if n <= 0:
            return []
        recs, lists = self._rec, self._lists
        taken: list[tuple[int, K]] = []
        density, clock = self._density, self._clock
        for done in range(n):
            cls = self._victim
            victim: K | None = None
            if self.evictions + done < self._repick_at:
                entries = lists[cls]
                if entries:
                    victim = next(iter(entries))
                    if victim in protected:
                        victim = None
                    elif cls != QUEUED:  # still worth less than the runner-up?
                        age = clock - recs[victim][_STAMP]
                        b = age.bit_length()  # age_bin, inlined
                        i = b if b < 2 else (b << 1) | ((age >> (b - 2)) & 1)
                        if density[cls][i if i < NBINS else NBINS - 1] > self._bar:
                            victim = None
            if victim is None:
                pick = self._pick(protected)
                if pick is None:
                    self._undo(taken)
                    return None
                cls, victim = pick
                self._victim = cls
                self._repick_at = self.evictions + done + (REPICK if cls != QUEUED else 1)
            del lists[cls][victim]
            taken.append((cls, victim))
        victims = []
        for cls, key in taken:
            rec = recs[key]
            if cls == QUEUED:
                self._queued.discard(key)
            victims.append((key, rec[_VAL]))
            self._remember(rec)  # it stays in `_rec` as its ghost
        self.evictions += n
        if self.ghosts > self.ghost_limit or not self.evictions & 63:
            self._expire()
        return victims

    def _undo(self, taken: list[tuple[int, K]]) -> None:
        """Put back the victims of a failed `evict` where they were."""
        recs, lists = self._rec, self._lists
        for cls, key in reversed(taken):
            entries = lists[cls]
            head = next(iter(entries), None)
            entries[key] = recs[key]
            if head is not None and recs[key][_STAMP] <= recs[head][_STAMP]:
                entries.move_to_end(key, last=False)

    def _pick(self, protected: Container[K]) -> tuple[int, K] | None:
        """The lowest-density unprotected block among the oldest of every class."""
        recs, density, clock = self._rec, self._density, self._clock
        best: tuple[int, K] | None = None
        best_d = second_d = math.inf
        best_age = -1
        for cls, entries in enumerate(self._lists):
            if not entries or cls == QUEUED:
                continue
            key = next(iter(entries))
            if key in protected:
                free = _first_free(entries, protected)
                if free is None:
                    continue  # every block of the class is protected
                key = free
            age = clock - recs[key][_STAMP]
            b = age.bit_length()
            i = b if b < 2 else (b << 1) | ((age >> (b - 2)) & 1)
            d = density[cls][i if i < NBINS else NBINS - 1]
            if d < best_d or (d == best_d and age > best_age):
                second_d = best_d
                best, best_d, best_age = (cls, key), d, age
            elif d < second_d:
                second_d = d
        self._bar = second_d
        if best is None:
            last = _first_free(self._lists[QUEUED], protected)
            if last is not None:
                best = (QUEUED, last)
        return best

    def _expire(self) -> None:
        """Forget ghosts beyond the history: more than `ghost_limit` of them, or last
        used more than `ghost_limit` accesses ago (they count as not returning)."""
        recs, expired, limit = self._rec, self._new_expired, self.ghost_limit
        fifo = self._fifo
        live, shift, span, clock = self._live, self._shift, self._live_span, self._clock
        while fifo:
            ghost = fifo[0]
            key = ghost[_KEY]
            if recs.get(key) is not ghost:  # came back since
                fifo.popleft()
                continue
            stamp = ghost[_STAMP]
            age = clock - stamp
            if self.evictions - self._gone <= limit and age <= limit:
                break
            fifo.popleft()
            del recs[key]
            self._gone += 1
            cls = self._learned(ghost)
            expired[cls][age_bin(age)] += 1.0
            if age < span:
                live[cls << 10 | ((stamp >> shift) & _MASK)] -= 1
        self._expire_at = limit + self._gone

    @staticmethod
    def _learned(rec: tuple[Any, ...]) -> int:
        cls = rec[_CLS]
        return _classify(rec[_USES], rec[_INFO], rec[_SESSION]) if cls == QUEUED else cls

    def __len__(self) -> int:
        return len(self._rec) - self.evictions + self._gone

    @property
    def ghosts(self) -> int:
        """Evicted keys remembered."""
        return self.evictions - self._gone

    def __contains__(self, key: object) -> bool:
        rec = self._rec.get(key)  # type: ignore[arg-type]
        return rec is not None and key in self._lists[rec[_CLS]]

    # -- learning -------------------------------------------------------------------

    def _update(self) -> None:
        """Fold the new samples in and rebuild the density tables."""
        self._next_update = self._clock + self.interval
        self.updates += 1
        returns, expired = self._returns, self._expired
        returns *= self.decay
        expired *= self.decay
        returns += np.array(self._new_returns)
        expired += np.array(self._new_expired)
        self._new_returns = [[0.0] * NBINS for _ in range(N_CLASSES)]
        self._new_expired = [[0.0] * NBINS for _ in range(N_CLASSES)]
        self._clear_ring()
        # The unresolved samples, at the age of the middle of their stamp bucket.
        width = 1 << self._shift
        back = ((self._clock >> self._shift) - _SLOTS) & (_RING - 1)  # buckets ago
        valid = back < _RING - 64  # the rest is cleared: ancient, or the future
        ages = np.maximum(back * width + (self._clock & (width - 1)) - width // 2, 0)
        bins = age_bins(ages[valid])
        live = np.array(self._live, dtype=np.float64).reshape(N_CLASSES, _RING)
        live = np.maximum(live[:, valid], 0.0)
        censored = np.stack([np.bincount(bins, weights=row, minlength=NBINS) for row in live])
        # Each class leans on the pooled curve in proportion to how little it has seen.
        pooled = [a[:QUEUED].sum(axis=0) for a in (returns, expired, censored)]
        total = sum(float(p.sum()) for p in pooled)
        scale = PRIOR_EVENTS / total if total > 0 else 0.0
        table = distinct_densities(returns + scale * pooled[0], expired + scale * pooled[1],
                                   censored + scale * pooled[2])
        self._density = table.tolist()
        self._repick_at = 0

    def _clear_ring(self) -> None:
        """Zero the ring buckets the next `interval` accesses (and more) will use, so
        that what was left there a whole ring ago does not count."""
        shift = self._shift
        first = max(self._cleared, (self._clock >> shift) + 1)
        last = ((self._clock + 2 * self.interval) >> shift) + 2
        for bucket in range(first, last + 1):
            slot = bucket & (_RING - 1)
            for cls in range(N_CLASSES):
                self._live[cls << 10 | slot] = 0
        self._cleared = last + 1

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "ghosts": self.ghosts, "evictions": self.evictions,
                "updates": self.updates, "queued": len(self._lists[QUEUED]),
                "queue_trust": round(self.queue_trust, 3)}


def _first_free(entries: Iterable[K], protected: Container[K]) -> K | None:
    for key in entries:
        if key not in protected:
            return key
    return None
