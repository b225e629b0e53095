"""Tier registry: by name, built-ins plus entry points, clear errors."""

from __future__ import annotations

import pytest

from tierkv.core.shm import SharedRegion
from tierkv.tiers.local import LocalTier
from tierkv.tiers.memory import MemoryBackend
from tierkv.tiers.registry import (
    TierConfigError,
    create_backend,
    create_secondary_tier,
    get_tier_type,
    known_tiers,
    register_tier,
    unregister_tier,
)


def test_memory_is_built_in():
    assert "memory" in known_tiers()
    assert get_tier_type("memory") is MemoryBackend


def test_config_entry_creates_a_tier(instance):
    with SharedRegion.create(instance, 4, 4096) as region:
        tier = create_secondary_tier({"type": "memory", "name": "m", "capacity_blocks": 8}, region)
        assert isinstance(tier, LocalTier) and tier.name == "m"
        assert tier.backend.capacity_blocks == 8
        assert tier.backend.capacity() == 8 * 4096
        tier.shutdown()


def test_missing_type():
    with pytest.raises(TierConfigError, match="has no 'type'"):
        create_backend({"capacity_blocks": 3})


def test_unknown_type_lists_known():
    with pytest.raises(TierConfigError, match="unknown tier type 'tape'; known types: .*memory"):
        get_tier_type("tape")


def test_unknown_option_is_named():
    with pytest.raises(TierConfigError,
                       match="capacity_blokcs is an unknown option.*takes capacity_blocks"):
        create_backend({"type": "memory", "capacity_blokcs": 3})


def test_framework_arguments_a_backend_does_not_take_are_ignored():
    backend = create_backend({"type": "memory"}, namespace="m1", instance="x", block_bytes=64)
    assert backend.block_bytes == 64


def test_registering_twice_is_an_error():
    class Tape(MemoryBackend):
        type_name = "tape"

    register_tier("tape", Tape)
    try:
        assert get_tier_type("tape") is Tape
        with pytest.raises(TierConfigError, match="already registered"):
            register_tier("tape", Tape)
        with pytest.raises(TierConfigError, match="already registered"):
            register_tier("memory", Tape)
    finally:
        unregister_tier("tape")


def test_not_a_backend_is_refused():
    register_tier("bogus", "tierkv.core.shm:SharedRegion")
    try:
        with pytest.raises(TierConfigError, match="is not a TierBackend"):
            get_tier_type("bogus")
    finally:
        unregister_tier("bogus")


def test_missing_module_says_so():
    register_tier("gone", "tierkv_no_such_module:X")
    try:
        with pytest.raises(TierConfigError, match="cannot be loaded"):
            get_tier_type("gone")
    finally:
        unregister_tier("gone")
