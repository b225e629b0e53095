"""A shared tier's view of what other nodes store: its listing, refreshed in the
background and reported to the broker as more inventory.

Several nodes write one bucket. Asking the store "do you hold this key?" at lookup
time (a HEAD per key) put an S3 round trip on the scheduler's critical path (the
demo's lookup p50: 81 ms); listing the namespace every `refresh_s` on a thread of
the tier process, and reporting only the keys the broker has not heard of, keeps
it off: a node finds another's blocks within one refresh interval, and a key it
has not been told of is a miss at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from tierkv.core.keys import OffloadKey
from tierkv.tiers.backend import TierBackend
from tierkv.wire.wakeup import Wakeup

log = logging.getLogger("tierkv.tier")


class Refresher:
    def __init__(self, backend: TierBackend, refresh_s: float, known: Iterable[OffloadKey],
                 wakeup: Wakeup) -> None:
        self.backend = backend
        self.refresh_s = refresh_s
        self.wakeup = wakeup
        self._known = set(known)  # what the broker has been told
        self._new: list[OffloadKey] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="listing", daemon=True)
        self._thread.start()

    def take(self) -> list[OffloadKey]:
        """Keys found since the last call (the serve loop reports them)."""
        with self._lock:
            new, self._new = self._new, []
        return new

    def reported(self, keys: Iterable[OffloadKey]) -> None:
        """This process stored these itself: the broker knows them already."""
        with self._lock:
            self._known.update(keys)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.refresh_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                listed = self.backend.inventory()
            except Exception as e:  # an endpoint down: the next round tries again
                log.debug("listing failed: %s", e)
                continue
            with self._lock:
                new = [k for k in listed if k not in self._known]
                self._known.update(new)
                self._new.extend(new)
            if new:
                self.wakeup.notify()
