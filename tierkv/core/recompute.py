"""What lookups left to recompute, and how long a request may wait for the rest.

Two small records of the load-or-recompute rule (`tierkv.core.costs`), kept by the
tiering manager:

* `Skipped`: per tier, the keys a lookup did not promote because loading them was
  expected to take longer than recomputing them; counted, and the most recent
  remembered (how often each was skipped: a reuse signal) for the promotions made
  while the tier is idle, so a slow tier still feeds the CPU tier.
* `WaitBounds`: per request, when the promotions it was told to wait for stop being
  worth waiting for (set at its first `pending` answer, from its recompute time).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from tierkv.core.keys import OffloadKey

SKIPPED_KEY_MEMORY = 4096  # skipped keys remembered per tier
WAIT_MEMORY = 1 << 16  # requests whose wait is bounded, remembered at most


class Skipped:
    def __init__(self, tiers: int, memory: int = SKIPPED_KEY_MEMORY) -> None:
        self.counts = [0] * tiers  # per tier: keys skipped, ever
        self._keys: list[OrderedDict[OffloadKey, int]] = [OrderedDict() for _ in range(tiers)]
        self._memory = memory

    def note(self, run: Iterable[tuple[OffloadKey, int]]) -> tuple[int, ...]:
        """Keys of a run left to recompute, each with the tier that holds it (< 0:
        none, it is in the CPU tier). Returns the count per tier (empty: none)."""
        counts = [0] * len(self.counts)
        for key, tier in run:
            if tier < 0:
                continue
            counts[tier] += 1
            keys = self._keys[tier]
            keys[key] = keys.pop(key, 0) + 1
            if len(keys) > self._memory:
                keys.popitem(last=False)
        if not any(counts):
            return ()
        for t, n in enumerate(counts):
            self.counts[t] += n
        return tuple(counts)

    def any(self, tier: int) -> bool:
        return bool(self._keys[tier])

    def newest(self, tier: int, n: int) -> list[tuple[OffloadKey, int]]:
        """Up to `n` of the most recently skipped keys and how often each was."""
        keys = self._keys[tier]
        return [(key, keys[key]) for key in itertools.islice(reversed(keys), n)]

    def forget(self, tier: int, key: OffloadKey) -> None:
        self._keys[tier].pop(key, None)


class WaitBounds:
    def __init__(self, memory: int = WAIT_MEMORY) -> None:
        self._until: OrderedDict[Hashable, float] = OrderedDict()
        self._memory = memory

    def past(self, req_id: Hashable, now: float, bound_s: float) -> bool:
        """The request is told to wait: is it past its bound (set now if it has none)?"""
        until = self._until.get(req_id)
        if until is None:
            self._until[req_id] = now + bound_s
            while len(self._until) > self._memory:
                self._until.popitem(last=False)
            return False
        return now > until

    def end(self, req_id: Hashable) -> bool:
        """The request waits no more; True if it had been waiting."""
        return self._until.pop(req_id, None) is not None
