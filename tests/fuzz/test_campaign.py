"""The hostile-input campaign of issue 20 against a real node: no crash, no hang, a
legitimate client byte-exact throughout, no bystander killed, the log and the
broker's memory bounded. The suite runs a short one; `pytest -m slow -s
tests/fuzz/test_campaign.py` runs the full one (>= 100,000 inputs, then as many
again to see whether memory keeps growing) and prints its figures."""

from __future__ import annotations

import subprocess

import pytest

from tests.fuzz.campaign import Campaign


@pytest.fixture
def bystander():
    """A process nobody but this test started: no input may get it killed."""
    proc = subprocess.Popen(["sleep", "600"])
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
