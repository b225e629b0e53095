"""What hit density (`tierkv.core.policies.density`) knows of a block: its class
(the request's session and turn, the engine's hint, the waiting queue), the record
each block keeps, and the engine's notes that set them (`note_request`,
`note_finish`, `note_queue`). Apart from the eviction and learning code because
classing a block is one concern and choosing a victim another; the policy's doc
says what each class means.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Generic, TypeVar

from tierkv.core.policies.hints import RequestHints

K = TypeVar("K", bound=Hashable)
#: A request as noted: its keys, their context (hint state, session, last key, turn
#: bucket), its hints and its turn.
_Noted = tuple[Sequence[K], tuple[int, Any, Any, int], RequestHints | None, int]

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

QUEUE_TRUST = 0.25  # below it, the queue's protection is off


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


class RequestNotes(Generic[K]):
    """The engine's notes of requests, sessions and the queue, for `HitDensityPolicy`,
    whose state (records, class lists, clock) they read and whose `__init__` sets
    the attributes named below. Called on the manager's thread; never blocks."""

    capacity: int
    _rec: dict[K, tuple[Any, ...]]
    _lists: list[OrderedDict[K, tuple[Any, ...]]]
    _clock: int
    _ctx: dict[K, tuple[int, Any, Any, int]]
    _reqs: OrderedDict[Hashable, _Noted[K]]
    _ends: OrderedDict[K, tuple[Any, int]]
    _ends_limit: int
    _sessions: int
    _rate: float | None
    _rate_mark: tuple[float, int] | None
    _queued: set[K]
    _leaving: set[K]
    queue_trust: float

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
