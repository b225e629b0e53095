"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

T1 holds keys used once, T2 keys used again; B1/B2 remember the keys recently
evicted from each (ghosts, no blocks). A ghost hit tells which list was too small
and moves the target size `p` of T1 towards it. A one-pass scan only churns T1, so
a re-used working set in T2 survives it, which LRU cannot do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable, Iterator
from typing import Any, TypeVar

from tierkv.core.policies.base import CachePolicy

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ARCPolicy(CachePolicy[K, V]):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[K, V] = OrderedDict()
        self.t2: OrderedDict[K, V] = OrderedDict()
        self.b1: OrderedDict[K, Any] = OrderedDict()  # ghosts: no blocks, only keys
        self.b2: OrderedDict[K, Any] = OrderedDict()
        self.p = 0.0  # target size of T1

    def get(self, key: K) -> V | None:
        value = self.t1.get(key)
        return value if value is not None else self.t2.get(key)

    def insert(self, key: K, value: V) -> None:
        if key in self.t1 or key in self.t2:
            raise KeyError(f"key already present: {key!r}")
        c = self.capacity
        if key in self.b1:
            # Evicted from T1 too early: recency deserves more room.
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = value
        elif key in self.b2:
            # Evicted from T2 too early: frequency deserves more room.
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = value
        else:
            self.t1[key] = value
        self._trim_ghosts()

    def remove(self, key: K) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys: Iterable[K]) -> None:
        t1, t2 = self.t1, self.t2
        for key in keys:
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                t2[key] = t1.pop(key)

    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        if n <= 0:
            return []
        chosen = self._choose_one(protected) if n == 1 else None
        if chosen is None:
            chosen = self._choose(n, protected)
            if chosen is None:
                return None
        victims = [(key, self._demote(from_t1, key)) for from_t1, key in chosen]
        self._trim_ghosts()
        return victims

    def _choose_one(self, protected: Container[K]) -> list[tuple[bool, K]] | None:
        """The common case, O(1): the head of the list `_choose` would start from is
        evictable. None sends the caller to the general walk."""
        from_t1 = bool(self.t1) and (len(self.t1) > self.p or not self.t2)
        entries = self.t1 if from_t1 else self.t2
        if not entries:
            return None
        key = next(iter(entries))
        return None if key in protected else [(from_t1, key)]

    def _choose(self, n: int, protected: Container[K]) -> list[tuple[bool, K]] | None:
        """Pick `n` victims without changing anything: T1's LRU end while T1 is above
        its target, else T2's; the other list when one runs out of candidates.
        The lists are walked lazily, so the usual cost is O(n)."""
        from_t1 = _unprotected(self.t1, protected)
        from_t2 = _unprotected(self.t2, protected)
        next1, next2 = next(from_t1, None), next(from_t2, None)
        t1_size = len(self.t1)
        chosen: list[tuple[bool, K]] = []
        while len(chosen) < n:
            if next1 is not None and (t1_size > self.p or next2 is None):
                chosen.append((True, next1))
                t1_size -= 1
                next1 = next(from_t1, None)
            elif next2 is not None:
                chosen.append((False, next2))
                next2 = next(from_t2, None)
            else:
                return None
        return chosen

    def _demote(self, from_t1: bool, key: K) -> V:
        """Move a victim to its ghost list; returns its value."""
        if from_t1:
            self.b1[key] = None
            return self.t1.pop(key)
        self.b2[key] = None
        return self.t2.pop(key)

    def _trim_ghosts(self) -> None:
        c = self.capacity
        t1, b1, b2 = self.t1, self.b1, self.b2
        while b1 and len(t1) + len(b1) > c:
            b1.popitem(last=False)
        excess = len(t1) + len(self.t2) + len(b1) + len(b2) - 2 * c
        while excess > 0:
            (b2 if b2 else b1).popitem(last=False)
            excess -= 1

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "t1": len(self.t1), "t2": len(self.t2),
            "b1": len(self.b1), "b2": len(self.b2), "p": self.p,
        }


def _unprotected(entries: OrderedDict[K, Any], protected: Container[K]) -> Iterator[K]:
    return (key for key in entries if key not in protected)
