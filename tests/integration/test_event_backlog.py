"""A client that never steps: the broker queues its keys' events within a bound
counted in keys, forgets owners of keys no tier holds, stays the same size, and
keeps answering every other client; that client's first step is one bounded reply
saying how many keys of events were dropped.

A real node (broker and CPU worker processes), a real engine process that reserves
and commits its own blocks and never steps (`tierkv.bench.event_backlog writer`),
and this process as a second engine timing its lookups meanwhile."""

from __future__ import annotations

import pytest

from broker.events import MAX_QUEUED_KEYS, MAX_REPLY_KEYS
from tierkv.bench.event_backlog import (
    percentiles,
    start_writer,
    watch_writer,
    writer_report,
)

BLOCKS = 2048
GROUP = 1024  # keys a round trip: the previous group committed, the next reserved
CONTROL_S = 4.0  # the writer stepping every round trip: the same traffic, no backlog
# What the broker may grow by while the backlog builds. Its queue is ~5 MiB of keys
# and the owner map as large as the CPU tier; before the bounds it grew by ~100 MiB
# per 200,000 keys stored.
RSS_GROWTH = 64 * 2**20
MIN_KEYS = 200_000  # stored at the least, however slow the machine: enough to break it
LATENCY_FACTOR = 10.0  # a loaded 2-core machine's noise, not a stall
LATENCY_SLACK_S = 0.25


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


@pytest.mark.parametrize("backlog_s,max_keys", [
    pytest.param(60.0, 1_200_000, id="a-million-keys"),
    pytest.param(300.0, 1 << 40, id="five-minutes", marks=pytest.mark.slow),
])
def test_a_client_that_never_steps_neither_grows_the_broker_nor_stalls_others(
        make_cluster, backlog_s, max_keys):
    cluster = make_cluster(cpu={"num_blocks": BLOCKS}, tiers=[],
                           client={"timeout_s": 10.0})
    other = cluster.client()  # a lookup unanswered within 10 s raises BrokerUnavailable
    address = cluster.config.connect_address("client")
    broker_pid = cluster.node.pid("broker")
    probe = [b"other-engine-key-" + i.to_bytes(8, "big") for i in range(16)]

    def lookup() -> object:
        return other.lookup(probe, "other")

    def run(seconds: float, keys: int, stepping: bool):
        writer = start_writer(address, seconds, GROUP, keys, stepping)
        try:
            return watch_writer(writer, lookup, broker_pid, seconds + 120)
        finally:
            if writer.poll() is None:
                writer.kill()
            writer.wait(timeout=30)

    control, out = run(CONTROL_S, max_keys, stepping=True)
    assert writer_report(out)[0] > 0
    backlog, out = run(backlog_s, max_keys, stepping=False)
    stored, steps = writer_report(out)

    base_p50, base_p99, base_max = percentiles(control.latencies)
    p50, p99, worst = percentiles(backlog.latencies)
    start_rss = backlog.rss[0][1]
    peak_rss = max(rss for _, rss in backlog.rss)
    print(f"\n{stored:,} keys stored without a step in {backlog.rss[-1][0]:.0f} s; broker RSS "
          f"{start_rss / 2**20:.1f} -> peak {peak_rss / 2**20:.1f} MiB; the other client's "
          f"lookups: {len(control.latencies)} answered with the writer stepping (p50 "
          f"{_ms(base_p50)}, p99 {_ms(base_p99)}, max {_ms(base_max)}), "
          f"{len(backlog.latencies)} with the backlog (p50 {_ms(p50)}, p99 {_ms(p99)}, "
          f"max {_ms(worst)}); the writer's steps: "
          + ", ".join(f"{s['event_keys']} keys/{s['events_dropped']} dropped/"
                      f"{_ms(s['step_s'])}" for s in steps))

    assert stored >= MIN_KEYS, "the writer stored too little to judge"
    assert peak_rss - start_rss < RSS_GROWTH, (
        f"the broker grew by {(peak_rss - start_rss) / 2**20:.0f} MiB")
    assert p99 <= LATENCY_FACTOR * base_p99 + LATENCY_SLACK_S
    # The first step: one bounded reply, saying how much of the backlog was dropped;
    # the rest comes in bounded replies until the queue is empty.
    assert steps, "the writer's step got no reply"
    assert steps[0]["events_dropped"] > 0
    assert all(0 < s["event_keys"] <= MAX_REPLY_KEYS for s in steps[:-1])
    assert steps[-1]["event_keys"] == 0
    drained = sum(s["event_keys"] for s in steps)
    assert drained <= MAX_QUEUED_KEYS + 2 * BLOCKS  # the queue, and the tier's last keys
    # Dropped and delivered: every key was stored and (all but the tier's) evicted.
    assert sum(s["events_dropped"] for s in steps) + drained >= 2 * stored - BLOCKS
    events = other.stats()["events"]
    assert events["owned_keys"] <= BLOCKS  # no tier holds the evicted keys: no owner
    assert events["queued_keys"] == 0
