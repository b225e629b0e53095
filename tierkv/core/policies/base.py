"""The eviction policy interface of the CPU tier.

A policy orders the *evictable candidates* of a tier: the manager inserts a key
when its block becomes ready and removes it when the block is freed. The policy
knows nothing of reader counts or write state; the manager passes what may not be
evicted as `protected`. Every method runs on the owner's single thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Iterable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class CachePolicy(ABC, Generic[K, V]):
    """Maps key -> value (a block id) and chooses victims. O(1) amortized per call."""

    name: str = "?"

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def get(self, key: K) -> V | None:
        """The value of `key`, or None. Does not count as a use."""

    @abstractmethod
    def insert(self, key: K, value: V) -> None:
        """Add a key that is not present. Inserting counts as its first use."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """Forget `key` (freed outside the policy). Unknown keys are ignored."""

    @abstractmethod
    def touch(self, keys: Iterable[K]) -> None:
        """Mark keys as used now, in order (the last is the most recent).
        Unknown keys are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: Container[K]) -> list[tuple[K, V]] | None:
        """Remove and return `n` victims, none of them in `protected`.

        All-or-nothing: if `n` victims cannot be found, return None and change
        nothing."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def stats(self) -> dict[str, Any]:
        return {"policy": self.name, "entries": len(self)}
