"""A client that never steps: the broker's memory and the other clients' latency.

    python -m tierkv.bench.event_backlog                   # 5 minutes of backlog
    python -m tierkv.bench.event_backlog --duration 60 --group 128 --blocks 512

An engine that copies its own blocks into the CPU tier (reserve, write the rows,
commit) and never calls `step()` or `poll()` still has every stored/removed event
of its keys queued for it by the broker. Before those queues were bounded in keys
(`broker.events`), such a client grew the broker by hundreds of MiB a minute and its
first step stalled the broker for as long as it took to build a reply of millions
of keys, every other engine of the node waiting behind it.

The node: a broker and a CPU worker (no secondary tier: every block an engine
stores is evicted from the CPU tier soon after, which is what makes events). Two
processes play engines: a *writer* (this module run as `writer`, its own process
so that its Python work is not the other client's) reserves and commits
`--group` new keys a round trip, the previous group's commit and the next group's
reservation in one message; this process plays a second engine that looks up a
few keys in a loop and times each answer. First a control run, the writer
stepping every round trip (the same traffic, no backlog); then the backlog run,
the writer never stepping for `--duration` seconds, then stepping until its
queue is empty. Printed: the broker's resident memory (VmRSS) over time, the
lookup's p50/p99/max in both runs and during the writer's first steps, and what
those steps returned (event keys per reply, `events_dropped`).

The writer does not write the rows it reserves: the broker cannot tell, and the
copy is not what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

KEY_PREFIX = b"event-backlog-writer-key"  # 24 bytes + an 8-byte counter: 32-byte keys
PAGE = 1024  # the CPU tier's page size does not matter here; small keeps it small
SAMPLE_S = 1.0  # how often the broker's RSS is read
LOOKUP_KEYS = 16  # the second engine's lookup: a short prefix
MAX_DRAIN_STEPS = 64  # the writer's steps after the run, until its queue is empty
WRITER_TIMEOUT_S = 30.0  # the writer client's wait for any one reply


# -- the writer: an engine that copies its own blocks -------------------------------------


def writer_key(n: int) -> bytes:
    return KEY_PREFIX + n.to_bytes(8, "big")


def run_writer(address: str, duration_s: float, group: int, max_keys: int,
               step_every_call: bool, out: IO[str]) -> int:
    """Reserve and commit `group` new keys a round trip until `duration_s` passed or
    `max_keys` were stored; step every round trip only if `step_every_call`. Then
    step until a step brings no events (at most MAX_DRAIN_STEPS). Writes one JSON
    line for the run and one per drain step."""
    from tierkv.client import Client

    client = Client(address, timeout=WRITER_TIMEOUT_S)
    try:
        stored, previous = 0, None
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline and stored < max_keys:
            fresh = [writer_key(stored + i) for i in range(group)]
            batch = client.batch()
            if previous is not None:
                batch.commit(previous)
            batch.reserve(fresh, "writer")
            if step_every_call:
                batch.step()
            answers = batch.send()
            reserve = answers[1 if previous is not None else 0]
            if isinstance(reserve, Exception):
                raise reserve
            previous = [k for k, row in zip(fresh, reserve.block_ids, strict=True) if row >= 0]
            stored += len(previous)
        if previous:
            client.commit(previous)
        print(json.dumps({"stored": stored}), file=out, flush=True)
        for _ in range(MAX_DRAIN_STEPS):
            t0 = time.perf_counter()
            step = client.step()
            seconds = time.perf_counter() - t0
            event_keys = sum(len(e.keys) for e in step.events)
            print(json.dumps({"step_s": seconds, "event_keys": event_keys,
                              "events_dropped": getattr(step, "events_dropped", 0)}),
                  file=out, flush=True)
            if not event_keys:
                break
    finally:
        client.close()
    return 0


def start_writer(address: str, duration_s: float, group: int, max_keys: int,
                 step_every_call: bool) -> subprocess.Popen[str]:
    """The writer as its own process (ended by its caller, by pid)."""
    argv = [sys.executable, "-m", "tierkv.bench.event_backlog", "writer", address,
            "--duration", str(duration_s), "--group", str(group), "--max-keys", str(max_keys)]
    if step_every_call:
        argv.append("--step")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def writer_report(lines: str) -> tuple[int, list[dict[str, Any]]]:
    """(keys stored, one record per drain step) from the writer's output."""
    records = [json.loads(line) for line in lines.splitlines() if line.startswith("{")]
    stored = next((r["stored"] for r in records if "stored" in r), -1)
    return stored, [r for r in records if "step_s" in r]


# -- what is watched ------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    """(p50, p99, max) of `samples` (at least one)."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return ordered[len(ordered) // 2], p99, ordered[-1]


@dataclass
class Watch:
    """What the other engine saw while a writer ran: its lookups' latencies (and
    those that overlapped the writer's drain steps), and the broker's RSS."""

    broker_pid: int
    started: float = field(default_factory=time.monotonic)
    latencies: list[float] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds in, bytes)

    def sample_rss(self) -> None:
        self.rss.append((time.monotonic() - self.started, rss_bytes(self.broker_pid)))


