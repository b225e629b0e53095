"""Tier types by name: the built-ins plus the `tierkv.tiers` entry-point group.

A third-party package adds a tier by subclassing `TierBackend` and declaring

    [project.entry-points."tierkv.tiers"]
    mytier = "mypkg.tier:MyBackend"

Implementations are imported lazily, so a tier whose optional dependency is
missing costs nothing until it is configured, and then fails with an install hint.

Each type's options (`tier_options`) are found through the same table: a built-in
names a light module that declares them (the S3 backend's own module imports boto3,
its options module does not), a plug-in declares them as its class's `options`,
or, failing that, they are read from its constructor's signature. `check_tier_entry`
checks one config entry against them without creating anything.
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
from tierkv.tiers.options import (
    REQUIRED,
    Option,
    TierConfigError,
    TierOptionError,
    TierOptions,
    at_least,
)

ENTRY_POINT_GROUP = "tierkv.tiers"

_BUILTIN: dict[str, str] = {
    "memory": "tierkv.tiers.memory:MemoryBackend",
    "disk": "workers.disk.backend:DiskBackend",
    "s3": "workers.s3.backend:S3Backend",
}
# Where a built-in type declares its options without importing its backend.
_BUILTIN_OPTIONS: dict[str, str] = {
    "memory": "tierkv.tiers.memory:OPTIONS",
    "disk": "workers.disk.options:OPTIONS",
    "s3": "workers.s3.options:OPTIONS",
}
_INSTALL_HINT: dict[str, str] = {"s3": "install it with: pip install 'tierkv[s3]'"}

# The keys of every tier entry that belong to the framework, not the backend.
FRAMEWORK = TierOptions("any", "keys every tier entry takes", (
    Option("type", str, REQUIRED, "the tier type: memory, disk, s3, or a plug-in's"),
    Option("name", str, "", "the tier's name (empty: its type); two entries may share a "
           "type, never a name"),
    Option("processes", int, 1, "tier processes the supervisor starts for it (an S3 tier "
           "scales out; a disk tier is one process per root); 0: none, its processes are "
           "started by hand and prove the tier secret (broker.tier_secret_file)",
           check=at_least(0)),
    Option("threads", int, 8, "I/O threads of each tier process", check=at_least(1)),
    Option("negative_ttl_s", float, 2.0, "how long the broker remembers that a shared tier "
           "does not hold a key (when it asks: refresh_s = 0)", check=at_least(0)),
    Option("refresh_s", float, 5.0, "a shared tier (S3) lists what other nodes stored this "
           "often, so lookups never wait on an existence check; 0: no listing, the first "
           "unknown key of a request is checked instead", check=at_least(0)),
    Option("load_latency_ms", float, 0.0, "what a promotion from this tier is assumed to "
           "cost before it is measured: its latency (0: the type's default, see "
           "docs/design.md, load or recompute)", check=at_least(0)),
    Option("load_bandwidth_mb_s", float, 0.0, "and its bandwidth in MB/s (0: the type's "
           "default); measured promotions replace both", check=at_least(0)),
))
FRAMEWORK_KEYS = frozenset(FRAMEWORK.names())
# Arguments the framework passes to a backend's constructor (never config keys).
FRAMEWORK_ARGS = frozenset({"block_bytes", "namespace", "instance", "name"})

_registered: dict[str, type[TierBackend] | str] = {}


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


def tier_options(name: str) -> TierOptions:
    """The options of tier type `name` (TierConfigError for an unknown type)."""
    table = _table()
    if name not in table:
        raise TierConfigError(
            f"unknown tier type {name!r}; known types: {', '.join(sorted(table))}")
    target = table[name]
    if name in _BUILTIN_OPTIONS and target == _BUILTIN[name]:
        module_name, _, attr = _BUILTIN_OPTIONS[name].partition(":")
        return getattr(importlib.import_module(module_name), attr)
    cls = get_tier_type(name)
    return cls.options if cls.options is not None else _options_from_signature(name, cls)


def _options_from_signature(name: str, cls: type[TierBackend]) -> TierOptions:
    """A plug-in that declares no options: its constructor's keyword arguments (any
    type), those without a default required."""
    options = []
    for param in inspect.signature(cls.__init__).parameters.values():
        if param.name == "self" or param.name in FRAMEWORK_ARGS or param.kind in (
                inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            continue
        default = REQUIRED if param.default is inspect.Parameter.empty else param.default
        options.append(Option(param.name, object, default, "(from the constructor)"))
    return TierOptions(name, cls.__doc__.strip().splitlines()[0] if cls.__doc__ else "",
                       tuple(options))


def check_tier_entry(entry: Mapping[str, Any], local: bool = False) -> None:
    """Check one config entry `{type = ..., <options>}` against its type's options
    (and, with `local`, against this machine: a disk root exists). Raises
    TierOptionError naming the key; creates and connects nothing."""
    label = str(entry.get("name") or entry.get("type"))
    kind = entry.get("type")
    if kind is None:
        raise TierOptionError(label, "type", "is missing")
    if not isinstance(kind, str):
        raise TierOptionError(label, "type", f"must be str, got {type(kind).__name__}")
    try:
        options = tier_options(kind)
    except TierConfigError as e:
        raise TierOptionError(label, "type", f"is {kind!r}: {e}") from None
    options.check(entry, label, FRAMEWORK)
    if local:
        options.check_local(entry, label)


def create_backend(spec: Mapping[str, Any], **framework: Any) -> TierBackend:
    """Build the backend of one config entry `{type = ..., <options>}`.

    Options the constructor does not take are an error naming them; framework
    arguments (`block_bytes`, `namespace`, ...) are passed only if it takes them.
    """
    if "type" not in spec:
        raise TierConfigError(f"tier entry {dict(spec)!r} has no 'type'")
    cls = get_tier_type(spec["type"])
    if cls.options is not None:
        check_tier_entry(spec)
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
