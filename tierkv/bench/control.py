"""`tierkv bench control`: the broker's round trips against the in-process manager.

The ideal of a control plane in its own process is the same calls on the same
manager in the caller's process: the ratio (in-process time / broker time) is the
share of that ideal the service keeps after ZeroMQ, msgpack and a process hop.
Measured by `tierkv/bench/broker_ops.py`'s `control_plane`: a lookup of 64 resident
keys, and one engine step of 256 requests x 64 keys in one batched round trip,
once with every key a hit (each lookup walks all 64 keys) and once missing at the
first key (the per-request overhead alone). Then a lookup's tail: p99 against p50,
quiet and with twice the cores busy, with the node's default scheduling and with
broker and client at `realtime_priority` 1 (`tierkv.node.realtime`).
"""

from __future__ import annotations

import os
import statistics

from tierkv.bench.common import Options, Part, Row, Stat, ratio

# The CPU tier's page size does not matter to the control plane: small pages keep
# the node's shared memory small. Blocks: the least the bench node takes.
PAGE = 16 * 1024
TAIL_GOAL = 3.0
BLOCKS = 512
REALTIME = 1  # the lowest SCHED_RR priority: above every normal thread, below the rest


def run(part: Part, opts: Options) -> None:
    from tierkv.bench.broker_ops import (
        KEYS_PER_REQUEST,
        REQUESTS_PER_STEP,
        bench_node,
        control_plane,
        loaded_tail,
        percentiles,
        store_hot,
    )
    from tierkv.node.realtime import WaitBoost, allowed

    repeats = opts.pick(2, 5)
    rounds = 100 if opts.quick else 2000
    hogs = 2 * (os.cpu_count() or 1)
    with bench_node(BLOCKS, PAGE) as (client, _kv):
        runs = control_plane(client, rounds, repeats)
        quiet, loaded = loaded_tail(client, rounds, hogs)
    tails = {"quiet": quiet, f"{hogs} busy processes (2x the cores)": loaded}
    if allowed(REALTIME):
        with bench_node(BLOCKS, PAGE, realtime=REALTIME) as (client, _kv):
            store_hot(client)
            _, lifted = loaded_tail(client, rounds, hogs)
            tails[f"{hogs} busy, realtime_priority {REALTIME}"] = lifted
            # The bench's thread in SCHED_RR throughout (as `chrt -r 1` would start an
            # engine), not only while it waits: not put back behind the busy processes
            # each time an answer came.
            with WaitBoost(REALTIME, "bench"):
                _, lifted = loaded_tail(client, rounds, hogs)
            tails[f"{hogs} busy, realtime_priority {REALTIME}, caller in SCHED_RR"] = lifted
    else:
        part.note(f"no realtime_priority row: this process may not use SCHED_RR "
                  f"(CAP_SYS_NICE or `ulimit -r {REALTIME}`)")
    step = f"step {REQUESTS_PER_STEP} req x {KEYS_PER_REQUEST} keys"
    labels = {
        "lookup": (f"lookup {KEYS_PER_REQUEST} keys, round trip", "us", 1e6, False),
        "step_hit": (f"{step}, all hits", "ms", 1e3, True),
        "step_miss": (f"{step}, miss at the first key", "ms", 1e3, True),
    }
    remote, raw = ([statistics.median(r) for r in rep] for rep in
                   (runs["lookup"][0], runs["zmq"][0]))
    part.add(Row("control", labels["lookup"][0], Stat.of(remote).scaled(1e6), "us",
                 "raw ZeroMQ DEALER/ROUTER round trip, same bytes", ratio(raw, remote),
                 Stat.of(raw).scaled(1e6),
                 note="an echo ROUTER in another process: the transport alone"))
    for name, (label, unit, scale, headline) in labels.items():
        remote, local = ([statistics.median(r) for r in rep] for rep in runs[name])
        part.add(Row(
            "control", label, Stat.of(remote).scaled(scale), unit,
            "in-process TieringManager", ratio(local, remote), Stat.of(local).scaled(scale),
            headline=headline,
            note=f"median per repeat of {len(runs[name][0][0])} calls, {repeats} repeats"))
    keys = REQUESTS_PER_STEP * KEYS_PER_REQUEST
    remote, local = ([keys / statistics.median(r) / 1e6 for r in rep] for rep in runs["step_hit"])
    part.add(Row("control", "keys through lookup, batched step of hits", Stat.of(remote),
                 "M keys/s", "in-process TieringManager", ratio(remote, local),
                 Stat.of(local), headline=False))
    for label, samples in tails.items():
        p50, p99 = percentiles(samples)
        part.add(Row("control", f"lookup {KEYS_PER_REQUEST} keys, p99 / p50, {label}",
                     Stat.one(p99 / p50), "x", "its own p50", None,
                     headline=label != "quiet",
                     note=f"p50 {p50 * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us of {len(samples)} "
                          f"round trips (goal: p99 <= {TAIL_GOAL:g}x p50 when loaded)"))
    part.note(f"per key in a step of hits: {1 / statistics.median(remote):.3f} us "
              "through the broker")
