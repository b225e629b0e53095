"""`tierkv bench vllm`'s LMCache MP rows: finding the peers' environment without
building it, reading the driver's answer, and the row beside tierkv's. Needs
neither vLLM nor the peers' environment (a fake one is written to a temporary
directory); no timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierkv.bench.peers import env as peer_env
from tierkv.bench.vllm import (
    Overhead,
    PeerStep,
    Workload,
    parse_peer,
    peer_env_or_reason,
    peer_line,
    peer_row,
)

DRIVER_OUTPUT = {
    "system": "lmcache-mp", "versions": {"lmcache": "0.5.6", "vllm": "0.33.0"},
    "workload": {"requests": 64}, "repeats": 2,
    "median_step_s": [0.002, 0.004], "offloaded_hit_tokens": [1000, 3000],
    "admitted_tokens": [6000, 8000],
}


def fake_env(root: Path, versions: dict[str, str], skipped: dict[str, str]) -> None:
    python = root / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    stamp = {"wanted": peer_env.wanted(), "versions": versions, "skipped": skipped}
    (root / peer_env.STAMP_NAME).write_text(json.dumps(stamp))


def test_no_environment_is_skipped_with_how_to_build_it(tmp_path: Path) -> None:
    reason = peer_env_or_reason(tmp_path)
    assert isinstance(reason, str)
    assert "python -m tierkv.bench.peers.env" in reason
    assert not (tmp_path / "venv").exists()  # never built implicitly


def test_stale_stamp_is_no_environment(tmp_path: Path) -> None:
    fake_env(tmp_path, {"lmcache": "0.5.6", "vllm": "0.33.0"}, {})
    stamp = json.loads((tmp_path / peer_env.STAMP_NAME).read_text())
    stamp["wanted"]["lmcache"] = "0.0.1"
    (tmp_path / peer_env.STAMP_NAME).write_text(json.dumps(stamp))
    assert peer_env.existing(tmp_path) is None
    assert isinstance(peer_env_or_reason(tmp_path), str)


def test_environment_found_and_unusable_peer_named(tmp_path: Path) -> None:
    fake_env(tmp_path, {"lmcache": "0.5.6", "vllm": "0.33.0"}, {})
    env = peer_env_or_reason(tmp_path)
    assert isinstance(env, peer_env.PeerEnv)
    assert env.python == tmp_path / "venv" / "bin" / "python"

    other = tmp_path / "other"
    other.mkdir()
    fake_env(other, {"lmcache": "0.5.6"}, {"vllm": "vllm does not import: boom"})
    reason = peer_env_or_reason(other)
    assert isinstance(reason, str) and "vllm" in reason and "boom" in reason


def test_parse_peer_reads_the_last_line() -> None:
    stdout = "noise\n" + json.dumps(DRIVER_OUTPUT) + "\n\n"
    peer = parse_peer(stdout, "0.5.6")
    assert peer == PeerStep("LMCache 0.5.6 MP", [0.002, 0.004], [1000, 3000], [6000, 8000])
    with pytest.raises(ValueError):
        parse_peer("\n", "0.5.6")


def test_peer_row_is_reference_over_ours_with_admission() -> None:
    workload = Workload(requests=64, steps=100)
    o = Overhead(ours=[0.010, 0.010], theirs=[0.008, 0.008], our_hits=[5000, 5000],
                 their_hits=[5000, 5000], our_admitted=[10_000, 10_000],
                 their_admitted=[10_000, 10_000])
    peer = parse_peer(json.dumps(DRIVER_OUTPUT), "0.5.6")
    row = peer_row("repeats served by the offloading tier", workload, 2, o, peer)
    assert row.name.endswith("LMCache 0.5.6 MP")
    assert row.value.median == pytest.approx(10.0)  # ours, ms
    assert row.ref_value is not None and row.ref_value.median == pytest.approx(3.0)
    assert row.ratio is not None and row.ratio.median == pytest.approx(0.3)
    assert not row.paired
    # per step: tierkv 100, vLLM 100, LMCache 70 (0.70x vLLM's); hits are medians
    assert "tierkv 100, vLLM 100, LMCache 0.5.6 MP 70 (0.70x vLLM's)" in row.note
    assert "LMCache 0.5.6 MP 2,000" in row.note
    line = peer_line(peer, workload.steps)
    assert "3.000 ms" in line and "admitted prompt tokens per step: 70" in line


def test_the_spread_line_gives_each_back_end_s_quartile_median_tail_and_mean() -> None:
    """The distribution behind the step's medians, per back end, in ms."""
    ours = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    theirs = [0.005] * 98 + [0.105] * 2  # 5 ms but two steps
    o = Overhead(ours=[0.05], theirs=[0.005], our_hits=[0], their_hits=[0],
                 our_steps=ours, their_steps=theirs)
    line = o.spread()
    tierkv, vllm = line.split("tierkv ")[1].split(", vLLM ")
    p25, median, p90, p99, mean = (float(v) for v in tierkv.split("/"))
    assert (median, mean) == (50.5, 50.5) and 24 < p25 < 26 and 89 < p90 < 92 and p99 > 98
    p25, median, p90, p99, mean = (float(v) for v in vllm.split("/"))
    assert (p25, median, p90, p99, mean) == (5.0, 5.0, 5.0, 105.0, 7.0)
