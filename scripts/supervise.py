"""`tierkv-supervisor -c tierkv.toml` (also `tierkv up -c FILE`): run a whole node."""

from __future__ import annotations

import argparse
import sys

from tierkv.config import ConfigError, load_config
from tierkv.logs import setup_logging
from tierkv.supervisor import Node, Supervisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierkv-supervisor", description=__doc__)
    parser.add_argument("-c", "--config", help="tierkv.toml (default: built-in defaults)")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--quiet-children", action="store_true",
                        help="do not echo the children's log lines")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"tierkv: {e}", file=sys.stderr)
        return 2
    setup_logging("supervisor", config.log_level, args.verbose)
    node = Node(config, echo=not args.quiet_children, verbose=args.verbose)
    return Supervisor(node).run()


if __name__ == "__main__":
    sys.exit(main())
