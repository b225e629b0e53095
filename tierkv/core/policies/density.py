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
from collections.abc import Container, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from tierkv.core.policies.base import CachePolicy
from tierkv.core.policies.hints import RequestHints

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
#: A request as noted: its keys, their context (hint state, session, last key, turn
#: bucket), its hints and its turn.
_Noted = tuple[Sequence[K], tuple[int, Any, Any, int], RequestHints | None, int]

# Age bins: two per octave (0, 1, [2,3), [3,4), [4,6), [6,8), ...); 2**32 and up share
# the last one.
NBINS = 66


def age_bin(age: int) -> int:
    """The histogram bin of an age (inlined in the hot paths)."""
    b = age.bit_length()
    if b < 2:
        return b
    i = (b << 1) | ((age >> (b - 2)) & 1)
    return i if i < NBINS else NBINS - 1


def age_bins(ages: np.ndarray) -> np.ndarray:
    """`age_bin` of every element of an integer array."""
    ages = ages.astype(np.int64)
    b = np.zeros(ages.shape, dtype=np.int64)
    positive = ages > 0
    b[positive] = np.floor(np.log2(ages[positive])).astype(np.int64) + 1
    # Guard log2 rounding at powers of two: b is the bit length.
    b += (ages >= (np.int64(1) << np.minimum(b, 62))) & positive
    b -= (ages < (np.int64(1) << np.maximum(b - 1, 0))) & positive
    low = b < 2
    second = (ages >> np.maximum(b - 2, 0)) & 1
    out = np.where(low, b, (b << 1) | second)
    return np.minimum(out, NBINS - 1)


def _bin_edges() -> tuple[np.ndarray, np.ndarray]:
    lo, hi = [], []
    for i in range(NBINS):
        b, half = i >> 1, i & 1
        if i < 2:
            lo.append(float(i))
            hi.append(float(i + 1))
        elif b < 2:  # indices 2 and 3 are not used
            lo.append(1.0)
            hi.append(1.0)
        else:
            lo.append(float((1 << (b - 1)) + half * (1 << (b - 2))))
            hi.append(lo[-1] + float(1 << (b - 2)))
    return np.array(lo), np.array(hi)


_LO, _HI = _bin_edges()
_MID = (_LO + _HI) / 2.0
# The pairs (i, j >= i) of `densities`, row by row, and where each row i starts.
_I, _J = np.triu_indices(NBINS)
_ROWS = np.flatnonzero(np.r_[True, _I[1:] != _I[:-1]])
_LO_I = _LO[_I]
_SPAN = _HI[_J] - _LO[_I]  # hi_j - lo_i

# Classes: private blocks = hint state * 4 + turn bucket; then the rest.
NONE, CONT, DONE, SOON = 0, 1, 2, 3
TAIL_CLASS = 16  # the last block of a request
SHARED_FEW, SHARED_MANY = 17, 18  # named by two sessions; used < 4 or 4+ times
QUEUED = 19  # a queued request will hit it
N_CLASSES = 20
_TAIL = 4  # info flag: the block ended the request that named it last
_SHARED = object()  # the session of a block named by two sessions

# Record fields: key -> (value, class, stamp (clock at last use), uses, info, session,
# key); info = hint state | _TAIL | turn bucket << 3. An evicted key's record stays
# as its ghost: a key is cached while it is in its class's list. Records are tuples
# of atoms, which the garbage collector stops tracking: no collection pauses.
_VAL, _CLS, _STAMP, _USES, _INFO, _SESSION, _KEY = range(7)

DECAY = 0.95  # weight of the older samples at each rebuild
HISTORY = 4.0  # ghosts: this many times the capacity ...
MIN_HISTORY = 1 << 16  # ... and at least this many
PRIOR_EVENTS = 2.0  # weight of the pooled curve in each class
QUEUE_TRUST = 0.25
REPICK = 32  # evictions taken from one class before the classes are compared again
_RING = 1024  # stamp buckets of the censoring counts (2**10: see `_live`)
_MASK = _RING - 1
_SLOTS = np.arange(_RING)


def _classify(uses: int, info: int, session: Any) -> int:
    if session is _SHARED:
        return SHARED_FEW if uses < 4 else SHARED_MANY
    if info & _TAIL:
        return TAIL_CLASS
    return (info & 3) * 4 + (info >> 3)


def _within(keys: Sequence[Any], chain: Sequence[Any]) -> bool:
    """Whether `keys` are the request's noted `chain` or a part of it (a run from
    either end, the common cases, is checked before any set is made)."""
    n = len(keys)
    if n > len(chain):
        return False
    if n == len(chain):
        return keys == chain
    return (keys == chain[len(chain) - n:] or keys == chain[:n]
            or set(keys).issubset(chain))


