"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable
from typing import TypeVar

from tierkv.core.policies.base import CachePolicy

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUPolicy(CachePolicy[K, V]):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Oldest first; move_to_end makes a use O(1).
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def insert(self, key: K, value: V) -> None:
        if key in self._entries:
            raise KeyError(f"key already present: {key!r}")
        self._entries[key] = value

    def remove(self, key: K) -> None:
        self._entries.pop(key, None)

    def touch(self, keys: Iterable[K]) -> None:
        entries = self._entries
        for key in keys:
            if key in entries:
                entries.move_to_end(key)

    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        if n <= 0:
            return []
        victims: list[K] = []
        for key in self._entries:
            if key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        return [(key, self._entries.pop(key)) for key in victims]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