def watch_writer(writer: subprocess.Popen[str], lookup: Callable[[], Any], broker_pid: int,
                 timeout_s: float, sample_s: float = SAMPLE_S) -> tuple[Watch, str]:
    """Time `lookup` in a loop and sample the broker's RSS every `sample_s` until
    the writer exits (or `timeout_s`, then it is killed): (what was seen, the
    writer's output)."""
    watch = Watch(broker_pid)
    watch.sample_rss()
    next_sample = time.monotonic() + sample_s
    deadline = time.monotonic() + timeout_s
    while writer.poll() is None and time.monotonic() < deadline:
        t0 = time.perf_counter()
        lookup()
        watch.latencies.append(time.perf_counter() - t0)
        if time.monotonic() >= next_sample:
            watch.sample_rss()
            next_sample += sample_s
        time.sleep(0.001)  # an engine's step rate, not a spin
    watch.sample_rss()
    if writer.poll() is None:
        writer.kill()
    out, _ = writer.communicate(timeout=30)
    return watch, out


# -- the benchmark ----------------------------------------------------------------------------


@contextmanager
def backlog_node(blocks: int) -> Iterator[tuple[Any, Any]]:
    """A broker and a CPU worker of `blocks` blocks and no secondary tier: (the
    config, the started node), stopped and removed on exit."""
    from tierkv.node.config import config_from_dict
    from tierkv.node.supervisor import Node

    with tempfile.TemporaryDirectory() as tmp:
        config = config_from_dict({
            "instance": f"bench{uuid.uuid4().hex[:8]}", "run_dir": str(Path(tmp)),
            "log_level": "warning", "cpu": {"num_blocks": blocks, "page_size": PAGE},
            "worker": {"device": "cpu"},
            "broker": {"job_timeout_s": 60.0, "owner_share": 1.0},
            "client": {"timeout_s": 60.0},
        }, "<bench>")
        node = Node(config)
        node.start()
        try:
            yield config, node
        finally:
            node.stop()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def print_run(name: str, watch: Watch, stored: int, steps: list[dict[str, Any]]) -> None:
    p50, p99, worst = percentiles(watch.latencies)
    print(f"{name}: {stored:,} keys stored; the other client's lookups: "
          f"{len(watch.latencies):,} answered, p50 {_ms(p50)}, p99 {_ms(p99)}, "
          f"max {_ms(worst)}")
    for at, rss in watch.rss:
        print(f"  {at:7.1f} s  broker RSS {rss / 2**20:7.1f} MiB")
    for i, step in enumerate(steps):
        print(f"  writer's step {i + 1}: {step['event_keys']:,} event keys, "
              f"events_dropped {step['events_dropped']:,}, {_ms(step['step_s'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierkv.bench.event_backlog",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role")
    writer = sub.add_parser("writer", help="the engine that never steps (run by the bench)")
    writer.add_argument("address")
    writer.add_argument("--step", action="store_true", help="step every round trip")
    for p in (parser, writer):
        p.add_argument("--duration", type=float, default=300.0, help="seconds of backlog")
        p.add_argument("--group", type=int, default=128, help="keys a round trip")
        p.add_argument("--max-keys", type=int, default=1 << 40, help="stop after these")
    parser.add_argument("--blocks", type=int, default=512, help="CPU tier blocks")
    parser.add_argument("--control-s", type=float, default=20.0,
                        help="seconds of the control run (the writer stepping)")
    parser.add_argument("--sample-s", type=float, default=15.0,
                        help="seconds between two readings of the broker's RSS")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.group <= 0 or args.max_keys <= 0 or args.sample_s <= 0:
        parser.error("--duration, --group, --max-keys and --sample-s must be positive")
    if args.role == "writer":
        return run_writer(args.address, args.duration, args.group, args.max_keys,
                          args.step, sys.stdout)
    if args.group * 2 > args.blocks:
        parser.error(f"--blocks ({args.blocks}) must hold two groups of --group ({args.group})")
    return bench(args.blocks, args.group, args.duration, args.control_s, args.max_keys,
                 args.sample_s)


def bench(blocks: int, group: int, duration_s: float, control_s: float, max_keys: int,
          sample_s: float) -> int:
    from tierkv.client import Client

    with backlog_node(blocks) as (config, node):
        address = config.connect_address("client")
        other = Client(address, timeout=config.client.timeout_s)
        try:
            probe = [b"other-engine-prefix-key-" + i.to_bytes(8, "big")
                     for i in range(LOOKUP_KEYS)]

            def lookup() -> Any:
                return other.lookup(probe, "other")

            print(f"node: {blocks} CPU blocks, no secondary tier; writer: {group} keys a "
                  f"round trip; machine: {os.cpu_count()} cores")
            for name, seconds, stepping in (("control (writer steps)", control_s, True),
                                            ("backlog (writer never steps)", duration_s, False)):
                proc = start_writer(address, seconds, group, max_keys, stepping)
                try:
                    watch, out = watch_writer(proc, lookup, node.pid("broker"), seconds + 600,
                                              sample_s)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(timeout=30)
                stored, steps = writer_report(out)
                print_run(name, watch, stored, steps)
                events = other.stats().get("events", {})
                print(f"  broker's event figures: {json.dumps(events)}")
        finally:
            other.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
