"""Suite-wide fixtures: unique instance names, and a check that nothing is left behind."""

from __future__ import annotations

import os
import uuid

import pytest


def _our_segments() -> set[str]:
    try:
        return {e for e in os.listdir("/dev/shm") if e.startswith("tierkv.t")}
    except FileNotFoundError:
        return set()


@pytest.fixture
def instance() -> str:
    """An instance name no other test uses; segments named tierkv.t* are the suite's."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session", autouse=True)
def no_leftover_segments():
    before = _our_segments()
    yield
    left = _our_segments() - before
    assert not left, f"shared-memory segments left in /dev/shm: {sorted(left)}"
