"""What the broker knows a secondary tier holds.

The index is filled from the tier's inventory at hello, grows with each store the
tier reports and shrinks with its evictions and failed loads. A shared tier (S3)
may also hold keys other nodes stored. Those are found by the tier's own listing,
refreshed in the background and reported as more inventory (`refreshed`): then an
unknown key is a miss and no lookup waits. Without a listing, an unknown key is
queued for an asynchronous `exists` check, looks unknown meanwhile (the manager
checks only the first such key of a request), and a negative answer is cached for
`negative_ttl` seconds so a miss does not cost a request every step.
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
                self.present.add(key)
            else:
                self._mark_negative(key)

    def add(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self.present.add(key)
            self._negative.pop(key, None)

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
