"""Rows reserved ahead: a store takes its rows here, with no round trip in the step.

vLLM's own manager allocates a store's CPU blocks in process; a tierkv reservation
is a round trip to the broker, and vLLM asks for one per request that completes a
block (at 256 running requests, several a step, each on the scheduler thread). So
the engine keeps rows reserved at the broker under keys of its own (*spares*: a
random prefix no namespace makes, and a serial number), and `prepare_store` hands
them out at once. When the store ends, `commit_as` tells the broker what each row
was written with: the row becomes that key's block, or is freed if the key was
there already (another engine stored it meanwhile: the same bytes).

How many: twice the most rows a step took lately (`SpareRows.wanted`), within
`most`; the refill rides the step's end-of-step round trip. Spares kept unused for
`RENEW_S` are reserved again (which renews them: the broker withdraws a reservation
left past `broker.reservation_s`, 60 s by default, and a spare written after that is
freed at its commit, not stored); an engine idle so long that its spares went
`STALE_S` without renewal lets them go instead of writing into them. A broker that
restarted (another region, in any reply: `BrokerLink.region`) voids them all: they
are forgotten, never committed to the new broker, which knows nothing of them; and
spares are handed out only while the broker answered within `TRUST_S`, so the first
store after a silence reserves rows of its own, whose reply names the region. The
broker counts spares against the engine's share like any reservation.

A store short of spares takes what there are and reserves the rest: on a node whose
rows are all reserved or pinned (requests admitted together), the spares are the
room it has. A store that got no rows waits in vLLM's queue of stores (it offers them
again each step while the request runs); `want` raises the demand by what those
waiting stores lack, asked for in the end-of-step round trip even within a
refusal's back-off, and no more than that while the node is tight, so that the
next offer finds them.

Runs on the scheduler thread, under the manager's lock.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

RENEW_S = 20.0  # well inside the broker's default reservation deadline (60 s)
STALE_S = 40.0  # not renewed this long: perhaps withdrawn, never used
REFUSED_S = 1.0  # the broker gave no rows: ask again after this long
TRUST_S = 1.0  # no reply for this long: the broker may have restarted since
DECAY_STEPS = 200  # steps after which the demand seen falls by half
PREFIX = b"\xffspare"  # no namespace starts so (they are hashes; the odds are 2^-48)


@dataclass(slots=True)
class Spare:
    key: bytes
    row: int
    since: float  # when it was last reserved (or renewed)


class SpareRows:
    """The engine's spare rows (see the module docstring)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.region = ""
        self._free: dict[bytes, Spare] = {}  # by key, oldest (least renewed) first
        self._stale: list[bytes] = []  # to let go of
        self._asked = 0  # rows asked for in a round trip not answered yet
        self._peak = 0.0  # the most rows a step took lately, decaying
        self._taken = 0  # rows taken this step
        self._steps = 0
        self._refused_until = 0.0  # the broker had no room: ask again after this
        self._waiting = 0  # rows stores that got none are short of (`want`)
        self._prefix = PREFIX + os.urandom(10)
        self._serial = itertools.count()

    def __len__(self) -> int:
        return len(self._free)

    def take(self, n: int, trusted: bool = True) -> list[Spare]:
        """Up to `n` spares for one store job, oldest first (fewer if there are not so
        many: the job reserves the rest); none if not `trusted` (the broker has been
        silent: it may have restarted), though the demand counts all the same, or an
        engine whose broker is often quiet would never reserve ahead. Spares not
        renewed for `STALE_S` (an engine idle that long renews nothing) may have been
        withdrawn by the broker: they are let go of (`take_stale`), not used."""
        self._taken += n  # the demand, whether served here or not
        if not trusted:
            return []
        free = self._free
        now = self.now()
        while free:
            oldest = next(iter(free.values()))
            if now - oldest.since <= STALE_S:
                break
            self._stale.append(free.pop(oldest.key).key)
        return [free.pop(k) for k in list(itertools.islice(free, n))]

    def give_back(self, spares: list[Spare]) -> None:
        """Spares `take` gave to a job that was not made: free again, first in line
        (they are the oldest)."""
        if spares:
            self._free = {**{s.key: s for s in spares}, **self._free}

    def want(self, rows: int) -> None:
        """Stores waiting for rows lack `rows` in all (the manager's retry list): the
        next round trip asks for what the free spares do not cover."""
        self._waiting = rows

    def take_stale(self) -> list[bytes]:
        stale, self._stale = self._stale, []
        return stale

    def step_ended(self) -> None:
        """Count the step's takings into the demand."""
        self._steps += 1
        if self._steps % DECAY_STEPS == 0:
            self._peak /= 2
        self._peak = max(self._peak, float(self._taken))
        self._taken = 0

    @property
    def _wanted(self) -> int:
        """Spares to hold: twice the most a step took lately (at least what waiting
        stores lack), within `most`."""
        return min(self.most, max(int(2 * self._peak), self._waiting))

    def short(self) -> bool:
        """Fewer spares than the demand (or some due for renewal, or to let go of):
        worth a round trip."""
        if self._asked:
            return False
        oldest = next(iter(self._free.values()), None)
        return (len(self._free) < self._wanted // 2 or bool(self._stale)
                or len(self._free) < self._waiting
                or (oldest is not None and self.now() - oldest.since > RENEW_S))

    def to_reserve(self, now: float) -> tuple[list[bytes], int]:
        """Keys to reserve in the next round trip: spares due for renewal, then new
        ones up to the demand; and how many of them are new."""
        renew = [s.key for s in itertools.takewhile(lambda s: now - s.since > RENEW_S,
                                                     self._free.values())]
        lacking = self._waiting - len(self._free) - self._asked
        if lacking > 0:  # only what waiting stores lack: a tight node may have that
            wanted = min(lacking, self.most)
        elif now < self._refused_until:
            return renew, 0
        else:
            wanted = self._wanted - len(self._free) - self._asked
        new = [self._prefix + next(self._serial).to_bytes(8, "big")
               for _ in range(max(0, wanted))]
        self._asked += len(new)
        return renew + new, len(new)

    def surplus(self) -> list[bytes]:
        """Spares beyond the demand, to let go of (the node's rows are shared)."""
        extra = len(self._free) + self._asked - self._wanted
        if extra <= len(self._free) // 4 or extra <= 0:
            return []  # not worth a round trip's work yet
        keys = list(itertools.islice(self._free, extra))
        for key in keys:
            del self._free[key]
        return keys

    def reserved(self, keys: list[bytes], new: int, rows: list[int] | None, region: str,
                 now: float) -> None:
        """The reply to `to_reserve`'s keys (the last `new` of them new; rows None:
        refused, nothing reserved)."""
        self._asked -= new
        if rows is not None and region != self.region:
            self.drop_all()
            self.region = region
        renewed, fresh = keys[:len(keys) - new], keys[len(keys) - new:]
        for key in renewed:  # a spare taken meanwhile is a store's now: nothing to do
            spare = self._free.pop(key, None) if rows is not None else None
            if spare is not None:  # to the end: the free spares stay oldest first
                spare.since = now
                self._free[key] = spare
        got = 0
        for key, row in zip(fresh, rows[len(renewed):], strict=True) if rows else ():
            if row >= 0:  # -1: not admitted (a node with a reuse filter)
                self._free[key] = Spare(key, row, now)
                got += 1
        if new and not got:
            self._refused_until = now + REFUSED_S

    def drop_all(self) -> list[bytes]:
        """Forget every spare (the broker restarted, or the engine stops); their keys."""
        keys = list(self._free)
        self._free.clear()
        return keys

    def new_region(self, region: str) -> None:
        """A reply named `region`: if it is another broker's than the spares', they
        are void (that broker is gone; the new one never reserved them)."""
        if region and region != self.region:
            self.drop_all()
            self.region = region

    @staticmethod
    def now() -> float:
        return time.monotonic()


