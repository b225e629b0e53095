"""How long the broker's loop is busy per turn: the figure that says whether the
broker is ever the reason an engine's step waits.

A turn is one piece of work the loop does without reading anything new: handling one
message, or one tick. An engine's request that arrives meanwhile waits for the turn
to end (and for the messages queued ahead of it, one turn each), so the longest turn
is what a step may wait behind the broker's own work. It is counted in the loop
thread's CPU time, not wall time: on a host with more busy processes than cores the
wall time is the kernel's scheduling, not the broker's work. Kept per second for the
last `RECENT_S` seconds as well as since start, so that a reader sees the recent
worst rather than one from start-up.
"""

from __future__ import annotations

from collections import deque
from typing import Any

RECENT_S = 10


class Turns:
    def __init__(self, recent_s: int = RECENT_S) -> None:
        self.count = 0
        self.busy_s = 0.0
        self.longest_s = 0.0
        self._seconds: deque[tuple[int, float]] = deque(maxlen=recent_s)  # (second, longest)
        self._recent_s = recent_s

    def record(self, ended: float, cpu_s: float) -> None:
        """A turn that ended at `ended` (the monotonic clock) and took `cpu_s` of the
        thread's CPU time."""
        seconds = cpu_s
        self.count += 1
        self.busy_s += seconds
        self.longest_s = max(self.longest_s, seconds)
        second = int(ended)
        if self._seconds and self._seconds[-1][0] == second:
            if seconds > self._seconds[-1][1]:
                self._seconds[-1] = (second, seconds)
        else:
            self._seconds.append((second, seconds))

    def recent_longest(self, now: float) -> float:
        oldest = int(now) - self._recent_s + 1
        return max((s for second, s in self._seconds if second >= oldest), default=0.0)

    def stats(self, now: float) -> dict[str, Any]:
        return {"count": self.count, "busy_s": round(self.busy_s, 6),
                "longest_ms": round(self.longest_s * 1e3, 3),
                "recent_longest_ms": round(self.recent_longest(now) * 1e3, 3)}
