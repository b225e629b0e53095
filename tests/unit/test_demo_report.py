"""The demo's report and plot must be trustworthy: one accounting
for every "served from" row, summing to 100 %; windows of the plot that are real
windows of completed requests, never empty; the lookup figure split by what it
waited on."""

from __future__ import annotations

import pytest

from tierkv.demo.engine import Totals
from tierkv.demo.report import build_report, render
from tierkv.demo.windows import Snapshot, Windows
from tierkv.node.config import config_from_dict

CONFIG = config_from_dict({"cpu": {"page_size": 4096},
                           "tiers": [{"type": "memory", "name": "disk"},
                                     {"type": "memory", "name": "s3"}]})
STATS = {"tiers": {"disk": {}, "s3": {}}, "cpu": {"evictions": 0}}


def totals() -> Totals:
    t = Totals(requests=10, blocks=100, recomputed=30)
    t.served.update({"cpu": 52, "disk": 13, "s3": 5})
    t.lookup_s["at once"] += [0.001] * 4
    t.lookup_s["promotion"] += [0.150] * 2
    t.lookup_s["other wait"] += [0.100] * 4
    return t


def test_served_rows_and_recomputed_add_up_to_every_block():
    report = build_report(CONFIG, totals(), STATS, [], 1.0)
    assert report["served_blocks"] == {"cpu": 52, "disk": 13, "s3": 5}
    assert sum(report["served_blocks"].values()) + report["recomputed_blocks"] == 100
    text = render(report)
    shares = [float(line.split()[-1].rstrip("%")) for line in text.splitlines()
              if line.split() and line.split()[0] in ("cpu", "disk", "s3", "recomputed")
              and line.endswith("%")]
    assert shares == [52.0, 13.0, 5.0, 30.0] and sum(shares) == pytest.approx(100.0)
    assert "total" in text and "100.0%" in text


def test_the_lookup_figure_says_what_it_waited_on():
    report = build_report(CONFIG, totals(), STATS, [], 1.0)
    assert report["lookups"]["promotion"] == {"count": 2, "p50_ms": pytest.approx(150.0)}
    text = render(report)
    assert "admission until answered" in text
    assert "promotion:    20%" in text and "at once:      40%" in text
    assert "other wait:   40%" in text


def test_windows_hold_completed_requests_and_are_never_empty():
    """Several requests complete in one engine step: a window closes at the step
    that completes its 20th request or later, never between steps, so no window is
    empty and none is skipped."""
    t = Totals()
    windows = Windows(20, Snapshot.of(t, 0.0))
    now = 0.0
    for step in range(200):
        done = (0, 3, 1, 7)[step % 4]  # requests completed by this engine step
        t.requests += done
        t.blocks += 10 * done
        t.served["cpu"] += 6 * done
        t.served["disk"] = t.served.get("disk", 0) + 2 * done
        t.recomputed += 2 * done
        now += 0.01
        if done:
            windows.update(t, now)
    windows.update(t, now, final=True)
    points = windows.points
    assert sum(p["requests"] for p in points) == t.requests
    assert all(p["requests"] >= 20 for p in points[:-1]) and points[-1]["requests"] >= 1
    assert all(p["blocks"] > 0 for p in points)
    assert all(a["t1"] == b["t0"] for a, b in zip(points, points[1:], strict=False))
    for p in points:
        assert sum(p["served"].values()) + p["recomputed"] == pytest.approx(1.0)
        assert p["served"]["cpu"] == pytest.approx(0.6)


def test_a_final_update_without_new_requests_adds_no_window():
    t = Totals(requests=5, blocks=50)
    windows = Windows(20, Snapshot.of(t, 0.0))
    assert windows.update(t, 1.0, final=True) is None and windows.points == []
