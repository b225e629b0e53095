"""`tierkv bench peers` without the peers: the row builder on a recorded run, the
part's registration (opt-in), the corruptions every system gets, and the driver
protocol against tierkv's own driver (a real process on real files). Nothing of
LMCache or vLLM is needed or imported. No timing is asserted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tierkv.bench as bench
from tierkv.bench.peers import env as peer_env
from tierkv.bench.peers.drivers.common import (
    base_block,
    block_intact,
    corrupt,
    fill_block,
    manager_requests,
)
from tierkv.bench.peers.procs import Driver, DriverError, Unsupported
from tierkv.bench.peers.rows import build_rows, margin, policy_table

SAMPLE = Path(__file__).with_name("data") / "peers_record.json"


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(SAMPLE.read_text())


def rows_of(rows, name):
    return [r for r in rows if r.name == name]


# -- the row builder on a recorded run ------------------------------------------------------


def test_every_peer_of_every_comparison_gets_one_row(record):
    rows = build_rows(record)
    assert len(rows) == sum(len(c["peers"]) for c in record["comparisons"])
    assert {r.part for r in rows} == {"peers"}


def test_a_store_row_is_tierkv_against_the_peer_per_repeat(record):
    (comp,) = [c for c in record["comparisons"] if c["id"] == "disk.store.256KiB.durable"]
    rows = rows_of(build_rows(record), comp["name"])
    ours = comp["tierkv"]["samples"]
    for row, peer in zip(rows, comp["peers"], strict=True):
        assert row.reference == peer["label"]
        assert row.value.median == pytest.approx(sorted(ours)[len(ours) // 2])
        assert row.ref_value.median == pytest.approx(sorted(peer["samples"])[1])
        # Higher is better: the margin is tierkv / peer, taken per repeat.
        per_repeat = sorted(o / p for o, p in zip(ours, peer["samples"], strict=True))
        assert row.paired and row.ratio.n == 3
        assert row.ratio.median == pytest.approx(per_repeat[1])


def test_times_read_the_other_way(record):
    (comp,) = [c for c in record["comparisons"] if c["id"] == "disk.restart.time"]
    rows = rows_of(build_rows(record), comp["name"])
    timed = [(r, p) for r, p in zip(rows, comp["peers"], strict=True) if p.get("samples")]
    assert timed, "the sample must hold a peer that found its blocks after a restart"
    for row, peer in timed:
        # Lower is better: peer's time / tierkv's time.
        assert row.ratio.median == pytest.approx(peer["samples"][0] / comp["tierkv"]["samples"][0])
        assert not row.paired


def test_a_peer_that_found_nothing_has_no_ratio_and_says_so(record):
    (comp,) = [c for c in record["comparisons"] if c["id"] == "disk.restart.found"]
    rows = rows_of(build_rows(record), comp["name"])
    zero = [(r, p) for r, p in zip(rows, comp["peers"], strict=True) if p["samples"] == [0.0]]
    assert zero, "the sample must hold a peer that lost its index at restart"
    for row, _ in zero:
        assert row.ratio is None and row.ref_value.median == 0.0
        assert "no ratio" in row.note


def test_goals_are_checked_in_the_note(record):
    rows = build_rows(record)
    lmcache_store = [r for r in rows if r.name.startswith("disk store")
                     and r.reference.startswith("LMCache") and r.ratio is not None]
    assert lmcache_store
    for row in lmcache_store:
        expected = "met" if row.ratio.median >= 2.0 else "NOT met"
        assert f"goal >= 2x: {expected}" in row.note
    vllm_disk = [r for r in rows if r.name.startswith(("disk store", "disk load"))
                 and "vLLM" in r.reference and r.ratio is not None]
    assert vllm_disk
    for row in vllm_disk:  # the goal: >= 1.2x vLLM's fs tier on every disk row
        expected = "met" if row.ratio.median >= 1.2 else "NOT met"
        assert f"goal >= 1.2x: {expected}" in row.note
    assert all("goal" not in r.note for r in rows if r.name.startswith("restart"))
    # The hit-ratio goal is the default policy's, against vLLM's LRU, at 4000 blocks.
    policy = [r for r in rows if r.name.startswith("hit ratio, conversation @ 4,000")
              and r.reference.endswith(" lru") and r.reference.startswith("vLLM")]
    assert {("(default)" in r.name, "goal >= 1.5x" in r.note) for r in policy} == {
        (True, True), (False, False)}


def test_a_row_tierkv_loses_says_so():
    comp = {"id": "x.y", "section": "x", "name": "x", "unit": "GB/s", "better": "higher",
            "tierkv": {"label": "tierkv", "key": "tierkv", "samples": [1.0, 1.0, 1.0]},
            "peers": [{"label": "peer", "key": "p", "samples": [2.0, 2.0, 2.0]}]}
    (row,) = build_rows({"comparisons": [comp]})
    assert row.ratio.median == 0.5 and "tierkv behind" in row.note


def test_a_skipped_or_failed_peer_keeps_tierkvs_figure_and_names_the_reason():
    ours = {"label": "tierkv", "key": "tierkv", "samples": [3.0]}
    comp = {"id": "disk.load.x", "section": "disk", "name": "load", "unit": "GB/s",
            "better": "higher", "tierkv": ours,
            "peers": [{"label": "LMCache", "key": "lmcache:disk", "samples": None,
                       "skipped": "pip install lmcache==0.5.6 failed"},
                      {"label": "vLLM", "key": "vllm:fs", "samples": None,
                       "error": "DriverDied: exit 1"}]}
    skipped, failed = build_rows({"comparisons": [comp]})
    assert skipped.value.median == 3.0 and skipped.ratio is None
    assert skipped.reference == "LMCache (skipped: pip install lmcache==0.5.6 failed)"
    assert failed.reference == "vLLM (failed: DriverDied: exit 1)" and failed.ratio is None


def test_only_the_default_policy_on_the_conversation_trace_at_4000_is_a_headline(record):
    policy_rows = [r for r in build_rows(record) if r.name.startswith("hit ratio")]
    assert policy_rows
    for row in policy_rows:
        wanted = "conversation @ 4,000" in row.name and "(default)" in row.name
        assert row.headline == wanted, row.name


def test_policy_table_has_a_line_per_system_and_a_column_per_trace(record):
    table = policy_table(record).splitlines()
    assert "conversation@4000" in table[0]
    labels = [line.split("  ")[0] for line in table[1:]]
    assert any(label.startswith("tierkv") for label in labels)
    assert any(label.startswith("vLLM") for label in labels)


def test_margin_handles_unpaired_and_zero():
    assert margin([4.0, 2.0, 6.0], [2.0], "higher", paired=True).median == 2.0  # medians
    assert margin([1.0], [0.0], "higher", paired=False) is None
    assert margin([2.0], [4.0], "lower", paired=False).median == 2.0


# -- registration ---------------------------------------------------------------------------


def test_peers_is_opt_in():
    assert "peers" not in bench.select_parts([])
    assert "peers" not in bench.select_parts(["all"])
    assert bench.select_parts(["peers"]) == ["peers"]
    assert bench.select_parts(["peers", "disk"]) == ["disk", "peers"]


def test_the_missing_module_of_an_import_error_is_found():
    assert peer_env.missing_module("ModuleNotFoundError: No module named 'cbor2'") == "cbor2"
    assert peer_env.missing_module("No module named 'PIL.Image'") == "PIL"
    assert peer_env.missing_module("ImportError: libcuda.so") is None


# -- what every system is put through -------------------------------------------------------


def test_blocks_are_told_apart_by_their_stamp():
    base = base_block(4096, seed=1)
    a, b = base.copy(), base.copy()
    fill_block(a, base, 3)
    fill_block(b, base, 4)
    assert block_intact(a, base, 3) and not block_intact(a, base, 4)
    a[2000] ^= 1
    assert not block_intact(a, base, 3)


def test_corruptions_damage_only_the_victims_record(tmp_path):
    victim, other = tmp_path / "v", tmp_path / "o"
    victim.write_bytes(bytes(range(256)) * 16)
    other.write_bytes(b"\x07" * 4096)
    corrupt("flip", (str(victim), 0, 4096), (str(other), 0, 4096))
    data = victim.read_bytes()
    assert data[2048] == (bytes(range(256)) * 16)[2048] ^ 0xFF and len(data) == 4096
    corrupt("swap", (str(victim), 1024, 2048), (str(other), 0, 1024))
    assert victim.read_bytes()[1024:2048] == b"\x07" * 1024
    corrupt("truncate", (str(victim), 0, 4096), (str(other), 0, 4096))
    assert os.path.getsize(victim) == 2048
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupt("melt", (str(victim), 0, 1), (str(other), 0, 1))


def test_every_system_replays_the_same_requests():
    a, b = manager_requests(50, 8, seed=3), manager_requests(50, 8, seed=3)
    assert a == b and all(len(keys) == 8 for keys in a)
    assert len({k for keys in a for k in keys}) < 50 * 8  # prefixes are shared


# -- the protocol, against tierkv's own driver ----------------------------------------------


@pytest.fixture
def tierkv_driver(tmp_path):
    import sys

    drv = Driver("tierkv", sys.executable, "tierkv.bench.peers.drivers.tierkv_driver",
                 dict(os.environ), tmp_path / "driver.log", start_timeout=60)
    yield drv
    drv.close()
    assert drv.proc.poll() is not None  # ended, not left behind


def test_tierkv_driver_stores_loads_and_detects_every_corruption(tierkv_driver, tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    size = 64 * 1024
    tierkv_driver.call("disk_open", 60, system="disk", dir=str(d), block_bytes=size,
                       capacity_blocks=16, pool_blocks=8)
    stored = tierkv_driver.call("disk_store", 60, tag="t", count=8, seed=2, sync=True)
    assert stored["seconds"] > 0 and stored["fdatasyncs"] >= 1
    loaded = tierkv_driver.call("disk_load", 60, tag="t", count=8, seed=2)
    assert loaded["bad"] == 0 and loaded["missing"] == 0
    tierkv_driver.call("disk_close", 60)
    found = tierkv_driver.call("disk_recover", 60, system="disk", dir=str(d), block_bytes=size,
                               capacity_blocks=16, tag="t", count=8)
    assert found["found"] == 8
    (tmp_path / "int").mkdir()
    outcomes = tierkv_driver.call("integrity", 60, system="disk", dir=str(tmp_path / "int"),
                                  block_bytes=size)
    assert {m: o["outcome"] for m, o in outcomes.items()} == {
        "flip": "detected", "truncate": "detected", "swap": "detected"}
    assert not any(o["still_indexed"] for o in outcomes.values())  # the bad copy is gone


def test_a_driver_says_what_it_cannot_do_and_what_failed(tierkv_driver, tmp_path):
    with pytest.raises(Unsupported, match="no disk system 'fs'"):
        tierkv_driver.call("disk_open", 60, system="fs", dir=str(tmp_path), block_bytes=4096,
                           capacity_blocks=1, pool_blocks=1)
    with pytest.raises(DriverError, match="no store is open"):
        tierkv_driver.call("disk_load", 60, tag="t", count=1, seed=1)
    # The driver survives its errors.
    assert tierkv_driver.call("policies", 60)["default"]
