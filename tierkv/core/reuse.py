"""Admission by reuse: store a block only once it has been asked for before.

Most blocks of a workload are looked up once and never again; storing them evicts
blocks that would have been reused. The filter counts lookups per key in a
bounded LRU table and admits a key to the CPU tier once it reached `threshold`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any


class ReuseFilter:
    def __init__(self, threshold: int = 2, max_entries: int = 1 << 20) -> None:
        if threshold < 1:
            raise ValueError(f"reuse threshold must be >= 1, got {threshold}")
        if max_entries < 1:
            raise ValueError(f"reuse max_entries must be >= 1, got {max_entries}")
        self.threshold = threshold
        self.max_entries = max_entries
        self._counts: OrderedDict[Hashable, int] = OrderedDict()
        self.skipped = 0
        self.admitted = 0

    def record(self, keys: Iterable[Hashable]) -> None:
        """Count one lookup of each key (oldest entries fall out of the table)."""
        counts = self._counts
        for key in keys:
            n = counts.pop(key, 0)
            counts[key] = n + 1
        while len(counts) > self.max_entries:
            counts.popitem(last=False)

    def admits(self, key: Hashable) -> bool:
        return self._counts.get(key, 0) >= self.threshold

    def filter(self, keys: list[Any]) -> list[Any]:
        """The keys that may be stored, in order; the rest are counted as skipped."""
        admitted = [key for key in keys if self.admits(key)]
        self.admitted += len(admitted)
        self.skipped += len(keys) - len(admitted)
        return admitted

    def __len__(self) -> int:
        return len(self._counts)

    def stats(self) -> dict[str, Any]:
        return {
            "reuse_threshold": self.threshold,
            "reuse_tracked": len(self._counts),
            "reuse_admitted": self.admitted,
            "reuse_skipped": self.skipped,
        }