class HitDensityPolicy(CachePolicy[K, V]):
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

    # -- engine hints ---------------------------------------------------------------

    def note_request(self, req_id: Hashable, keys: Sequence[K], hints: RequestHints | None,
                     now: float) -> None:
        self._tick(now)
        old = self._reqs.pop(req_id, None)
        if old is not None:
            if old[2] == hints and _within(keys, old[0]):
                # The same request asked again (an engine looks a waiting request
                # up every step), or about part of its chain (the keys it holds no
                # answer for): as it was. Noted anew, its own last block would read
                # as its session's previous turn, one turn more each time, and the
                # blocks it did not ask about would lose their request.
                self._reqs[req_id] = old
                return
            self._forget(old)
        if not keys:
            return
        state, session, turn = NONE, None, None
        if hints is not None:
            session, turn = hints.session, hints.turn
            if hints.continues is False:
                state = DONE
            else:
                horizon = hints.expected_next_s
                if hints.ttl_s is not None:
                    horizon = hints.ttl_s if horizon is None else min(horizon, hints.ttl_s)
                if horizon is not None and self._rate is not None and (
                        horizon * self._rate <= self.capacity):
                    state = SOON
                elif hints.continues or horizon is not None:
                    state = CONT
        if old is not None and (session is None or turn is None):
            # The request again, with more keys or other hints: still its turn.
            _, (_, old_session, _, _), _, old_turn = old
            session = old_session if session is None else session
            turn = old_turn if turn is None else turn
        if session is None or turn is None:
            found, found_turn = self._follow(keys)
            if session is None:
                session = found
            if turn is None:
                turn = found_turn
        ctx = (state, session, keys[-1], turn if turn < 3 else 3)
        ctxs = self._ctx
        for key in keys:
            ctxs[key] = ctx
        self._reqs[req_id] = (keys, ctx, hints, turn)
        while len(self._reqs) > 4096:  # a manager that never calls note_finish
            self._forget(self._reqs.popitem(last=False)[1])
        if len(keys) > 1:
            self._register(keys[-2], session, turn)

    def note_finish(self, req_id: Hashable, now: float) -> None:
        entry = self._reqs.pop(req_id, None)
        if entry is None:
            return
        # The request's blocks leave deepest first (see the module's doc).
        recs, lists = self._rec, self._lists
        for key in reversed(entry[0]):
            rec = recs.get(key)
            if rec is not None and rec[_CLS] != QUEUED:
                entries = lists[rec[_CLS]]
                if key in entries:  # cached, not a ghost
                    entries.move_to_end(key)
        self._forget(entry)

    def note_queue(self, chains: Sequence[Sequence[K]], now: float) -> None:
        recs, lists = self._rec, self._lists
        new: set[K] = set()
        for chain in chains:
            for key in chain:
                rec = recs.get(key)
                if rec is None or key not in lists[rec[_CLS]]:
                    break
                new.add(key)
        # Blocks that left the queue a step ago and were not used since: the queue
        # promised a use that did not come. (A step's grace: an engine may report
        # its queue without the requests it is scheduling now.)
        failed = sum(1 for key in self._leaving if key not in new)
        if failed:
            self.queue_trust *= 0.99 ** failed
        old = self._queued
        left = old - new
        for key in left:
            rec = recs.get(key)
            if rec is not None and rec[_CLS] == QUEUED and key in lists[QUEUED]:
                cls = _classify(rec[_USES], rec[_INFO], rec[_SESSION])
                del lists[QUEUED][key]
                recs[key] = lists[cls][key] = (rec[0], cls, *rec[2:])
        self._leaving = left
        if self.queue_trust >= QUEUE_TRUST:
            for key in new - old:
                rec = recs[key]
                if rec[_CLS] != QUEUED:
                    del lists[rec[_CLS]][key]
                    recs[key] = lists[QUEUED][key] = (rec[0], QUEUED, *rec[2:])
        self._queued = new

    def _used_from_queue(self, key: K) -> None:
        """A block the queue promised was used: the queue earns trust."""
        self._queued.discard(key)
        self._leaving.discard(key)
        self.queue_trust += 0.01 * (1.0 - self.queue_trust)

    def _follow(self, keys: Sequence[K]) -> tuple[Any, int]:
        """The session and turn of a request, from the key chains: it continues the
        session whose last request's last full block it names (deepest first)."""
        ends = self._ends
        for i in range(len(keys) - 1, -1, -1):
            found = ends.get(keys[i])
            if found is not None:
                return found[0], found[1] + 1
        self._sessions += 1
        return ("s", self._sessions), 0

    def _register(self, key: K, session: Any, turn: int) -> None:
        """Remember `key`, the last full block of a request, as where its session
        continues, unless the block belongs to another session or is shared."""
        rec = self._rec.get(key)  # cached or a ghost
        if rec is not None:
            owner = rec[_SESSION]
            if owner is _SHARED or (owner is not None and owner != session):
                return
        ends = self._ends
        ends[key] = (session, turn)
        ends.move_to_end(key)
        if len(ends) > self._ends_limit:
            ends.popitem(last=False)

    def _forget(self, entry: _Noted[K]) -> None:
        keys, ctx = entry[0], entry[1]
        ctxs = self._ctx
        for key in keys:
            if ctxs.get(key) is ctx:
                del ctxs[key]

    def _tick(self, now: float) -> None:
        """Track clock ticks per second, to turn hinted seconds into ticks."""
        mark = self._rate_mark
        if mark is None:
            self._rate_mark = (now, self._clock)
            return
        elapsed = now - mark[0]
        if elapsed >= 1.0 and self._clock - mark[1] >= 64:
            rate = (self._clock - mark[1]) / elapsed
            self._rate = rate if self._rate is None else 0.8 * self._rate + 0.2 * rate
            self._rate_mark = (now, self._clock)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "ghosts": self.ghosts, "evictions": self.evictions,
                "updates": self.updates, "queued": len(self._lists[QUEUED]),
                "queue_trust": round(self.queue_trust, 3)}


