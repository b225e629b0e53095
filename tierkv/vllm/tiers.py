"""vLLM's view of the node's tiers: what a request may be served from and what its
orchestrator says of it (in), where blocks were stored or removed (out).

vLLM names tiers by medium and locality (`Medium`, `Locality`); tierkv by its
config's tier names, each of a kind (disk, s3, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    TierFilter,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.vllm.layout import KeyMap
from tierkv.wire.protocol import RequestContext

_SOURCE = {"disk": CacheHitSource.DISK, "s3": CacheHitSource.EXTERNAL_UNSPECIFIED}


class NodeTiers:
    """The node's secondary tiers: (name, kind) pairs from its config."""

    def __init__(self, tiers: Sequence[tuple[str, str]]) -> None:
        self.tiers = list(tiers)

    def kind(self, tier: str) -> str:
        return next((kind for name, kind in self.tiers if name == tier), tier)

    def hit_source(self, tier: str | None) -> CacheHitSource:
        """vLLM's name for where a hit came from (None: the CPU tier)."""
        if tier is None:
            return CacheHitSource.HOST
        return _SOURCE.get(self.kind(tier), CacheHitSource.EXTERNAL_UNSPECIFIED)

    def context_of(self, ctx: ReqContext) -> RequestContext | None:
        """What tierkv should know of a request: the tiers it may be served from
        (vLLM's load-tier filter) and the orchestrator's hints."""
        tiers = None
        if ctx.load_tier_filter is not TierFilter.ALL:
            tiers = [name for name, kind in self.tiers if ctx.load_tier_filter.allows(
                Medium.STORAGE, Locality.REMOTE if kind == "s3" else Locality.LOCAL)]
        hints = _builtins(ctx.kv_hints) if ctx.kv_hints is not None else None
        if tiers is None and hints is None:
            return None
        return RequestContext(ctx.req_id, tiers=tiers, hints=hints)

    def events(self, step: Any, keymap: KeyMap) -> list[OffloadingEvent]:
        """vLLM's events for a step's node events of this engine's namespace."""
        out = []
        for event in step.events:
            keys = [k for k in map(keymap.chunk_of, event.keys) if k is not None]
            if not keys:
                continue
            tier = event.tier
            medium = Medium.CPU if tier == "cpu" else Medium.STORAGE
            locality = Locality.REMOTE if self.kind(tier) == "s3" else Locality.LOCAL
            out.append(OffloadingEvent(
                keys=[OffloadKey(k) for k in keys], medium=medium,
                removed=event.kind == "removed", locality=locality,
                ownership=None if tier == "cpu" else tier))
        return out


def _builtins(hints: Any) -> dict[str, Any] | None:
    try:
        import msgspec

        value = msgspec.to_builtins(hints)
    except (ImportError, TypeError):
        return None
    return value if isinstance(value, dict) else None
