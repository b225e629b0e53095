"""The load-or-recompute rule in a real node: an engine that says what recomputing
costs it is served from a secondary tier only where loading is expected to be
faster, is told what was skipped and why, and the tier's cost is learned from the
promotions it does serve (the request's own, and those made while it is idle)."""

from __future__ import annotations

import pytest

from tests.integration.cluster import keys, step_until, store_when_room, wait_for
from tierkv.client import RequestContext

# A memory tier in its own process, assumed (until measured) to take a minute a job.
SLOW_PRIOR = {"type": "memory", "capacity_blocks": 256, "threads": 2,
              "load_latency_ms": 60_000.0}


def only_in_the_tier(cluster, c, first: list[bytes]) -> None:
    """Store `first`, let it reach the tier, then push it out of the CPU tier."""
    cluster.fill(first, list(range(8)))
    wait_for(c, {store_when_room(c, first, list(range(8))).job_id})
    step_until(c, lambda: c.stats()["tiers"]["memory"]["blocks"] >= len(first))
    other = keys(*range(100, 116))
    cluster.fill(other, list(range(8, 24)))
    wait_for(c, {store_when_room(c, other, list(range(8, 24))).job_id})


def test_a_tier_slower_than_recomputing_is_skipped_and_said(make_cluster):
    cluster = make_cluster(tiers=[SLOW_PRIOR])
    c = cluster.client()
    first = keys(*range(8))
    only_in_the_tier(cluster, c, first)

    c.recompute_rate(100_000, tokens_per_key=16)  # 0.16 ms a key: a minute is too long
    found = c.lookup(first, "fast-engine")
    assert (found.hits, found.pending, found.slower) == (0, False, {"memory": 8})
    stats = c.stats()
    assert stats["tiers"]["memory"]["slower_than_recompute"] == 8
    assert stats["tiers"]["memory"]["load_cost"]["latency_ms"] == pytest.approx(60_000.0)
    # At most a trial in the background (never waited for), no promotion for it.
    assert stats["tiering"]["promotions_started"] == stats["tiering"]["background_promotions"]


def test_an_engine_that_computes_slowly_waits_for_the_tier_and_is_served(make_cluster):
    cluster = make_cluster(tiers=[SLOW_PRIOR])
    c = cluster.client()
    first = keys(*range(8))
    only_in_the_tier(cluster, c, first)

    c.recompute_rate(0.01, tokens_per_key=16)  # 26 minutes a key: anything is faster
    found = c.lookup(first, "slow-engine")
    assert found.pending and not found.slower
    step_until(c, lambda: c.lookup(first, "slow-engine").hits == 8)
    cost = c.stats()["tiers"]["memory"]["load_cost"]
    assert cost["samples"] >= 1 and cost["latency_ms"] < 60_000.0  # learned: faster


def test_a_request_budget_bounds_its_wait(make_cluster):
    cluster = make_cluster(tiers=[SLOW_PRIOR])
    c = cluster.client()
    first = keys(*range(8))
    only_in_the_tier(cluster, c, first)
    batch = c.batch().context(RequestContext("r-budget", load_budget_s=0.001))
    (found,) = batch.lookup(first, "r-budget").send()
    assert not found.pending and found.slower == {"memory": 8}


def test_an_engine_that_says_nothing_loads_whatever_it_costs(make_cluster):
    cluster = make_cluster(tiers=[SLOW_PRIOR])
    c = cluster.client()
    first = keys(*range(8))
    only_in_the_tier(cluster, c, first)
    assert c.lookup(first, "any").pending
    step_until(c, lambda: c.lookup(first, "any").hits == 8)


def test_what_was_skipped_is_promoted_while_the_tier_is_idle(make_cluster):
    cluster = make_cluster(tiers=[SLOW_PRIOR])
    c = cluster.client()
    first = keys(*range(8))
    only_in_the_tier(cluster, c, first)
    c.recompute_rate(100_000, tokens_per_key=16)
    for req in ("a", "b"):  # asked for twice: reused, worth a CPU row
        assert not c.lookup(first, req).pending
        c.finish(req)
    # The tier is idle: the skipped blocks come up in the background, and the
    # estimate learns from them, so the next engine's lookup finds them.
    step_until(c, lambda: c.lookup(first, "c").hits == 8)
    stats = c.stats()
    assert stats["tiering"]["background_promotions"] >= 8
    assert stats["tiers"]["memory"]["load_cost"]["samples"] >= 1
