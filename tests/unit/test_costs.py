"""The load-or-recompute rule: the per-tier estimator, the split point, and what a
lookup does with them (TieringManager over real shared memory and MemoryTier)."""

from __future__ import annotations

import random

import pytest

from tierkv.core.costs import (
    DEFAULT_COSTS,
    LinearCost,
    Recompute,
    TierCosts,
    best_split,
    prior_for,
    recompute_for,
)
from tierkv.core.primary import PrimaryTier
from tierkv.core.shm import SharedRegion
from tierkv.core.tiering import TieringManager
from tierkv.tiers.memory import MemoryTier

MB = 1e6


def line_samples(cost: LinearCost, latency: float, bandwidth: float, n: int,
                 rng: random.Random, noise: float = 0.05) -> None:
    for _ in range(n):
        nbytes = rng.choice([64e3, 512e3, 2e6, 8e6])
        seconds = (latency + nbytes / bandwidth) * (1 + rng.uniform(-noise, noise))
        cost.observe(nbytes, seconds)


def test_cold_start_is_the_prior_and_a_configured_figure_replaces_the_types():
    cost = LinearCost(*prior_for("s3"))
    latency, bandwidth = DEFAULT_COSTS["s3"]
    assert cost.predict(0) == pytest.approx(latency)
    assert cost.predict(bandwidth) == pytest.approx(latency + 1.0)
    assert prior_for("s3", latency_ms=2.0) == (0.002, bandwidth)
    assert prior_for("disk", bandwidth_mb_s=3000) == (DEFAULT_COSTS["disk"][0], 3000 * MB)
    assert prior_for("a-plugin-type") != prior_for("disk")  # an unknown type has its own


def test_the_line_is_learned_from_promotions_of_several_sizes():
    cost = LinearCost(*prior_for("s3"))  # 50 ms, 100 MB/s assumed
    line_samples(cost, 0.004, 1500 * MB, 200, random.Random(1))
    assert cost.latency_s == pytest.approx(0.004, rel=0.25)
    assert cost.bandwidth == pytest.approx(1500 * MB, rel=0.15)


def test_samples_of_one_size_still_predict_that_size():
    cost = LinearCost(0.010, 100 * MB)
    for _ in range(100):
        cost.observe(1e6, 0.002)
    assert cost.predict(1e6) == pytest.approx(0.002, rel=0.1)
    assert cost.latency_s >= 0 and cost.bandwidth > 0


def test_drift_is_followed_within_a_few_half_lives():
    cost = LinearCost(0.010, 100 * MB)
    rng = random.Random(2)
    line_samples(cost, 0.002, 2000 * MB, 200, rng)
    fast = cost.predict(2e6)
    line_samples(cost, 0.030, 100 * MB, 150, rng)  # the tier got 10x slower
    assert cost.predict(2e6) == pytest.approx(0.030 + 2e6 / (100 * MB), rel=0.2)
    assert cost.predict(2e6) > 10 * fast


def test_an_odd_outlier_moves_the_estimate_little():
    cost = LinearCost(0.010, 100 * MB)
    line_samples(cost, 0.002, 2000 * MB, 200, random.Random(3), noise=0.0)
    before = cost.predict(2e6)
    cost.observe(2e6, 30.0)  # one job stuck for 30 s
    assert cost.clipped == 1
    assert cost.predict(2e6) < 1.5 * before
    line_samples(cost, 0.002, 2000 * MB, 20, random.Random(4), noise=0.0)
    assert cost.predict(2e6) == pytest.approx(before, rel=0.1)


def test_a_tier_that_stays_slower_is_followed_within_a_few_samples():
    cost = LinearCost(0.010, 100 * MB)
    line_samples(cost, 0.001, 2000 * MB, 200, random.Random(5), noise=0.0)
    for _ in range(8):
        cost.observe(1e6, 0.5)  # 500x slower from now on
    assert cost.predict(1e6) > 0.2


