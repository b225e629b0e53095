"""Which keys are a miss in a tier because their promotion from it failed.

A failed promotion must never turn into an endless retry. A key the tier lost (not
found, corrupt) is a miss there until it is stored again. Any other failure (a dead
process, a timeout, an endpoint down) says the tier is unwell, not the key: its
keys miss for a back-off per tier that doubles while its promotions keep failing
(once per spell, not per key) and resets on a promotion that lands.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable

from tierkv.core.errors import LOST, ErrorCode
from tierkv.core.keys import OffloadKey

PROMOTION_BACKOFF_S = 1.0  # a key whose promotion failed (not lost) waits this long first
PROMOTION_BACKOFF_MAX_S = 60.0  # and at most this long, while its tier keeps failing


class PromotionBackoff:
    def __init__(self, tiers: int, clock: Callable[[], float],
                 first_s: float = PROMOTION_BACKOFF_S, max_s: float = PROMOTION_BACKOFF_MAX_S,
                 key_memory: int = 100_000) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._clock = clock
        self._key_memory = key_memory
        # (tier, key) -> until when it is a miss there (inf: until stored again).
        self._failed: OrderedDict[tuple[int, OffloadKey], float] = OrderedDict()
        self._backoff = [0.0] * tiers  # per tier: the current back-off
        self._until = [0.0] * tiers  # and when its spell ends

    def __bool__(self) -> bool:
        return bool(self._failed)

    def failed(self, t: int, keys: Iterable[OffloadKey], code: ErrorCode | None) -> None:
        if code in LOST:
            until = math.inf
        else:
            now = self._clock()
            if now >= self._until[t]:
                self._backoff[t] = min(max(2 * self._backoff[t], self.first_s), self.max_s)
                self._until[t] = now + self._backoff[t]
            until = self._until[t]
        failed = self._failed
        for key in keys:
            failed[(t, key)] = until
            failed.move_to_end((t, key))
        while len(failed) > self._key_memory:
            failed.popitem(last=False)

    def served(self, t: int) -> None:
        """A promotion from tier `t` landed: it serves again."""
        self._backoff[t] = 0.0

    def stored(self, t: int, keys: Iterable[OffloadKey]) -> None:
        """The keys were stored into tier `t` again: no longer lost there."""
        if self._failed:
            for key in keys:
                self._failed.pop((t, key), None)

    def backing_off(self, t: int, key: OffloadKey) -> bool:
        """Is `key` a miss in tier `t` because its promotion from there failed?"""
        until = self._failed.get((t, key))
        if until is None:
            return False
        if until > self._clock():
            return True
        del self._failed[(t, key)]  # the back-off is over: the tier may be asked again
        return False
