"""What the broker knows a secondary tier holds.

The index is filled from the tier's inventory at hello, grows with each store the
tier reports and shrinks with its evictions and failed loads. A shared tier (S3)
may also hold keys other nodes stored. Those are found by the tier's own listing,
refreshed in the background and reported as more inventory (`refreshed`): then an
unknown key is a miss and no lookup waits. Without a listing, an unknown key is
queued for an asynchronous `exists` check, looks unknown meanwhile (the manager
checks only the first such key of a request), and a negative answer is cached for
`negative_ttl` seconds so a miss does not cost a request every step.

`arrivals` counts the keys the index learned other than by the node's own stores
(inventory, found by a check): with the node's stores, what can turn a key a
client was told is a miss into a hit (see `TieringManager.arrivals`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from tierkv.core.keys import OffloadKey


class TierIndex:
    def __init__(
        self,
        shared: bool = False,
        negative_ttl: float = 2.0,
        max_negative: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shared = shared
        self.negative_ttl = negative_ttl
        self.max_negative = max_negative
        self._clock = clock
        self.present: set[OffloadKey] = set()
        # The tier reports what other nodes store (a background listing): what it
        # has not reported is not there, and no lookup waits on an existence check.
        self.refreshed = False
        self._negative: OrderedDict[OffloadKey, float] = OrderedDict()  # key -> expiry
        self._checking: set[OffloadKey] = set()
        self._to_check: list[OffloadKey] = []
        self._learned = 0  # keys it came to hold other than by the node's stores

    def lookup(self, key: OffloadKey) -> bool | None:
        """True/False, or None while an existence check is queued or running."""
        if key in self.present:
            return True
        if not self.shared or self.refreshed:
            return False  # a refreshed index knows what the tier holds
        if key in self._checking:
            return None
        expiry = self._negative.get(key)
        if expiry is not None:
            if expiry > self._clock():
                return False
            del self._negative[key]
        self._checking.add(key)
        self._to_check.append(key)
        return None

    def take_checks(self) -> list[OffloadKey]:
        """Keys whose existence the owner should now ask the tier about."""
        keys, self._to_check = self._to_check, []
        return keys

    def checked(self, present: Iterable[OffloadKey], asked: Iterable[OffloadKey]) -> None:
        """Apply an exists answer: `present` among the `asked` keys; the rest are
        misses (a failed check is a miss too, never a hang)."""
        found = set(present)
        for key in asked:
            self._checking.discard(key)
            if key in found:
                self._learned += key not in self.present
                self.present.add(key)
            else:
                self._mark_negative(key)

    def add(self, keys: Iterable[OffloadKey]) -> None:
        """Keys the node stored into the tier."""
        for key in keys:
            self.present.add(key)
            self._negative.pop(key, None)

    def learn(self, keys: Iterable[OffloadKey]) -> None:
        """Keys the tier reports holding that the node did not store there (its
        inventory: a tier process's own at hello, other nodes' stores in a shared
        tier's listing)."""
        keys = [k for k in keys if k not in self.present]
        self._learned += len(keys)
        self.add(keys)

    @property
    def arrivals(self) -> int | None:
        """Keys learned so far (`learn`, or found by a check); None for a shared tier
        without a listing, where another node's store is found only by asking (a key
        answered a miss may be there unseen)."""
        return None if self.shared and not self.refreshed else self._learned

    def discard(self, keys: Iterable[OffloadKey]) -> None:
        """The tier no longer holds the keys (evicted, failed to load, deleted)."""
        for key in keys:
            self.present.discard(key)
            if self.shared:
                self._mark_negative(key)

    def clear_pending_checks(self) -> list[OffloadKey]:
        """Forget checks in flight (the tier died); returns them."""
        keys = list(self._checking)
        self._checking.clear()
        self._to_check.clear()
        return keys

    def _mark_negative(self, key: OffloadKey) -> None:
        now = self._clock()
        self._negative[key] = now + self.negative_ttl
        self._negative.move_to_end(key)
        # Expired answers must leave without a second lookup, or every miss of a
        # shared tier stays until `max_negative` (~4 KB per request on the Mooncake
        # trace: the soak saw the broker grow for hours). A constant ttl keeps the
        # oldest first, so they leave from the front.
        while self._negative and next(iter(self._negative.values())) <= now:
            self._negative.popitem(last=False)
        while len(self._negative) > self.max_negative:
            self._negative.popitem(last=False)

    def __len__(self) -> int:
        return len(self.present)

    @property
    def checking(self) -> int:
        return len(self._checking)