def test_a_stalled_tier_is_slow_at_once_and_learns_from_the_overrun():
    costs = TierCosts(0.001, 1000 * MB)
    costs.started(1, now=100.0, nbytes=1_000_000)
    assert costs.eta(1_000_000, now=100.0) < 0.01
    assert costs.eta(1_000_000, now=110.0) >= 10.0  # stuck for 10 s: new loads wait
    assert costs.remaining(1, now=110.0) >= 10.0
    assert costs.finished(1, now=112.0, landed=False) == pytest.approx(12.0)
    assert costs.queued_bytes == 0
    assert costs.line.predict(2_000_000) > 0.004  # the failure was slow: it counted


def test_a_fast_failure_says_nothing_of_the_speed():
    costs = TierCosts(0.010, 100 * MB)
    before = costs.line.predict(1e6)
    costs.started(7, now=0.0, nbytes=1_000_000)
    costs.finished(7, now=0.0001, landed=False)
    assert costs.line.predict(1e6) == before and costs.line.samples == 0


def test_queued_bytes_are_ahead_of_a_new_promotion():
    costs = TierCosts(0.0, 100 * MB)
    alone = costs.eta(1_000_000, now=0.0)
    costs.started(1, now=0.0, nbytes=10_000_000)
    assert costs.eta(1_000_000, now=0.0) == pytest.approx(alone + 0.1)


def test_best_split_loads_what_beats_recomputing():
    per_key = Recompute(0.010)
    assert best_split([0.001] * 8, per_key) == (8, 0.001)  # fast tier: load it all
    assert best_split([1.0] * 8, per_key) == (0, 0.0)  # slower than 80 ms: recompute
    # Ready keys then a slow tier: keep the ready ones, recompute the rest.
    assert best_split([0.0] * 4 + [1.0] * 4, per_key)[0] == 4
    # A wait worth paying only for a long enough prefix.
    assert best_split([0.0, 0.05] + [0.05] * 10, per_key)[0] == 12
    assert best_split([0.0, 0.05], per_key)[0] == 1
    assert best_split([], per_key) == (0, 0.0)


def test_a_budget_takes_the_longest_prefix_that_fits():
    assert best_split([0.01, 0.02, 0.5, 0.6], Recompute(0.0, budget_s=0.1))[0] == 2
    assert best_split([0.2], Recompute(0.0, budget_s=0.1))[0] == 0


def test_what_an_engine_says_becomes_the_rule_input():
    assert recompute_for(0.0, 16) is None and recompute_for(1000.0, 0) is None
    assert recompute_for(1000.0, 16) == Recompute(0.016)
    assert recompute_for(0.0, 0, budget_s=0.5) == Recompute(0.0, 0.5)
    assert Recompute(0.016).wait_bound(10) > 0.16


# -- the rule in a lookup ----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def region(instance):
    with SharedRegion.create(instance, num_blocks=16, page_size=4096) as r:
        yield r


def keys(*ns: int) -> list[bytes]:
    return [n.to_bytes(8, "big") for n in ns]


def node(region, prior, clock=None, auto_complete=True):
    """A manager over one memory tier holding keys 1..8 (and not the CPU tier)."""
    tier = MemoryTier(region, name="slowtier", auto_complete=auto_complete)
    mgr = TieringManager(PrimaryTier(16), [tier], cost_priors=[prior],
                         clock=clock or Clock())
    out = mgr.prepare_store(keys(*range(1, 9)))
    mgr.complete_store(out.keys_to_store)
    for _ in range(3):
        tier.complete_pending()
        mgr.step()
    mgr.primary.clear()
    assert all(tier.holds(k) for k in keys(*range(1, 9)))
    return mgr, tier


def test_a_tier_slower_than_recomputing_is_a_miss_said_per_tier(region):
    mgr, _ = node(region, prior=(0.5, 1e6))  # 0.5 s a job
    found = mgr.lookup(keys(*range(1, 9)), "r1", recompute=Recompute(0.001))
    assert (found.hits, found.pending, found.slower) == (0, False, (8,))
    stats = mgr.stats()
    assert stats["tiering"]["slower_than_recompute"] == 8
    assert stats["tiers"]["slowtier"]["slower_than_recompute"] == 8
    # One block is tried in the background (the tier is idle), not waited for: what
    # the tier really costs is measured even while every lookup skips it.
    assert stats["tiering"]["promotions_started"] == 1
    assert stats["tiering"]["background_promotions"] == 1


