"""Trace replay over the real PrimaryTier, the policy table and its command."""

from __future__ import annotations

import json

import pytest

from tierkv.bench.replay import (
    HintMode,
    ReplayResult,
    derive_hints,
    geometric_mean,
    main,
    parse_policy,
    policy_table,
    replay,
    uses_hints,
)
from tierkv.core.policies import RequestHints
from tierkv.workloads.synthetic import generate_workload
from tierkv.workloads.traces import Request, prefix_hit_ratio, sessions

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
    assert main([str(path), "--capacities", "3", "4", "--policies", "lru", "histarc",
                 "--hints", "none"]) == 0
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


def test_hint_modes_parse_and_label():
    assert HintMode.parse("none") == HintMode()
    assert HintMode.parse("cont") == HintMode(True, 0.1)
    mode = HintMode.parse("cont:0.25+queue:32", seed=3)
    assert mode == HintMode(True, 0.25, 32, 3) and mode.label == "cont 75% + queue 32"
    for bad in ("queue", "cont:x", "bogus:1", "cont:2"):
        with pytest.raises(ValueError):
            HintMode.parse(bad)


# Two sessions: A = 1 2 | 1 2 3 4 | 1 2 3 4 5 6 (three turns), B = 7 8 (one turn).
SESSIONS = [(1, 2, 9), (7, 8, 10), (1, 2, 3, 4, 11), (1, 2, 3, 4, 5, 6, 12)]


def test_sessions_and_derived_hints_follow_the_trace_structure():
    trace = requests(SESSIONS)
    structure = sessions(trace)
    assert structure.session == (0, 1, 0, 0) and structure.turn == (0, 0, 1, 2)
    assert structure.continues == (True, False, True, False)
    right = derive_hints(trace, HintMode(True, 0.0))
    assert right[0] == RequestHints(session=0, turn=0, continues=True)
    wrong = derive_hints(trace, HintMode(True, 1.0))
    assert [h.continues for h in wrong] == [False, True, False, True]
    assert derive_hints(trace, HintMode(queue=4)) == [None] * 4


def test_a_shared_prefix_alone_does_not_link_sessions():
    # Every request opens with the system prompt 1; 1 2 4 continues 1 2 (tail 5),
    # 1 3 and 1 alone start sessions of their own.
    trace = requests([(1, 2, 5), (1, 3, 6), (1, 7), (1, 2, 4, 8), (1, 9)])
    assert sessions(trace).session == (0, 1, 2, 0, 3)


def test_replay_with_hints_runs_through_the_tier():
    trace = generate_workload("chat", 400, seed=1)
    plain = replay(trace, 150, "hitdensity")
    hinted = replay(trace, 150, "hitdensity", hints=HintMode(True, 0.0, 8))
    assert hinted.total_blocks == plain.total_blocks and hinted.hit_blocks > plain.hit_blocks
    # A policy that ignores hints gives the same figures with them.
    assert replay(trace, 150, "lru", hints=HintMode(True, 0.0, 8)) == replay(trace, 150, "lru")
    assert uses_hints("hitdensity") and not uses_hints("lru+reuse")


def test_policy_table_rows_per_hint_mode():
    trace = generate_workload("chat", 300, seed=2)
    modes = [HintMode(), HintMode(True, 0.1), HintMode(queue=8)]
    table = policy_table(trace, (100,), ("lru", "hitdensity"), modes)
    assert list(table.rows) == ["lru", "hitdensity", "hitdensity [cont 90%]",
                                "hitdensity [queue 8]"]
    assert table.exact and table.same_as == {"lru": "lru"}
    text = table.format("t")
    assert "hitdensity [queue 8]" in text and "ignore hints" in text


def test_policy_table_uses_the_upper_bound_where_ids_follow_several_parents():
    trace = generate_workload("rag-content", 300, seed=1)
    table = policy_table(trace, (50,), ("lru",))
    assert not table.exact
    assert table.optimum[0].hit_blocks >= table.rows["lru"][0].hit_blocks
    assert "upper bound" in table.format()


def test_main_on_synthetic_workloads_prints_a_summary(capsys):
    assert main(["--workloads", "chat", "agent", "--requests", "150", "--capacities", "50",
                 "--policies", "lru", "hitdensity", "--hints", "none", "queue:4"]) == 0
    out = capsys.readouterr().out
    assert "synthetic 'agent'" in out and "min/lru" in out and "hitdensity [queue 4]" in out


def test_main_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit, match="unknown workload"):
        main(["--workloads", "nope"])
    with pytest.raises(SystemExit, match="not a hint mode"):
        main(["--workloads", "chat", "--hints", "sometimes"])
    with pytest.raises(SystemExit, match="no trace"):
        main([str(tmp_path / "missing.jsonl")])
