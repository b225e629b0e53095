"""Python's cyclic garbage collector in the broker, kept from pausing it in
proportion to the node's size.

A full collection walks every live object, and the broker holds records per block,
per request and per engine: its pause grows with the node (measured: 22 ms of one
turn with four engines on a node, several times a step). Those records are freed by
reference counting; cycles are rare (a peer's state, an error's traceback). So the
objects that survive a full collection are frozen (`gc.freeze`): later collections
walk only what was made since. What a cycle among frozen objects holds would never be
freed, so every `RETHAW_S` seconds they are thawed and collected once (one full pause
then, not at every full collection).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

RETHAW_S = 600.0


class Collector:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 rethaw_s: float = RETHAW_S) -> None:
        self._clock = clock
        self._rethaw_s = rethaw_s
        self._thawed_at = clock()
        self._full_done = False
        self.freezes = 0
        self.rethaws = 0

    def start(self) -> None:
        """What start-up made lives as long as the broker: frozen now."""
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._on_collection)

    def stop(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info.get("generation") == 2:
            self._full_done = True  # frozen after the turn, not inside the collection

    def after_turn(self) -> None:
        """Freeze the survivors of a full collection that ran in the last turn; thaw
        and collect everything once every `rethaw_s`."""
        if self._clock() - self._thawed_at >= self._rethaw_s:
            self._thawed_at = self._clock()
            gc.unfreeze()
            gc.collect()
            self.rethaws += 1
            self._full_done = True
        if self._full_done:
            self._full_done = False
            gc.freeze()
            self.freezes += 1

    def stats(self) -> dict[str, int]:
        return {"frozen_objects": gc.get_freeze_count(), "freezes": self.freezes,
                "rethaws": self.rethaws}
