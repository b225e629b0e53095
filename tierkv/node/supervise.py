"""`tierkv-supervisor -c tierkv.toml` (also `tierkv up -c FILE`): run a whole node."""

from __future__ import annotations

import argparse
import sys

from tierkv.node.config import check_tiers_here
from tierkv.node.control import detached_ready
from tierkv.node.process import process_parser, start_process
from tierkv.node.supervisor import Node, Supervisor


def main(argv: list[str] | None = None) -> int:
    parser = process_parser("tierkv-supervisor", "run a whole tierkv node until ^C")
    parser.add_argument("--quiet-children", action="store_true",
                        help="do not echo the children's log lines")
    # Set by `tierkv up --detach` (tierkv.node.control), which waits on our ready pipe.
    parser.add_argument("--detached", action="store_true", help=argparse.SUPPRESS)
    # A tier entry's checks against this machine (a disk root exists) fail here, as
    # one line, before anything starts.
    started = start_process(parser, argv, "supervisor",
                            check=lambda _, config: check_tiers_here(config))
    if isinstance(started, int):
        return started
    args, config = started
    node = Node(config, echo=not args.quiet_children, verbose=args.verbose)
    return Supervisor(node, on_ready=detached_ready if args.detached else None).run()


if __name__ == "__main__":
    sys.exit(main())
