"""Eviction policies of the CPU tier, found by name."""

from __future__ import annotations

from collections.abc import Callable

from tierkv.core.policies.arc import ARCPolicy
from tierkv.core.policies.base import CachePolicy
from tierkv.core.policies.density import HitDensityPolicy
from tierkv.core.policies.hints import RequestHints, hints_from_kv_hints
from tierkv.core.policies.histarc import HistoryARCPolicy
from tierkv.core.policies.lru import LRUPolicy

_POLICIES: dict[str, Callable[[int], CachePolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "histarc": HistoryARCPolicy,
    "hitdensity": HitDensityPolicy,
}


def register_policy(name: str, factory: Callable[[int], CachePolicy]) -> None:
    if name in _POLICIES:
        raise ValueError(f"policy {name!r} is already registered")
    _POLICIES[name] = factory


def known_policies() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str, capacity: int) -> CachePolicy:
    try:
        factory = _POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown cache policy {name!r}; known policies: {', '.join(known_policies())}"
        ) from None
    return factory(capacity)


__all__ = ["ARCPolicy", "CachePolicy", "HitDensityPolicy", "HistoryARCPolicy", "LRUPolicy",
           "RequestHints", "hints_from_kv_hints", "known_policies", "make_policy",
           "register_policy"]
