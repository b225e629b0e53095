"""Belady's offline reference: hand cases, brute-force optimality, the real trace."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tierkv.bench.belady import NEVER, belady, brute_force_hits, next_uses
from tierkv.core.policies import make_policy
from tierkv.core.primary import PrimaryTier
from tierkv.workloads.traces import Request, prefix_hit_ratio, read_trace

TRACE = Path(__file__).resolve().parents[3] / "shared/data/mooncake-fast25/conversation_trace.jsonl"


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


def _request(row: list[int]) -> Request:
    return Request(0.0, 0, 0, tuple(row))
