"""A tier type's options as data, so a config entry is checked before anything starts.

A backend's constructor checks its arguments too, but it runs inside the tier
process, after the broker and the workers are up, and its module may import a
heavy client library (the S3 tier imports boto3). A `TierOptions` declares the
same options as plain data in a module that imports nothing heavy: the config
loader checks every `[[tiers]]` entry against it (type, range, choices, required
keys, options that are refused outright) and reports one error naming the key,
and `tierkv config --explain` prints it as the reference of the tier's keys.

Checks that depend on the machine (a disk tier's root exists) are `local`: they
run in the supervisor just before it starts anything, not wherever a config is
read (`tierkv status` on another machine must not fail on them). Nothing here
connects anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "required"})()

Check = Callable[[Any], str | None]  # why a value is wrong, or None when it is fine
# A rule over the whole entry (options that go together): (key, why) or None.
Rule = Callable[[Mapping[str, Any]], tuple[str, str] | None]


class TierConfigError(ValueError):
    """A tier entry of the config is wrong; the message names the tier and the key."""


class TierOptionError(TierConfigError):
    """One option of one tier entry is wrong: `key` is the option, `why` the rest."""

    def __init__(self, label: str, key: str, why: str) -> None:
        super().__init__(f"tier {label!r}: {key} {why}")
        self.key = key
        self.why = why


@dataclass(frozen=True)
class Option:
    """One key a tier entry may give. `kind` is the accepted type (or types); an int
    is a valid float, a bool is never an int."""

    name: str
    kind: type | tuple[type, ...]
    default: Any
    doc: str
    choices: tuple[Any, ...] = ()
    check: Check | None = None
    local: Check | None = None  # a check against this machine (see the module doc)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def problem(self, value: Any) -> str | None:
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        if not any(_is(value, k) for k in kinds):
            wanted = " or ".join(k.__name__ for k in kinds)
            return f"must be {wanted}, got {_kind(value)}"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(_show(c) for c in self.choices)}, got {value!r}"
        return self.check(value) if self.check is not None else None

    def type_text(self) -> str:
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        if self.choices:
            return " | ".join(_show(c) for c in self.choices)
        return " | ".join(k.__name__ for k in kinds)


@dataclass(frozen=True)
class TierOptions:
    """The options of one tier type. `refused` are keys that are never accepted,
    with the reason (the S3 tier's inline credentials)."""

    type_name: str
    doc: str
    options: tuple[Option, ...]
    refused: Mapping[str, str] = field(default_factory=dict)
    rules: tuple[Rule, ...] = ()

    def names(self) -> list[str]:
        return [o.name for o in self.options]

    def check(self, entry: Mapping[str, Any], label: str, framework: TierOptions) -> None:
        """Raise TierOptionError for the first wrong key of `entry` (framework keys
        such as `name` and `threads` are checked against `framework`)."""
        known = {o.name: o for o in (*framework.options, *self.options)}
        for key in entry:
            if key in self.refused:
                raise TierOptionError(label, key, self.refused[key])
            if key not in known:
                takes = ", ".join(self.names()) or "none"
                raise TierOptionError(label, key, (
                    f"is an unknown option (type {self.type_name!r} takes {takes}; every "
                    f"tier takes {', '.join(framework.names())})"))
        for option in known.values():
            if option.name not in entry:
                if option.required:
                    raise TierOptionError(label, option.name,
                                          f"is required (type {self.type_name!r})")
                continue
            why = option.problem(entry[option.name])
            if why is not None:
                raise TierOptionError(label, option.name, why)
        for rule in self.rules:
            broken = rule(entry)
            if broken is not None:
                raise TierOptionError(label, *broken)

    def check_local(self, entry: Mapping[str, Any], label: str) -> None:
        for option in self.options:
            if option.local is not None and option.name in entry:
                why = option.local(entry[option.name])
                if why is not None:
                    raise TierOptionError(label, option.name, why)


# -- small checks the schemas share ------------------------------------------------------


def positive(value: float) -> str | None:
    return None if value > 0 else f"must be positive, got {value!r}"


def at_least(low: float) -> Check:
    def check(value: float) -> str | None:
        return None if value >= low else f"must be >= {low:g}, got {value!r}"
    return check


def non_empty(value: str) -> str | None:
    return None if value.strip() else "must not be empty"


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return type(value) in (int, float)
    if kind is int:
        return type(value) is int
    return isinstance(value, kind)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]
