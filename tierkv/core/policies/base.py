"""The eviction policy interface of the CPU tier.

A policy orders the *evictable candidates* of a tier: the manager inserts a key
when its block becomes ready and removes it when the block is freed. The policy
knows nothing of reader counts or write state; the manager passes what may not be
evicted as `protected`. Every method runs on the owner's single thread.

Engine hints. Besides the key operations, the manager tells the policy what the
engine knows about requests, through three methods that default to doing nothing
(so a policy that ignores hints needs no code, and a manager that has no hints
need not call them). Each takes an explicit `now` in seconds on a clock that only
has to be monotonic (trace time in a replay, `time.monotonic()` in the broker):

* `note_request(req_id, keys, hints, now)`: a request was looked up with its full
  key chain (prefix order, as sent by the engine) and its `RequestHints` (None if
  the engine sent none). Call it on every lookup that names a request, *before* the
  loads and stores it leads to, with or without hints: the chain alone tells a
  policy which block ends a request and which session it continues. Calling it
  again for the same `req_id` replaces the earlier call: do so when the request's
  chain grows (the keys of blocks stored for it later, decode blocks included),
  since a policy classes a block when it is stored or used, from the last chain
  that named it.
* `note_finish(req_id, now)`: the request is done (the engine's `finish`), after
  its stores were prepared; blocks stored after it get no context from it.
* `note_queue(chains, now)`: once per scheduler step, the prefix key chains of the
  requests waiting in the engine's queue (the first to be scheduled first), up to a
  configured number, with or without the requests being scheduled in this step.
  Each call replaces the previous one; an empty list means the queue is empty.

`PrimaryTier` passes all three through (its `note_queue` also returns the keys of
queued requests that it does not hold: candidates to promote from slower tiers).
None of them is a use of a key (`touch` is), and none may fail because of what a
hint says.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from tierkv.core.policies.hints import RequestHints

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class CachePolicy(ABC, Generic[K, V]):
    """Maps key -> value (a block id) and chooses victims. O(1) amortized per call."""

    name: str = "?"

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def get(self, key: K) -> V | None:
        """The value of `key`, or None. Does not count as a use."""

    @abstractmethod
    def insert(self, key: K, value: V) -> None:
        """Add a key that is not present. Inserting counts as its first use."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """Forget `key` (freed outside the policy). Unknown keys are ignored."""

    @abstractmethod
    def touch(self, keys: Iterable[K]) -> None:
        """Mark keys as used now, in order (the last is the most recent).
        Unknown keys are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        """Remove and return `n` victims, none of them in `protected`.

        All-or-nothing: if `n` victims cannot be found, return None and change
        nothing."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def stats(self) -> dict[str, Any]:
        return {"policy": self.name, "entries": len(self)}

    # -- engine hints (advice; the defaults ignore them) --------------------------

    def note_request(self, req_id: Hashable, keys: Sequence[K], hints: RequestHints | None,
                     now: float) -> None:
        """A request was looked up with its whole key chain and the engine's hints.
        Called at every lookup: a request that waits is noted again at each step, and
        must count as the same request."""

    def note_finish(self, req_id: Hashable, now: float) -> None:
        """The request `req_id` finished; its hints no longer apply to new stores."""

    def note_queue(self, chains: Sequence[Sequence[K]], now: float) -> None:
        """The key chains of the requests waiting in the engine's queue, this step."""
