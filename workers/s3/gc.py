"""`tierkv gc -c FILE --older-than AGE`: remove a namespace's old blocks from an S3 tier.

Objects are written by every node that shares the bucket, so no single tier
process can tell when one is no longer wanted; age (the store's last-modified
time) is the rule an operator can reason about.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from tierkv.core.errors import TierError
from tierkv.tiers.registry import FRAMEWORK_KEYS, TierConfigError
from workers.s3.backend import S3Backend


def gc(entry: dict[str, Any], namespace: str, older_than_s: float, dry_run: bool) -> int:
    """Remove `namespace`'s objects older than `older_than_s` from the bucket of an
    s3 tier entry (`tierkv gc`). Returns how many were (or would be) deleted."""
    if older_than_s < 0:
        raise ValueError("older_than_s must be >= 0")
    options = {k: v for k, v in entry.items() if k not in FRAMEWORK_KEYS}
    try:
        backend = S3Backend(**options, namespace=namespace, name=str(entry.get("name", "s3")))
    except TypeError as e:
        raise TierConfigError(f"s3 tier entry: {e}") from e
    try:
        return backend.collect_garbage(older_than_s, dry_run)
    finally:
        backend.close()


_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """'90', '90s', '15m', '12h', '7d' -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 3600, 90m, 12h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierkv gc",
        description="Delete the blocks of a namespace that an S3 tier holds and that were "
                    "last written longer ago than an age (nodes sharing the bucket may "
                    "still want newer ones).")
    parser.add_argument("-c", "--config", required=True, help="the node's tierkv.toml")
    parser.add_argument("--name", help="the s3 tier's name (default: the first s3 tier)")
    parser.add_argument("--namespace", help="default: the config's namespace")
    parser.add_argument("--older-than", type=parse_age, required=True, metavar="AGE",
                        help="e.g. 3600, 90m, 12h or 7d")
    parser.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    from tierkv.node.config import ConfigError, load_config, tier_name
    from tierkv.node.logs import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging("s3-gc", "warning")
    try:
        config = load_config(args.config)
        entries = [t for t in config.tiers if t.get("type") == "s3"
                   and (args.name is None or tier_name(t) == args.name)]
        if not entries:
            raise ConfigError(f"{config.source}: no s3 tier"
                              + (f" named {args.name!r}" if args.name else ""))
        namespace = args.namespace or config.namespace
        count = gc(entries[0], namespace, args.older_than, args.dry_run)
    except (ConfigError, TierError, ValueError) as e:
        print(f"tierkv gc: {e}", file=sys.stderr)
        return 1
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {count} objects of namespace {namespace!r} older than {args.older_than:g}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
