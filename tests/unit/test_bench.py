"""`tierkv bench`: the shared statistics, rows, budget, summary table and JSON, the
command's part selection and failure handling, and one small part end to end.
No timing is asserted: these machines are shared."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
import types
from pathlib import Path

import pytest

import tierkv.bench as bench
from tierkv.bench.common import (
    FLAT,
    Budget,
    Options,
    Part,
    Row,
    Stat,
    document,
    format_row,
    rates,
    ratio,
    summary_table,
)
from tierkv.cli import main as cli_main


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def row(name: str, headline: bool = True, **kw: object) -> Row:
    fields: dict[str, object] = dict(
        part="p", name=name, value=Stat.of([2.0, 4.0, 3.0]), unit="GB/s",
        reference="memcpy", ratio=Stat.of([0.5, 0.6, 0.7]), ref_value=Stat.of([5.0]),
        headline=headline)
    fields.update(kw)
    return Row(**fields)  # type: ignore[arg-type]


def part(name: str = "p", rows: list[Row] | None = None, seconds: float = 10.0) -> Part:
    p = Part(name, Budget(60.0), io.StringIO())
    p.rows = rows or []
    p.seconds = seconds
    return p


# -- statistics ---------------------------------------------------------------------------


def test_stat_median_and_min_max():
    assert Stat.of([3.0, 1.0, 2.0]) == Stat(2.0, 1.0, 3.0, 3)
    assert Stat.of([4.0, 1.0, 2.0, 3.0]).median == 2.5  # even count: mean of the middle two
    assert Stat.one(7.0) == Stat(7.0, 7.0, 7.0, 1)
    with pytest.raises(ValueError):
        Stat.of([])


def test_stat_scaled_and_formatted():
    stat = Stat.of([0.001, 0.002, 0.003]).scaled(1e3)
    assert stat.median == pytest.approx(2.0) and stat.max == pytest.approx(3.0)
    assert stat.fmt(1) == "2.0 (1.0-3.0)"
    assert Stat.one(1.5).fmt(2) == "1.50"  # a single figure has no spread to show


def test_paired_ratio_is_taken_per_repeat():
    # Per repeat 2/1, 2/2, 9/3: the median of the ratios, not the ratio of medians.
    r = ratio([2.0, 2.0, 9.0], [1.0, 2.0, 3.0])
    assert (r.median, r.min, r.max, r.n) == (2.0, 1.0, 3.0, 3)
    with pytest.raises(ValueError, match="paired"):
        ratio([1.0, 2.0], [1.0])


def test_unpaired_ratio_is_of_the_medians():
    r = ratio([2.0, 4.0, 6.0], [1.0, 2.0], paired=False)
    assert r == Stat.one(4.0 / 1.5)


def test_rates_turn_durations_into_throughput():
    assert rates(10.0, [2.0, 5.0]) == [5.0, 2.0]


# -- budget -------------------------------------------------------------------------------


def test_budget_counts_down_on_its_clock():
    clock = FakeClock()
    budget = Budget(30.0, clock)
    assert budget.left() == 30.0 and not budget.spent()
    clock.now += 31
    assert budget.spent() and budget.left() == pytest.approx(-1.0)


def test_a_part_over_budget_records_what_it_skipped():
    clock = FakeClock()
    p = Part("disk", Budget(5.0, clock), io.StringIO())
    assert not p.over_budget("2 MiB blocks") and not p.exhausted
    clock.now += 6
    assert p.over_budget("2 MiB blocks")
    assert p.skipped == ["2 MiB blocks"] and p.exhausted
    assert "budget of 5 s spent: 2 MiB blocks skipped" in p.out.getvalue()  # type: ignore[attr-defined]


# -- presentation -------------------------------------------------------------------------


def test_a_row_prints_value_reference_and_ratio():
    line = format_row(row("store"))
    assert line.startswith("store: 3.00 (2.00-4.00) GB/s")
    assert "vs memcpy 5.00 GB/s" in line and "ratio 0.60 (0.50-0.70)" in line


def test_flat_and_unpaired_ratios_say_how_to_read_them():
    assert "flat=1" in format_row(row("lookup", want=FLAT, paired=False))
    assert "(of medians)" in format_row(row("lookup", paired=False))


def test_summary_lists_every_headline_and_only_those():
    parts = [part("datapath", [row("engine store"), row("detail", headline=False)]),
             part("control", [row("lookup 64 keys")])]
    table = summary_table(parts)
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["part", "measurement"]
    assert any(line.startswith("datapath") and "engine store" in line for line in lines)
    assert any(line.startswith("control") and "lookup 64 keys" in line for line in lines)
    assert "detail" not in table
    assert all("0.60 (0.50-0.70)" in line for line in lines[2:4])


def test_summary_names_failed_and_cut_short_parts():
    failed, cut = part("s3"), part("disk")
    failed.error = "ModuleNotFoundError: No module named 'boto3'"
    cut.skipped = ["2 MiB blocks"]
    table = summary_table([failed, cut])
    assert "s3: FAILED after 10 s of 60 s: ModuleNotFoundError" in table
    assert "disk: budget spent (10 s of 60 s); skipped: 2 MiB blocks" in table


def test_json_document_shape():
    p = part("control", [row("lookup")])
    p.notes.append("a note")
    doc = json.loads(json.dumps(document([p], ["control", "--quick"])))
    assert doc["schema"] == 1 and doc["command"] == ["tierkv", "bench", "control", "--quick"]
    assert {"cpu", "cores", "memory_gib", "python"} <= doc["machine"].keys()
    (out,) = doc["parts"]
    assert out["name"] == "control" and out["notes"] == ["a note"]
    assert out["budget_exhausted"] is False and out["error"] is None
    (r,) = out["rows"]
    assert r["value"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3}
    assert r["ratio"]["median"] == 0.6 and r["ref_value"]["median"] == 5.0
    assert {"part", "name", "unit", "reference", "want", "headline", "paired", "note"} <= r.keys()


# -- the command ----------------------------------------------------------------------------


def test_parts_default_to_all_in_a_fixed_order():
    assert bench.select_parts([]) == list(bench.PARTS)
    assert bench.select_parts(["all"]) == list(bench.PARTS)
    assert bench.select_parts(["policies", "datapath"]) == ["datapath", "policies"]
    with pytest.raises(ValueError, match="unknown part 'gpu'"):
        bench.select_parts(["gpu"])


def test_options_pick_the_repeats():
    assert Options().pick(2, 5) == 5
    assert Options(quick=True).pick(2, 5) == 2
    assert Options(quick=True, repeats=7).pick(2, 5) == 7


def _fake_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two parts: one that adds a row, one that fails."""
    def good(p: Part, opts: Options) -> None:
        print("progress of a script")  # must not reach stdout when JSON goes there
        p.add(row("fine"))

    def bad(p: Part, opts: Options) -> None:
        raise RuntimeError("no endpoint")

    for name, fn in (("good", good), ("bad", bad)):
        module = types.ModuleType(f"fake_bench_{name}")
        module.run = fn  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(bench, "PARTS", {"bad": "fake_bench_bad", "good": "fake_bench_good"})