@dataclass(slots=True)
class WaitingStore:
    blocks: int  # the blocks of its last offer
    why: str  # why that offer got no rows


class WaitingStores:
    """Stores that got no rows in their step, by request: vLLM offers them again each
    step while the request runs (its blocks are in vLLM's cache), and the manager
    reserves ahead for them (`SpareRows.want`). A request that ends with its store
    still here had it dropped for good: the manager counts and logs that. Bounded by
    vLLM's running requests; past `MOST` the oldest is forgotten (not counted: vLLM
    may still store it)."""

    MOST = 4096

    def __init__(self) -> None:
        self._by_request: dict[str, WaitingStore] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._by_request

    def refused(self, req_id: str, blocks: int, why: str) -> None:
        self._by_request.pop(req_id, None)  # to the end: the oldest stay first
        self._by_request[req_id] = WaitingStore(blocks, why)
        while len(self._by_request) > self.MOST:
            del self._by_request[next(iter(self._by_request))]

    def stored(self, req_id: str) -> None:
        self._by_request.pop(req_id, None)

    def ended(self, req_id: str) -> WaitingStore | None:
        """The request ended: its store, if it still waited (then dropped for good)."""
        return self._by_request.pop(req_id, None)

    def rows(self) -> int:
        """The rows the waiting stores need in all."""
        return sum(w.blocks for w in self._by_request.values())
