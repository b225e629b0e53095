"""The recency bookkeeping every bounded tier backend keeps: its keys oldest use
first, and the keys it evicted that the broker has not been told of yet.

A backend's I/O threads and the tier process's main thread both reach it, so every
method runs under the backend's own lock (passed in, held by the caller for the
`put`/`evict`/`pop` family, taken here for the calls the runner makes on its own).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

from tierkv.core.keys import OffloadKey

V = TypeVar("V")


class LRUIndex(OrderedDict[OffloadKey, V], Generic[V]):
    """key -> the backend's record of it, oldest use first."""

    def __init__(self, lock: threading.Lock | threading.RLock) -> None:
        super().__init__()
        self.lock = lock
        self._evicted: dict[OffloadKey, None] = {}

    def put(self, key: OffloadKey, value: V) -> None:
        """Hold `key` (newest); a key stored again is no longer reported as evicted.
        Caller holds the lock."""
        self[key] = value
        self.move_to_end(key)
        self._evicted.pop(key, None)

    def evict(self, key: OffloadKey) -> V:
        """Drop `key` to make room and remember to report it. Caller holds the lock."""
        value = self.pop(key)
        self._evicted[key] = None
        return value

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """The keys were used (promoted): they move to the newest end."""
        with self.lock:
            for key in keys:
                if key in self:
                    self.move_to_end(key)

    def take_evicted(self) -> list[OffloadKey]:
        """Keys evicted since the last call, each once."""
        with self.lock:
            evicted, self._evicted = list(self._evicted), {}
        return evicted
