"""The `tierkv` command: one entry point, a subcommand per job.

    tierkv demo [--quick]        the main job: a demo node, driven like an engine
    tierkv up -c FILE            run a node (supervisor) until ^C (--detach: in the background)
    tierkv down -c FILE          stop a running node
    tierkv status [-c FILE]      a table of a running node
    tierkv config --explain      every config key, its default and its meaning
    tierkv config -c FILE        check a config file (here), print it in full
    tierkv keygen DIR NAME       a CurveZMQ key pair (tcp beyond loopback needs them)
    tierkv replay TRACE          replay a Mooncake trace against the policies
    tierkv bench [AREA]          benchmarks, as ratios to the limits
    tierkv gc -c FILE --older-than 7d   remove a namespace's old S3 objects
"""

from __future__ import annotations

import argparse
import json
import sys

from tierkv.node.config import ConfigError, load_config


def _status(args: argparse.Namespace) -> int:
    from tierkv.node.status import gather, render, report

    config = load_config(args.config, starting=False)
    status = gather(config, timeout=args.timeout)
    print(json.dumps(report(status), indent=2, default=str) if args.json else render(status))
    return 0 if status.get("broker") is not None else 1


def _config(args: argparse.Namespace) -> int:
    if args.explain:
        from tierkv.node.reference import explain

        print(explain(), end="")
        return 0
    from tierkv.node.config import check_tiers_here, dump_config

    config = load_config(args.config)
    check_tiers_here(config)
    print(f"# {config.source}: valid here; every key, defaults included\n"
          f"{dump_config(config)}", end="")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from tierkv.wire.sockets import create_keys

    public, secret = create_keys(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret} (owner-only; never share it)")
    return 0


def _up(args: argparse.Namespace) -> int:
    if args.detach:
        return _up_detached(args)
    from tierkv.node.supervise import main as supervise

    return supervise((["-c", args.config] if args.config else []) + ["-v"] * args.verbose)


def _up_detached(args: argparse.Namespace) -> int:
    from tierkv.node.config import check_tiers_here
    from tierkv.node.control import detach

    config = load_config(args.config)
    check_tiers_here(config)
    sup = config.supervisor
    # Starting: the broker, then everyone else, each phase within ready_timeout_s.
    timeout = args.timeout if args.timeout is not None else 3 * sup.ready_timeout_s + 30
    try:
        node = detach(config, args.config, args.verbose, timeout)
    except RuntimeError as e:
        print(f"tierkv up: {e}", file=sys.stderr)
        return 1
    print(f"node {config.instance} is up (supervisor pid {node.pid})\nlog: {node.log_path}\n"
          f"stop it with: tierkv down{' -c ' + args.config if args.config else ''}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from tierkv.node.control import NotRunning, down
    from tierkv.wire.sockets import RunDirError

    config = load_config(args.config, starting=False)
    sup = config.supervisor
    # Stopping: the broker (it drains), then everyone else, each within stop_timeout_s.
    timeout = args.timeout if args.timeout is not None else 2 * sup.stop_timeout_s + 10
    try:
        stopped = down(config, timeout)
    except (NotRunning, RunDirError, TimeoutError) as e:
        print(f"tierkv down: {e}", file=sys.stderr)
        return 1
    what = ", ".join(f"{name} (pid {pid})" for name, pid in stopped.children.items())
    print(f"stopped node {stopped.instance} in {stopped.elapsed_s:.1f}s: supervisor (pid "
          f"{stopped.supervisor_pid})" + (f", {what}" if what else ""))
    if stopped.left:
        print(f"tierkv down: still running after the supervisor exited: "
              f"{', '.join(stopped.left)}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up", help="run a node until ^C",
        description="Run a whole node from one config: the broker, a worker per rank and "
                    "the tier processes, restarted when they die, stopped in order on ^C or "
                    "SIGTERM. Refused, changing nothing, when the instance is running already. "
                    "The log is node.log in the run directory (also echoed to stderr).")
    up.add_argument("-c", "--config", help="the node's tierkv.toml (default: the defaults)")
    up.add_argument("-v", "--verbose", action="count", default=0, help="debug lines too")
    up.add_argument("--detach", action="store_true",
                    help="run in the background: return once the node is up, print where "
                         "its log is (stop it with `tierkv down`)")
    up.add_argument("--timeout", type=float, default=None,
                    help="with --detach: seconds to wait for the node to be up (default: 3 x "
                         "supervisor.ready_timeout_s + 30); past it the node is stopped")
    up.set_defaults(run=_up)

    down = sub.add_parser(
        "down", help="stop a running node",
        description="Stop the node of a config cleanly, as ^C to `tierkv up` does (the "
                    "broker first, draining its jobs, then the workers and tiers), wait "
                    "until it has stopped and say what was stopped. Exit 1 when no node of "
                    "that instance is running, or when it has not stopped within the timeout.")
    down.add_argument("-c", "--config", help="the node's tierkv.toml (default: the defaults)")
    down.add_argument("--timeout", type=float, default=None,
                      help="seconds to wait (default: 2 x supervisor.stop_timeout_s + 10)")
    down.set_defaults(run=_down)

    config = sub.add_parser(
        "config", help="check a config file, or explain every key",
        description="Check a config file on this machine (one error naming the key and the "
                    "file) and print it with every default filled in; or, with --explain, "
                    "print every key of a config, tier options included, with its default "
                    "and its meaning.")
    config.add_argument("-c", "--config", help="the file to check (default: the defaults)")
    config.add_argument("--explain", action="store_true",
                        help="print the reference of every key instead")
    config.set_defaults(run=_config)

    keygen = sub.add_parser("keygen", help="a CurveZMQ key pair for tcp beyond loopback")
    keygen.add_argument("dir", help="directory for NAME.key and NAME.key_secret")
    keygen.add_argument("name", help="e.g. broker, or a client's name")
    keygen.set_defaults(run=_keygen)

    status = sub.add_parser(
        "status", help="a table of a running node",
        description="The node's processes (pid, state, uptime, restarts; each pid checked "
                    "now) and per tier its blocks, bytes, capacity, hit ratio, jobs in "
                    "flight, errors and circuit breaker; where its log is. Exit 1 when the "
                    "broker does not answer.")
    status.add_argument("-c", "--config", help="the node's tierkv.toml (default: the defaults)")
    status.add_argument("--json", action="store_true", help="everything, as JSON")
    status.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for the broker (default 3)")
    status.set_defaults(run=_status)

    for name, help_text in (
        ("demo", "the demo node, driven like an inference engine"),
        ("replay", "replay a Mooncake trace (policies vs Belady)"),
        ("bench", "benchmarks as ratios to the physical limits"),
        ("gc", "remove a namespace's old objects from an S3 tier"),
    ):
        sub.add_parser(name, help=help_text, add_help=False)  # see DELEGATED
    return parser


DELEGATED = {
    "demo": ("tierkv.demo", ()),
    "replay": ("tierkv.bench.replay", ()),
    "bench": ("tierkv.bench", ()),
    "gc": ("workers.s3.gc", ()),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        # These parse their own arguments (and their own --help).
        module, prefix = DELEGATED[argv[0]]
        import importlib

        try:
            return int(importlib.import_module(module).main([*prefix, *argv[1:]]) or 0)
        except KeyboardInterrupt:
            return 130
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ConfigError as e:
        print(f"tierkv: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
