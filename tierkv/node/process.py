"""The start-up every tierkv process shares: `-c FILE` and `-v`, the config loaded
and checked (a mistake exits 2 with one line naming the key and the file), and the
one log format for the process's component."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tierkv.node.config import Config, ConfigError, load_config
from tierkv.node.logs import setup_logging

Check = Callable[[argparse.Namespace, Config], None]


def process_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("-c", "--config", help="tierkv.toml (default: built-in defaults)")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    return parser


def start_process(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    component: str | Callable[[argparse.Namespace], str],
    check: Check | None = None,
) -> tuple[argparse.Namespace, Config] | int:
    """Parse, load and check the config, set up logging. Returns (args, config), or
    the exit code (2) after printing why the process cannot start. `check` raises
    ConfigError for what the arguments and the config must agree on."""
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if check is not None:
            check(args, config)
    except ConfigError as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 2
    name = component if isinstance(component, str) else component(args)
    setup_logging(name, config.log_level, args.verbose)
    return args, config
