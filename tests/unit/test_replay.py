"""Trace replay over the real PrimaryTier, the policy table and its command."""

from __future__ import annotations

import json

import pytest

from tierkv.bench.replay import (
    ReplayResult,
    geometric_mean,
    main,
    parse_policy,
    policy_table,
    replay,
)
from tierkv.workloads.synthetic import generate_workload
from tierkv.workloads.traces import Request, prefix_hit_ratio

# Capacity 3, hand-replayed (LRU order after each request):
#   [1, 2]     0 hits, store 1 2                          order 1 2
#   [1, 2, 3]  2 hits, touch 1 2, store 3                 order 1 2 3
#   [4]        0 hits, evict 1, store 4                   order 2 3 4
#   [1, 2]     0 hits (1 is gone), evict 3 (2 is the
#              request's own), store 1                    order 2 4 1
#   [1, 2, 3]  2 hits, touch 1 2, evict 4, store 3        order 1 2 3
# LRU: 4 hits of 11 blocks, 3 evictions.
# Belady with bypass never stores 4 and hits 1 2 | 1 2 | 1 2 3: 7 hits.
# Belady on demand must store 4 and evicts 3 (used last): 6 hits.
HAND = [(1, 2), (1, 2, 3), (4,), (1, 2), (1, 2, 3)]


def requests(rows: list[tuple[int, ...]]) -> list[Request]:
    return [Request(float(i), 512 * len(row), 1, row) for i, row in enumerate(rows)]


def test_lru_on_the_hand_trace():
    result = replay(requests(HAND), 3, "lru")
    assert result == ReplayResult("lru", 3, hit_blocks=4, total_blocks=11, evictions=3)
    assert result.hit_ratio == pytest.approx(4 / 11)


def test_reuse_filter_variant_on_the_hand_trace():
    # Threshold 2: 1 and 2 are stored on their second lookup, 3 on its second, 4 never.
    result = replay(requests(HAND), 3, "lru+reuse")
    assert (result.hit_blocks, result.total_blocks, result.evictions) == (4, 11, 0)
    assert replay(requests(HAND), 3, "lru", reuse_threshold=2) == ReplayResult(
        "lru", 3, 4, 11, 0)


def test_replay_agrees_with_prefix_hit_ratio():
    from tierkv.core.primary import PrimaryTier

    trace = generate_workload("chat", 300, seed=3)
    for name in ("lru", "arc", "histarc"):
        assert replay(trace, 200, name).hit_ratio == pytest.approx(
            prefix_hit_ratio(trace, PrimaryTier(200, name)))


def test_policy_table_on_the_hand_trace():
    table = policy_table(requests(HAND), capacities=(3,), policies=("lru",))
    assert table.optimum[0].hit_blocks == 7 and table.demand[0].hit_blocks == 6
    assert table.fractions("lru") == [pytest.approx(4 / 7)]
    assert table.geomean("lru") == pytest.approx(4 / 7)
    text = table.format("hand")
    assert "lru" in text and "belady" in text and "0.571" in text


def test_parse_policy():
    assert parse_policy("arc") == ("arc", None)
    assert parse_policy("lru+reuse") == ("lru", 2)
    assert parse_policy("lru+reuse3") == ("lru", 3)
    with pytest.raises(ValueError):
        parse_policy("lru+bogus")


def test_geometric_mean():
    assert geometric_mean([0.25, 1.0]) == pytest.approx(0.5)
    assert geometric_mean([]) == 0.0 and geometric_mean([0.0, 1.0]) == 0.0


def test_main_prints_the_table(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 1, "output_length": 1, "hash_ids": list(r)})
        + "\n" for i, r in enumerate(HAND)))
    assert main([str(path), "--capacities", "3", "4", "--policies", "lru", "histarc"]) == 0
    out = capsys.readouterr().out
    assert "5 requests" in out and "histarc" in out and "belady-demand" in out


def test_main_rejects_unknown_policy(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1]}\n')
    with pytest.raises(SystemExit, match="unknown cache policy"):
        main([str(path), "--policies", "mru"])


def test_histarc_beats_lru_on_a_scan_heavy_synthetic_workload():
    # Long one-off requests interleaved with conversations: LRU lets the scans flush
    # the conversations, histarc keeps what was used twice. Deterministic (seed 0).
    trace = generate_workload("scan", 1000, seed=0)
    lru, ours = replay(trace, 500, "lru"), replay(trace, 500, "histarc")
    assert ours.hit_ratio > 1.5 * lru.hit_ratio


def test_oracle_admission_bound_on_the_hand_trace():
    """scripts/policy_bound.py: storing only blocks used again, LRU keeps 1 2 3 and
    never stores 4, which is what Belady with bypass does here: 7 hits of 11."""
    from scripts.policy_bound import oracle_admission

    assert oracle_admission(HAND, 3, "lru") == pytest.approx(7 / 11)
    # Capacity 1: a request's own blocks are not evicted for each other, so 1 is
    # kept and 2, 3 are not stored: one hit in each of the three later requests.
    assert oracle_admission(HAND, 1, "lru") == pytest.approx(3 / 11)
