"""One conformance suite for every tier backend (fsspec's abstract-tests habit).

Each backend gets a factory fixture `make_<type>` taking (block_bytes,
capacity_blocks) and returning a fresh backend; `backend_factory` parametrizes
the suite over all of them. A new tier adds its factory here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator

import pytest

from tierkv.tiers.backend import TierBackend
from tierkv.tiers.memory import MemoryBackend

Factory = Callable[..., TierBackend]

BACKENDS = ["memory"]

# Each real tier keeps its factory fixture in tests/tiers/fixtures_<type>.py; the
# suite runs against every one that exists.
for _type in ("disk", "s3"):
    try:
        _module = importlib.import_module(f"tests.tiers.fixtures_{_type}")
    except ModuleNotFoundError as _e:
        if _e.name != f"tests.tiers.fixtures_{_type}":
            raise
        continue
    for _name in dir(_module):
        if _name.startswith(("make_", "fixture_")):
            globals()[_name] = getattr(_module, _name)
    BACKENDS.append(_type)


@pytest.fixture
def make_memory() -> Iterator[Factory]:
    made: list[TierBackend] = []

    def make(block_bytes: int, capacity_blocks: int = 64) -> TierBackend:
        backend = MemoryBackend(capacity_blocks=capacity_blocks, block_bytes=block_bytes)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture(params=BACKENDS)
def backend_factory(request) -> Factory:
    return request.getfixturevalue(f"make_{request.param}")