def test_a_tier_faster_than_recomputing_is_promoted(region):
    mgr, tier = node(region, prior=(0.0001, 1e10))
    found = mgr.lookup(keys(*range(1, 9)), "r1", recompute=Recompute(0.010))
    assert found.pending and not found.slower
    mgr.step()
    tier.complete_pending()
    mgr.step()
    assert mgr.lookup(keys(*range(1, 9)), "r1", recompute=Recompute(0.010)).hits == 8
    cost = mgr.stats()["tiers"]["slowtier"]["load_cost"]
    assert cost["samples"] == 1


def test_without_a_recompute_cost_every_promotion_goes(region):
    mgr, _ = node(region, prior=(60.0, 1e3))
    assert mgr.lookup(keys(*range(1, 9)), "r1").pending


def test_split_keeps_the_cpu_hits_and_recomputes_the_slow_rest(region):
    mgr, tier = node(region, prior=(0.5, 1e6))
    out = mgr.prepare_store(keys(1, 2, 3))
    mgr.complete_store(out.keys_to_store)
    found = mgr.lookup(keys(*range(1, 9)), "r1", recompute=Recompute(0.001))
    assert (found.hits, found.pending, found.slower) == (3, False, (5,))


def test_a_promotion_past_the_requests_bound_turns_into_a_miss(region):
    clock = Clock()
    mgr, tier = node(region, prior=(0.001, 1e10), clock=clock, auto_complete=False)
    cost = Recompute(0.010)  # 8 keys: 80 ms to recompute
    assert mgr.lookup(keys(*range(1, 9)), "r1", recompute=cost).pending
    mgr.step()  # sent; the tier holds it (stalled)
    clock.now += 0.05
    assert mgr.lookup(keys(*range(1, 9)), "r1", recompute=cost).pending
    clock.now += 0.5  # far past 80 ms and its margin
    found = mgr.lookup(keys(*range(1, 9)), "r1", recompute=cost)
    assert not found.pending and found.hits == 0
    assert mgr.stats()["tiering"]["promotions_overrun"] == 8
    # Another request now sees the stall in the estimate and does not wait on it.
    other = mgr.lookup(keys(*range(1, 9)), "r2", recompute=cost)
    assert not other.pending
    # The stalled job lands in the end: the tier's line learns it was slow.
    before = mgr.costs[0].line.predict(8 * 4096)
    tier.complete_pending()
    mgr.step()
    mgr.step()
    assert mgr.costs[0].line.predict(8 * 4096) > 2 * before
    assert mgr.lookup(keys(*range(1, 9)), "r3", recompute=cost).hits == 8  # it landed


def test_skipped_blocks_are_promoted_in_the_background_while_the_tier_is_idle(region):
    mgr, tier = node(region, prior=(0.5, 1e6))
    found = mgr.lookup(keys(*range(1, 9)), "r1", recompute=Recompute(0.001))
    assert not found.pending
    mgr.finish("r1")
    mgr.step()  # the tier is idle: the skipped keys go in the background (free rows)
    tier.complete_pending()
    mgr.step()
    assert mgr.stats()["tiering"]["background_promotions"] == 8
    assert mgr.lookup(keys(*range(1, 9)), "r2", recompute=Recompute(0.001)).hits == 8


def test_background_promotions_wait_while_a_request_loads_from_the_tier(region):
    mgr, tier = node(region, prior=(0.5, 1e6), auto_complete=False)
    mgr.lookup(keys(5, 6), "eager")  # a request that loads whatever it costs
    mgr.lookup(keys(1, 2), "slow", recompute=Recompute(0.001))  # skipped: 2 keys
    mgr.step()
    assert mgr.stats()["tiering"]["background_promotions"] == 0
    tier.complete_pending()
    mgr.step()  # the request's job is done: now the skipped keys go
    assert mgr.stats()["tiering"]["background_promotions"] == 2