def test_a_failed_part_does_not_stop_the_others(monkeypatch, capsys):
    _fake_parts(monkeypatch)
    assert bench.main(["--json"]) == 1  # JSON to stdout, progress to stderr
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    bad, good = doc["parts"]
    assert bad["error"] == "RuntimeError: no endpoint" and bad["rows"] == []
    assert good["error"] is None and good["rows"][0]["name"] == "fine"
    assert "progress of a script" in captured.err and "== summary" in captured.err


def test_bad_arguments_are_refused(monkeypatch, capsys):
    _fake_parts(monkeypatch)
    for argv in (["nonsense"], ["--budget", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2
    capsys.readouterr()


def test_policies_quick_end_to_end_through_the_cli(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "policies", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "== summary" in printed and f"rows written to {out}" in printed
    doc = json.loads(out.read_text())
    assert doc["command"] == ["tierkv", "bench", "policies", "--quick", "--json", str(out)]
    assert len(doc["machine"]["load_avg_start"]) == 3  # how quiet the machine was
    (p,) = doc["parts"]
    assert p["name"] == "policies" and p["error"] is None
    names = {r["name"] for r in p["rows"]}
    assert {"lru lookup", "arc touch", "histarc evict+insert"} <= names
    for r in p["rows"]:
        assert r["ratio"]["median"] > 0 and r["value"]["n"] >= 1
        assert r["value"]["min"] <= r["value"]["median"] <= r["value"]["max"]


def test_the_transport_bench_puts_the_broker_s_lookup_behind_both_transports(capsys):
    """`python -m tierkv.bench.transport`: the broker's real handling answers the
    lookup over ZeroMQ and over a Unix socket (the bench raises on a lookup that does
    not find its 64 stored keys), and each server process has ended."""
    from tierkv.bench import transport

    children = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children")
    before = children.read_text().split()
    assert transport.main(["--rounds", "20", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    for what in ("echo of its bytes", "the broker's handling"):
        for kind in transport.KINDS:
            assert re.search(rf"{what}\s+{kind}\s+\d+\.\d us", printed), printed
    assert "time of a round trip over the Unix socket / over ZeroMQ" in printed
    assert children.read_text().split() == before
