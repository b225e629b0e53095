"""The simulated TTFT of `tierkv replay --ttft`: the rule loads where loading is
faster, recomputes where it is not, and on the real trace beats both fixed policies
without slowing any request down."""

from __future__ import annotations

import json

import pytest

from tierkv.bench.replay import main as replay_main
from tierkv.bench.ttft_sim import SimParams, compare
from tierkv.workloads.traces import Request, default_trace_path, read_trace

SESSIONS, TURNS, BLOCKS_PER_TURN = 24, 4, 6


def sessions_trace(interval_ms: float = 2000.0) -> list[Request]:
    """Multi-turn sessions taken in turn: each turn repeats its session's earlier
    blocks and adds its own, and the other sessions in between push them out of a
    small CPU tier, so a lower tier or the engine must provide them. Arrivals are
    far enough apart that no request queues behind another."""
    out = []
    for turn in range(TURNS):
        for session in range(SESSIONS):
            ids = tuple(session * 1000 + j for j in range(BLOCKS_PER_TURN * (turn + 1)))
            out.append(Request(len(out) * interval_ms, 512 * len(ids), 1, ids))
    return out


# 4 MiB blocks: the disk prior (5 ms + 500 MB/s, 13 ms a block) is below the 34 ms a
# block costs to recompute, so the rule starts by loading and learns from it.
SMALL_BLOCKS = {"kv_bytes_per_token": 8 * 1024, "cpu_blocks": 32, "disk_blocks": 100_000}


def test_the_rule_loads_from_a_fast_tier():
    report = compare(sessions_trace(), SimParams(**SMALL_BLOCKS, disk_gbps=3.0))
    never, always, rule = (report.results[p] for p in ("never-offload", "always-load", "tierkv"))
    assert always.mean_s < 0.7 * never.mean_s  # loading clearly wins here
    assert rule.tokens["disk"] >= 0.95 * always.tokens["disk"] > 0
    assert rule.mean_s <= 1.02 * always.mean_s
    assert rule.slower == 0
    assert rule.learned["disk"]["bandwidth_mb_s"] == pytest.approx(3000, rel=0.05)


def test_the_rule_learns_a_slow_tier_and_recomputes():
    # The same disk prior, but the disk really moves 20 MB/s (200 ms a block).
    report = compare(sessions_trace(), SimParams(**SMALL_BLOCKS, disk_gbps=0.02))
    never, always, rule = (report.results[p] for p in ("never-offload", "always-load", "tierkv"))
    assert always.mean_s > 1.5 * never.mean_s  # loading clearly loses here
    # Its first loads teach it; it waits for them at most its bound, then computes.
    assert rule.tokens["disk"] <= 0.1 * always.tokens["disk"]
    assert rule.mean_s <= 1.05 * never.mean_s
    assert rule.slower <= 2
    # One load, clipped as an outlier, already puts the line far below the prior's.
    assert rule.learned["disk"]["bandwidth_mb_s"] < 0.5 * 500


def test_a_disk_only_as_fast_as_its_prior_is_left_to_the_engine():
    # 64 MiB blocks (the 8B model's) from a disk the prior puts at 134 ms a block.
    report = compare(sessions_trace(), SimParams(cpu_blocks=32, disk_blocks=100_000,
                                                 disk_gbps=0.3))
    rule = report.results["tierkv"]
    assert rule.tokens["disk"] == 0 and rule.slower == 0
    assert rule.mean_s == pytest.approx(report.results["never-offload"].mean_s, rel=0.01)


TRACE = default_trace_path()
needs_trace = pytest.mark.skipif(TRACE is None, reason="the Mooncake conversation trace "
                                 "(shared/data/mooncake-fast25) is not on this machine")


SPEEDS = {
    "default": {},  # NVMe 3 GB/s + 0.1 ms, S3 1 GB/s + 30 ms
    "slow-s3": {"s3_gbps": 0.2, "s3_latency_ms": 100.0},
    "fast-disk": {"disk_gbps": 7.0},
}
# The per-type priors (disk 500 MB/s: 134 ms a 64 MiB block, four times its
# recompute) are wrong for a 3 or 7 GB/s disk: the trial loads of what lookups skip
# measure the disk within the first requests, and the rule then uses it.
@needs_trace
@pytest.mark.parametrize("priors, speed", [
    ("true", "default"), ("true", "slow-s3"), ("true", "fast-disk"),
    ("default", "slow-s3"), ("default", "default"), ("default", "fast-disk"),
])
def test_on_the_real_trace_the_rule_is_best_and_slows_no_request(priors, speed):
    requests = read_trace(TRACE, 1000)
    report = compare(requests, SimParams(**SPEEDS[speed], priors=priors), TRACE.name)
    rule = report.results["tierkv"]
    others = {p: r.mean_s for p, r in report.results.items() if p != "tierkv"}
    assert rule.slower == 0
    assert rule.mean_s <= min(others.values()), (rule.mean_s, others)
    assert report.goal_met


def test_the_replay_command_prints_and_writes_the_figures(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
        for r in sessions_trace()[:30]), encoding="utf-8")
    out = tmp_path / "ttft.json"
    assert replay_main(["--ttft", "--trace", str(trace), "--json", str(out),
                        "--cpu-blocks", "16"]) == 0
    printed = capsys.readouterr().out
    for name in ("never-offload", "always-load", "tierkv", "15,000 tokens/s", "S3"):
        assert name in printed
    figures = json.loads(out.read_text(encoding="utf-8"))
    assert set(figures["policies"]) == {"never-offload", "always-load", "tierkv"}
    assert figures["params"]["cpu_blocks"] == 16
    assert {"mean_s", "p50_s", "p99_s", "token_shares",
            "slower_than_never_offload"} <= set(figures["policies"]["tierkv"])


@pytest.mark.parametrize("argv, message", [
    (["--s3-gbps", "0"], "s3_gbps must be > 0"),
    (["--requests", "0"], "--requests must be positive"),
    (["--trace", "/nonexistent/trace.jsonl"], "no trace at /nonexistent/trace.jsonl"),
])
def test_bad_options_say_what_is_wrong(argv, message, tmp_path):
    if "--trace" not in argv:
        trace = tmp_path / "t.jsonl"
        trace.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [1]}\n')
        argv = [*argv, "--trace", str(trace)]
    with pytest.raises(SystemExit, match=message):
        replay_main(["--ttft", *argv])
