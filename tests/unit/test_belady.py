"""Belady's offline reference: hand cases, brute-force optimality, the real trace."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tierkv.bench.belady import (
    NEVER,
    belady,
    brute_force_hits,
    next_uses,
    prefix_consistent,
    reachable_repeats,
    reference,
)
from tierkv.core.policies import known_policies, make_policy
from tierkv.core.primary import PrimaryTier
from tierkv.workloads.traces import Request, default_trace_path, prefix_hit_ratio, read_trace

TRACE = default_trace_path() or Path("/nonexistent")


def random_trace(rng: random.Random, n_requests: int = 5, n_keys: int = 5) -> list[list[int]]:
    """Any ids in any order: not prefix-consistent."""
    return [[rng.randrange(n_keys) for _ in range(rng.randint(1, 3))] for _ in range(n_requests)]


def prefix_trace(rng: random.Random, n_requests: int = 5, depth: int = 4) -> list[list[int]]:
    """Random walks down a binary trie: each id always follows the same parent id."""
    ids: dict[tuple[int, int], int] = {}
    trace = []
    for _ in range(n_requests):
        parent, row = -1, []
        for _ in range(rng.randint(1, depth)):
            parent = ids.setdefault((parent, rng.randrange(2)), len(ids))
            row.append(parent)
        trace.append(row)
    return trace


def test_next_uses_are_global_positions():
    assert next_uses([[1, 2], [2, 3], [1]]) == [[4, 2], [NEVER, NEVER], [NEVER]]


def test_hand_case_bypass_and_demand():
    # Capacity 2. After [1, 2], 1 is used again soonest; 3 and 4 are never used again.
    trace = [[1, 2], [3, 4], [1], [2]]
    optimum = belady(trace, 2, bypass=True)
    assert (optimum.hit_blocks, optimum.total_blocks) == (2, 6)  # 3 and 4 bypassed
    # Demand: 3 and 4 must be stored, evicting both 1 and 2.
    assert belady(trace, 2, bypass=False).hit_blocks == 0


def test_demand_refuses_a_request_larger_than_the_cache_like_primary_tier():
    trace = [[1], [2, 3, 4], [1]]
    result = belady(trace, 2, bypass=False)
    assert result.refused == 1 and result.hit_blocks == 1


def test_demand_belady_bounds_lru_through_the_real_tier():
    rng = random.Random(7)
    trace = prefix_trace(rng, n_requests=200, depth=6)
    requests = [_request(row) for row in trace]
    for capacity in (2, 4, 8):
        lru = prefix_hit_ratio(requests, PrimaryTier(capacity, make_policy("lru", capacity)))
        assert lru <= belady(trace, capacity, bypass=False).hit_ratio + 1e-12


@pytest.mark.parametrize("bypass", [True, False])
def test_belady_is_the_optimum_of_all_hits_on_random_traces(bypass):
    rng = random.Random(1)
    for _ in range(150):
        trace, capacity = random_trace(rng), rng.randint(1, 4)
        best = brute_force_hits(trace, capacity, bypass=bypass, prefix=False)
        assert belady(trace, capacity, bypass=bypass).any_hits == best, (trace, capacity)


@pytest.mark.parametrize("bypass", [True, False])
def test_belady_is_the_optimum_of_prefix_hits_on_prefix_traces(bypass):
    rng = random.Random(2)
    for _ in range(150):
        trace, capacity = prefix_trace(rng), rng.randint(1, 5)
        result = belady(trace, capacity, bypass=bypass)
        assert result.hit_blocks == result.any_hits  # the kept cache is prefix-closed
        assert result.hit_blocks == brute_force_hits(trace, capacity, bypass=bypass), (
            trace, capacity)


def test_prefix_hits_may_miss_the_optimum_on_traces_without_prefix_structure():
    # Documented limit: without prefix consistency, next use is not the whole story.
    rng = random.Random(3)
    short = 0
    for _ in range(200):
        trace, capacity = random_trace(rng), rng.randint(1, 4)
        ours = belady(trace, capacity).hit_blocks
        best = brute_force_hits(trace, capacity)
        assert ours <= best
        short += ours < best
    assert short > 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        belady([[1]], 0)


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not present")
def test_trace_prefix_is_prefix_closed_and_bypass_helps():
    trace = [r.hash_ids for r in read_trace(TRACE, limit=2000)]
    optimum, demand = belady(trace, 1000, bypass=True), belady(trace, 1000, bypass=False)
    assert optimum.hit_blocks == optimum.any_hits and demand.hit_blocks == demand.any_hits
    assert optimum.hit_blocks >= demand.hit_blocks


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not present")
def test_trace_reproduces_the_documented_figures():
    trace = [r.hash_ids for r in read_trace(TRACE)]
    documented = {1000: (0.1907, 0.1792), 4000: (0.3223, 0.3205), 16000: (0.3664, 0.3664)}
    for capacity, (optimum, demand) in documented.items():
        assert belady(trace, capacity, bypass=True).hit_ratio == pytest.approx(optimum, abs=1e-4)
        assert belady(trace, capacity, bypass=False).hit_ratio == pytest.approx(demand, abs=1e-4)


def test_blocks_are_counted_by_position_as_the_replay_counts_them():
    # A request that names an id twice counts two blocks, hit or missed, in both.
    trace = [[1, 2, 1], [1, 2, 1, 3], [3, 3]]
    requests = [_request(row) for row in trace]
    tier = PrimaryTier(4, "lru")
    prefix_hit_ratio(requests, tier)
    stats = tier.stats()
    result = belady(trace, 4)
    assert result.total_blocks == stats["hits"] + stats["misses"] == 9
    # Belady keeps 1, 2, 3: the second request hits 1 2 1 and 3 is new; the third
    # hits 3 3.
    assert result.hit_blocks == 5


def test_prefix_consistency():
    assert prefix_consistent([[1, 2, 3], [1, 2, 4], [5]])
    assert not prefix_consistent([[1, 2], [3, 2]])  # 2 after two parents
    assert not prefix_consistent([[1, 2, 1]])  # a repeated id
    assert not prefix_consistent([[1], [2, 1]])  # 1 starts one request, follows another


def test_reachable_repeats():
    # The second 1 of [1, 2, 1] cannot hit (1 was never stored); later repeats can.
    assert reachable_repeats([[1, 2, 1], [3, 1, 1], [4, 4]]) == 1


def test_reference_is_exact_on_prefix_traces():
    rng = random.Random(5)
    trace = prefix_trace(rng, n_requests=60, depth=5)
    ref = reference(trace, 4)
    assert ref.exact and ref.bound == ref.greedy == belady(trace, 4)


def test_reference_bounds_every_schedule_on_traces_without_prefix_structure():
    """Random ids (several parents, repeats): the reference is a true upper bound on
    prefix hits, checked against the exhaustive optimum, while the greedy's own
    prefix hits can fall short of it."""
    rng = random.Random(11)
    for _ in range(150):
        trace = [[rng.randrange(5) for _ in range(rng.randint(1, 4))] for _ in range(5)]
        capacity = rng.randint(1, 4)
        ref = reference(trace, capacity)
        best = brute_force_hits(trace, capacity, bypass=True, prefix=True)
        assert ref.bound.hit_blocks >= best, (trace, capacity)
        assert ref.greedy.hit_blocks <= best


@pytest.mark.parametrize("name", ["lru", "histarc", "hitdensity"])
def test_policies_stay_below_the_bound_on_content_addressed_traces(name):
    from tierkv.workloads.synthetic import generate_workload

    trace = generate_workload("rag-content", 600, seed=3)
    ids = [r.hash_ids for r in trace]
    for capacity in (50, 200):
        ref = reference(ids, capacity)
        assert not ref.exact
        ratio = prefix_hit_ratio(trace, PrimaryTier(capacity, make_policy(name, capacity)))
        assert ratio <= ref.bound.hit_ratio + 1e-12


def test_every_registered_policy_stays_below_belady_on_prefix_traces():
    rng = random.Random(8)
    trace = prefix_trace(rng, n_requests=300, depth=6)
    requests = [_request(row) for row in trace]
    for name in known_policies():
        for capacity in (3, 8):
            ratio = prefix_hit_ratio(requests, PrimaryTier(capacity, make_policy(name, capacity)))
            assert ratio <= belady(trace, capacity).hit_ratio + 1e-12, (name, capacity)


def _request(row: list[int]) -> Request:
    return Request(0.0, 0, 0, tuple(row))
