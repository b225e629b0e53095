"""The `tierkv` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run a demo node on the embedded default config")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        print("tierkv demo: the cluster is not assembled yet (the supervisor lands later).")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