def _first_free(entries: Iterable[K], protected: Container[K]) -> K | None:
    for key in entries:
        if key not in protected:
            return key
    return None


def distinct_densities(returns: np.ndarray, expired: np.ndarray,
                       censored: np.ndarray) -> np.ndarray:
    """`densities`, computed once per distinct class: every class that has seen
    nothing yet is the pooled curve alone (most of the 20, most of the time), and
    a class's row depends only on its own samples, so a copy is the same bits.
    Halves a rebuild (~1.4 ms), which a 1000-block store pays on its answer path."""
    first: dict[bytes, int] = {}
    which = [first.setdefault(row.tobytes(), len(first))
             for row in np.concatenate([returns, expired, censored], axis=1)]
    if len(first) == len(which):
        return densities(returns, expired, censored)
    pick = [which.index(j) for j in range(len(first))]  # the first class of each
    return densities(returns[pick], expired[pick], censored[pick])[which]


def densities(returns: np.ndarray, expired: np.ndarray,
              censored: np.ndarray | None = None) -> np.ndarray:
    """Best hit density per class and age bin, from return-time samples.

    `returns[c, k]`: blocks of class c that came back at an age in bin k;
    `expired[c, k]`: blocks that had not come back when forgotten at an age in bin
    k (they never will, as far as the policy can tell); `censored[c, k]`: blocks
    not resolved yet, now of an age in bin k. The hazard of bin k is returns over
    the samples at risk there (Kaplan-Meier), which gives, for a block of age lo_i,
    the probability P_k of a return in bin k >= i and of none by the end of bin j,
    S_j. Holding the block until the end of bin j yields sum_{k=i..j} P_k hits for
    sum_{k=i..j} P_k (mid_k - lo_i) + S_j (hi_j - lo_i) of cache time; the density
    is the best ratio over j."""
    samples = returns + expired
    if censored is not None:
        samples = samples + censored
    at_risk = samples[:, ::-1].cumsum(axis=1)[:, ::-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        hazard = np.where(at_risk > 0, returns / at_risk, 0.0)
    hazard = np.clip(hazard, 0.0, 0.999)
    log_keep = np.cumsum(np.log1p(-hazard), axis=1)
    # survive[c, k]: no return before bin k (from age 0); survive[c, NBINS]: none at all.
    survive = np.exp(np.concatenate([np.zeros((returns.shape[0], 1)), log_keep], axis=1))
    mass = survive[:, :-1] * hazard  # a return in bin k
    q = np.cumsum(mass, axis=1)
    qm = np.cumsum(mass * _MID, axis=1)
    zero = np.zeros((returns.shape[0], 1))
    q0 = np.concatenate([zero, q[:, :-1]], axis=1)
    qm0 = np.concatenate([zero, qm[:, :-1]], axis=1)
    # [c, (i, j)] over the pairs j >= i only (the others would be 0, and every
    # ratio is >= 0): half the work of the full square, the same operations in
    # the same order for each element, so the same bits. Every term is scaled by
    # survive[c, i], which cancels out.
    hits = q[:, _J] - q0[:, _I]
    occupancy = qm[:, _J] - qm0[:, _I]
    occupancy -= _LO_I * hits
    occupancy += survive[:, 1:][:, _J] * _SPAN
    ratio = np.zeros_like(hits)
    np.divide(hits, occupancy, out=ratio, where=occupancy > 0)
    return np.maximum.reduceat(ratio, _ROWS, axis=1)
