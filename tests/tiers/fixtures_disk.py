"""The disk tier's factory for the conformance suite: a fresh directory per backend,
a budget of exactly `capacity_blocks` slots, durable writes (the real behaviour)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierkv.tiers.backend import TierBackend
from workers.disk import DiskBackend, slot_bytes_for


@pytest.fixture
def make_disk(tmp_path) -> Iterator:
    made: list[TierBackend] = []

    def make(block_bytes: int, capacity_blocks: int = 64) -> TierBackend:
        root = tmp_path / f"disk{len(made)}"
        root.mkdir()
        backend = DiskBackend(str(root), capacity_blocks * slot_bytes_for(block_bytes),
                              block_bytes=block_bytes, namespace="conformance")
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
