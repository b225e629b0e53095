"""The demo's time series: where the blocks of each window of completed requests
came from.

A window is at least `size` completed requests, closed at the end of the engine
step that completed the last of them (several requests complete in one step, so a
window may hold a few more). Each point says what it covers (its start and end
time, requests and blocks), and its shares use the same accounting as the report
(`Totals.served` by origin, plus recomputed), so a window's shares sum to 1. A
window with no completed request is never made: every point has data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierkv.demo.engine import Totals


@dataclass(frozen=True)
class Snapshot:
    t: float
    requests: int
    blocks: int
    served: dict[str, int]
    recomputed: int
    bytes: int

    @classmethod
    def of(cls, totals: Totals, t: float) -> Snapshot:
        return cls(t, totals.requests, totals.blocks, dict(totals.served), totals.recomputed,
                   totals.bytes_loaded + totals.bytes_stored)


@dataclass
class Windows:
    size: int
    last: Snapshot
    points: list[dict[str, Any]] = field(default_factory=list)

    def update(self, totals: Totals, t: float, final: bool = False) -> dict[str, Any] | None:
        """Close a window if `size` requests completed since the last one (or, when
        `final`, if any did); returns the new point, or None."""
        done = totals.requests - self.last.requests
        if done <= 0 or (done < self.size and not final):
            return None
        now = Snapshot.of(totals, t)
        if now.blocks == self.last.blocks:
            return None  # requests without blocks: no share to show yet
        point = window(self.last, now)
        self.points.append(point)
        self.last = now
        return point


def window(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    blocks = b.blocks - a.blocks
    served = {n: (b.served[n] - a.served.get(n, 0)) / blocks for n in b.served}
    return {
        "t0": a.t, "t1": b.t, "requests": b.requests - a.requests, "blocks": blocks,
        "served": served, "recomputed": (b.recomputed - a.recomputed) / blocks,
        "gbps": (b.bytes - a.bytes) / max(1e-9, b.t - a.t) / 1e9,
    }
