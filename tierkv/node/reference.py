"""`tierkv config --explain`: every key of a node's config, its default and its
meaning, tier types included, rendered from the same declarations that loading
checks against (`tierkv.node.config` fields, each tier type's `TierOptions`), so
the reference cannot drift from what is accepted. The output is commented TOML: a
section can be copied into a config file as it is."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterator
from typing import Any

from tierkv.core.policies import known_policies
from tierkv.node.config import Config, _toml
from tierkv.tiers.options import Option, TierConfigError, TierOptions
from tierkv.tiers.registry import FRAMEWORK, known_tiers, tier_options

WIDTH = 88


def explain() -> str:
    """The whole reference."""
    lines = ["# Every key of a tierkv node config (tierkv.toml), with its default.",
             "# Every section and key is optional; a mistake is one error naming the key",
             "# and the file. `tierkv config -c FILE` checks a file.", ""]
    config = Config()
    sections = []
    for f in _fields(Config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            sections.append((f.name, value))
        elif f.name != "tiers":
            lines += _key(f.name, value, _doc(f))
    for name, section in sections:
        lines += ["", f"[{name}]  # {type(section).__doc__}"]
        for f in _fields(type(section)):
            lines += _key(f.name, getattr(section, f.name), _doc(f, f"{name}.{f.name}"))
    lines += ["", "# [[tiers]]: secondary tiers, fastest first. Every entry takes these keys,",
              "# and the options of its type (below).", "[[tiers]]"]
    lines += _options(FRAMEWORK)
    for kind in known_tiers():
        lines += ["", "[[tiers]]"]
        try:
            options = tier_options(kind)
        except TierConfigError as e:
            lines += [f'type = "{kind}"', f"# cannot be loaded here: {e}"]
            continue
        lines += [f'type = "{kind}"  # {options.doc}', *_options(options)]
    return "\n".join(lines) + "\n"


def _fields(cls: type) -> Iterator[dataclasses.Field[Any]]:
    return (f for f in dataclasses.fields(cls) if f.name != "source")


def _doc(f: dataclasses.Field[Any], key: str = "") -> str:
    text = f.metadata.get("doc", "")
    if key == "cpu.policy":
        text = text.replace("(see `known` below)", f"({', '.join(known_policies())})")
    return text


def _options(options: TierOptions) -> list[str]:
    lines: list[str] = []
    for option in options.options:
        if option.name == "type":
            continue
        lines += _option(option)
    reasons: dict[str, list[str]] = {}
    for name, why in options.refused.items():
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        lines += _comment(f"{', '.join(names)}: refused: {why}")
    return lines


def _option(option: Option) -> list[str]:
    if option.required:
        return [*_comment(f"{option.doc} (required, {option.type_text()})"),
                f"# {option.name} = ..."]
    return _key(option.name, option.default, f"{option.doc} ({option.type_text()})")


def _key(name: str, value: Any, doc: str) -> list[str]:
    return [*_comment(doc), f"{name} = {_toml(value)}"]


def _comment(text: str) -> list[str]:
    text = " ".join(text.split())
    return ["# " + line for line in textwrap.wrap(text, WIDTH - 2)] if text else []
