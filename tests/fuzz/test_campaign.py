"""The hostile-input campaign against a real node: no crash, no hang, a
legitimate client byte-exact throughout, no bystander killed, the log and the
broker's memory bounded. The suite runs a short one; `pytest -m slow -s
tests/fuzz/test_campaign.py` runs the full one (>= 100,000 inputs, then as many
again to see whether memory keeps growing) and prints its figures.

The cross-peer mode (`CrossPeerCampaign`): four real clients, two of them
given the engine's KV tokens, on one small key space and on each other's keys, with
forged hellos naming the live worker and tier and messages over every limit. The
suite runs 2,000 inputs; the slow variant 100,000."""

from __future__ import annotations

import subprocess

import pytest

from tests.fuzz.campaign import CROSS_NODE, LIMIT_CASES, Campaign, CrossPeerCampaign


@pytest.fixture
def bystander():
    """A process nobody but this test started: no input may get it killed."""
    proc = subprocess.Popen(["sleep", "7200"])  # outlives the slowest campaign
    yield proc
    proc.kill()
    proc.wait(5)


def run(make_cluster, bystander, per_socket: int, floods: int = 1) -> list:
    cluster = make_cluster(cpu={"num_blocks": 64}, broker={"heartbeat_s": 0.5})
    campaign = Campaign(cluster, seed=20, bystander=bystander.pid)
    try:
        results = []
        for _ in range(floods):
            f = campaign.run(per_socket)
            print(f"\nhostile-input campaign: {f.line()}")
            results.append((f.rss_mb[-1], f.log_bytes[-1]))
        f = campaign.figures
        assert f.crashes == 0 and f.hangs == 0 and f.roundtrips_bad == 0, f.line()
        assert bystander.poll() is None, "a hostile hello got a bystander killed"
        assert f.fds[-1] <= f.fds[0] + 16, f.line()  # no socket or file leaks
        return results
    finally:
        campaign.close()


def test_a_short_campaign_on_all_three_sockets(make_cluster, bystander):
    (rss, log_bytes), = run(make_cluster, bystander, per_socket=700)
    # 2,100 inputs, many of them megabytes of foreign text: the log stays small.
    assert log_bytes < 400_000, log_bytes


@pytest.mark.slow
def test_the_full_campaign_and_a_second_flood(make_cluster, bystander):
    (rss1, log1), (rss2, log2) = run(make_cluster, bystander, per_socket=34_000, floods=2)
    assert log2 < 4 * 2**20
    assert rss2 - rss1 < 0.5 * max(rss1, 1)  # a second equal flood does not grow it as much


def cross_peers(make_cluster, bystander, inputs: int, check_every: int):
    cluster = make_cluster(**CROSS_NODE)
    campaign = CrossPeerCampaign(cluster, seed=24, bystander=bystander.pid)
    try:
        f = campaign.run(inputs, check_every)
    finally:
        campaign.close()
    print(f"\ncross-peer campaign: {f.line()}")
    print(f"inputs by kind: {dict(f.kinds.most_common())}")
    if f.anomalies:
        print("\n".join(["anomalies:", *f.anomalies]))
    for name, tail in f.logs.items():
        print(f"--- the last lines of {name}'s log:\n{tail}")
    assert not f.faults(), f.line()
    assert f.end == {**f.end, "owners left": 0, "blocks writing": 0, "leases": 0,
                     "invariants": "ok", "rows reclaimed": cluster.config.cpu.num_blocks}, f.end
    assert bystander.poll() is None, "a hostile hello got a bystander killed"
    assert f.fds[-1] <= f.fds[0] + 16, f.line()  # no socket or file leaks
    # It did what it is for: refused operations on others' state, read what it
    # held, moved blocks, was refused peers and messages over the limits.
    assert f.codes["not_owner"] and f.reads and f.jobs_done["load ok"], f.line()
    assert f.forged and f.oversized >= len(LIMIT_CASES) and f.reconnects, f.line()
    return f


def test_a_short_cross_peer_campaign(make_cluster, bystander):
    cross_peers(make_cluster, bystander, inputs=2_000, check_every=250)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_full_cross_peer_campaign(make_cluster, bystander):
    cross_peers(make_cluster, bystander, inputs=100_000, check_every=250)
