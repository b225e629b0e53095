"""Tier types by name: the built-ins plus the `tierkv.tiers` entry-point group.

A third-party package adds a tier by subclassing `TierBackend` and declaring

    [project.entry-points."tierkv.tiers"]
    mytier = "mypkg.tier:MyBackend"

Implementations are imported lazily, so a tier whose optional dependency is
missing costs nothing until it is configured, and then fails with an install hint.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from tierkv.tiers.backend import TierBackend
from tierkv.tiers.base import BlockRows
from tierkv.tiers.local import LocalTier

ENTRY_POINT_GROUP = "tierkv.tiers"

_BUILTIN: dict[str, str] = {
    "memory": "tierkv.tiers.memory:MemoryBackend",
    "disk": "workers.disk:DiskBackend",
    "s3": "workers.s3:S3Backend",
}
_INSTALL_HINT: dict[str, str] = {"s3": "install it with: pip install 'tierkv[s3]'"}
# Keys of a tier's config entry that belong to the framework, not the backend.
FRAMEWORK_KEYS = frozenset({"type", "name", "processes", "threads", "negative_ttl_s"})

_registered: dict[str, type[TierBackend] | str] = {}


class TierConfigError(ValueError):
    """A tier entry of the config is wrong; the message names the tier and the key."""


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _table() -> dict[str, type[TierBackend] | str]:
    table: dict[str, type[TierBackend] | str] = {**_BUILTIN}
    for name, target in _entry_points().items():
        if name in table and table[name] != target:
            raise TierConfigError(
                f"tier type {name!r} is registered twice: {table[name]} and {target}"
            )
        table[name] = target
    table.update(_registered)
    return table


def register_tier(name: str, backend: type[TierBackend] | str) -> None:
    """Register a backend class (or "module:Class") under `name`, at run time."""
    if name in _registered or name in _BUILTIN or name in _entry_points():
        raise TierConfigError(f"tier type {name!r} is already registered")
    _registered[name] = backend


def unregister_tier(name: str) -> None:
    _registered.pop(name, None)


def known_tiers() -> list[str]:
    return sorted(_table())


def get_tier_type(name: str) -> type[TierBackend]:
    table = _table()
    try:
        target = table[name]
    except KeyError:
        raise TierConfigError(
            f"unknown tier type {name!r}; known types: {', '.join(sorted(table))}"
        ) from None
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        hint = _INSTALL_HINT.get(name, "")
        raise TierConfigError(
            f"tier type {name!r} cannot be loaded ({e}){'; ' + hint if hint else ''}"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, TierBackend)):
        raise TierConfigError(f"tier type {name!r} ({target}) is not a TierBackend")
    return cls


def create_backend(spec: Mapping[str, Any], **framework: Any) -> TierBackend:
    """Build the backend of one config entry `{type = ..., <options>}`.

    Options the constructor does not take are an error naming them; framework
    arguments (`block_bytes`, `namespace`, ...) are passed only if it takes them.
    """
    if "type" not in spec:
        raise TierConfigError(f"tier entry {dict(spec)!r} has no 'type'")
    cls = get_tier_type(spec["type"])
    label = spec.get("name", spec["type"])
    options = {k: v for k, v in spec.items() if k not in FRAMEWORK_KEYS}
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = {n for n in params if n != "self"}
    unknown = sorted(set(options) - accepted) if not takes_any else []
    if unknown:
        raise TierConfigError(
            f"tier {label!r}: unknown option(s) {', '.join(unknown)}; "
            f"{spec['type']} takes {', '.join(sorted(accepted - set(framework))) or 'none'}"
        )
    kwargs = {k: v for k, v in framework.items() if takes_any or k in accepted}
    kwargs.update(options)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TierConfigError(f"tier {label!r}: {e}") from e


def create_secondary_tier(
    spec: Mapping[str, Any], rows: BlockRows, **framework: Any
) -> LocalTier:
    """An in-process tier from a config entry (`tierkv` used as a library)."""
    backend = create_backend(spec, block_bytes=rows.block_bytes, **framework)
    return LocalTier(
        backend, rows, name=spec.get("name", spec["type"]), threads=int(spec.get("threads", 0))
    )
