"""The reference tier: blocks kept in process memory, bounded, LRU.

It is the tier every orchestrator test uses and the model for the real tiers: a
bounded capacity, eviction that never touches the keys of the job being stored,
bytes copied from and into the CPU-tier rows it is given, and a load of a key it
does not hold fails.
"""

from __future__ import annotations

import threading
from collections.abc import Container, Iterable
from typing import Any

from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.keys import OffloadKey
from tierkv.tiers.backend import TierBackend
from tierkv.tiers.base import BlockRows
from tierkv.tiers.local import LocalTier
from tierkv.tiers.lru import LRUIndex
from tierkv.tiers.options import Option, TierOptions, at_least

OPTIONS = TierOptions("memory", "blocks in the tier process's memory, bounded, LRU (tests, "
                      "and the model of a tier)",
                      (Option("capacity_blocks", int, 1024, "blocks held at most",
                              check=at_least(1)),))


class MemoryBackend(TierBackend):
    type_name = "memory"
    options = OPTIONS

    def __init__(self, capacity_blocks: int = 1024, block_bytes: int = 0) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._blocks: LRUIndex[bytes] = LRUIndex(self._lock)

    def store(self, key: OffloadKey, src: memoryview, pinned: Container[OffloadKey] = ()) -> None:
        data = bytes(src)
        with self._lock:
            if key not in self._blocks:
                while len(self._blocks) >= self.capacity_blocks:
                    victim = next((k for k in self._blocks if k not in pinned), None)
                    if victim is None:
                        raise TierError(ErrorCode.NO_SPACE, "memory tier full of pinned keys")
                    self._blocks.evict(victim)
            self._blocks.put(key, data)

    def load(self, key: OffloadKey, dst: memoryview) -> None:
        with self._lock:
            data = self._blocks.get(key)
        if data is None:
            raise TierError(ErrorCode.NOT_FOUND, f"key {key.hex()} is not in the memory tier")
        if len(data) != len(dst):
            raise TierError(
                ErrorCode.CORRUPT, f"key {key.hex()}: {len(data)} bytes held, {len(dst)} wanted"
            )
        dst[:] = data

    def exists(self, key: OffloadKey) -> bool:
        with self._lock:
            return key in self._blocks

    def delete(self, key: OffloadKey) -> None:
        with self._lock:
            self._blocks.pop(key, None)

    def inventory(self) -> list[OffloadKey]:
        with self._lock:
            return list(self._blocks)

    def capacity(self) -> int | None:
        return self.capacity_blocks * self.block_bytes if self.block_bytes else None

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self._blocks.touch(keys)

    def take_evicted(self) -> list[OffloadKey]:
        return self._blocks.take_evicted()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"blocks": len(self._blocks), "capacity_blocks": self.capacity_blocks}


class MemoryTier(LocalTier):
    """An in-process memory tier; `auto_complete=False` holds jobs until
    `complete_pending()` so tests can observe in-flight states."""

    def __init__(
        self,
        rows: BlockRows,
        capacity_blocks: int = 1024,
        name: str = "memory",
        auto_complete: bool = True,
    ) -> None:
        backend = MemoryBackend(capacity_blocks, block_bytes=rows.block_bytes)
        super().__init__(backend, rows, name=name, auto_complete=auto_complete)
