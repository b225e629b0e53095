"""`tierkv bench control`: the broker's round trips against the in-process manager.

The ideal of a control plane in its own process is the same calls on the same
manager in the caller's process: the ratio (in-process time / broker time) is the
share of that ideal the service keeps after ZeroMQ, msgpack and a process hop.
Measured by `tierkv/bench/broker_ops.py`'s `control_plane`: a lookup of 64 resident
keys, and one engine step of 256 requests x 64 keys in one batched round trip,
once with every key a hit (each lookup walks all 64 keys) and once missing at the
first key (the per-request overhead alone). Then a lookup's tail: p99 against p50,
quiet and with twice the cores busy, with the node's default scheduling and with
broker and client at `realtime_priority` 1 (`tierkv.node.realtime`). And the
codec's share of a lookup: its four passes (the client's encode, the broker's
decode, the reply's encode, the client's decode) by the compiled path (msgspec)
against the Python path of the same codec, in process, back to back.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

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
    add_codec_row(part, rounds, repeats)


def add_codec_row(part: Part, rounds: int, repeats: int) -> None:
    from tierkv.wire.codec import compiled

    if not compiled():
        part.note("no codec row: msgspec is not installed (`pip install 'tierkv[fast]'`)")
        return
    fast, python = codec_passes(rounds, repeats)
    part.add(Row("control", f"codec: a {KEYS} key lookup's four passes", Stat.of(fast), "us",
                 "the same codec's Python path", ratio(python, fast), Stat.of(python),
                 headline=False,
                 note=f"msgspec; median per repeat of {rounds} calls, {repeats} repeats"))


KEYS = 64
CHUNK = 100


def codec_passes(rounds: int, repeats: int) -> tuple[list[float], list[float]]:
    """Microseconds of a 64-key lookup's four codec passes, per repeat the median of
    `rounds`: (compiled path, Python path), back to back in each repeat."""
    from tierkv.wire.codec import python_path
    from tierkv.wire.keyblob import pack_counts, pack_keys
    from tierkv.wire.protocol import (
        CLIENT_OPS,
        KeyGroups,
        OpsRequest,
        OpsResult,
        Reply,
        decode,
        encode,
    )

    blob, width, lens = pack_keys([n.to_bytes(16, "big") for n in range(KEYS)])
    request = OpsRequest(1, blob, width, lens, lookup=KeyGroups(pack_counts([KEYS]), ["r"]))
    reply = Reply(1, True, OpsResult(hits=pack_counts([KEYS]), state=b"\x00",
                                     region="1234.5678"), None, 30.0)

    def passes() -> None:
        decode(encode(request), CLIENT_OPS)
        decode(encode(reply))

    fast: list[float] = []
    python: list[float] = []
    for _ in range(repeats):
        # In turns of CHUNK calls: a machine whose load swings favours neither path,
        # and each path runs warm, as in a process that runs only one of them.
        samples: tuple[list[float], list[float]] = ([], [])
        for _ in range(max(1, rounds // CHUNK)):
            samples[0].extend(_timed(passes) for _ in range(CHUNK))
            with python_path():
                samples[1].extend(_timed(passes) for _ in range(CHUNK))
        fast.append(statistics.median(samples[0]) * 1e6)
        python.append(statistics.median(samples[1]) * 1e6)
    return fast, python


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
