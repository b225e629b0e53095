"""Negative controls for the fault harness: a suite whose counters could not count
would pass every fault. Each measure is shown to see what it must see."""

from __future__ import annotations

import time
from pathlib import Path

from tests.faults.harness import HEADER, FaultResult
from tests.faults.load import Driver, EngineKV, Recorder
from tests.faults.node import PAGE, keys_on_disk
from tests.integration.cluster import key_bytes, make_config
from tierkv.core.keys import OffloadEvent
from workers.disk import HEADER_AREA, DiskBackend, namespace_dir, slot_bytes_for


def test_a_wrong_byte_in_a_loaded_block_is_counted(instance):
    kv = EngineKV(instance)
    try:
        keys, blocks = [b"a", b"b", b"c"], [1, 2, 3]
        kv.fill(keys, blocks)
        assert kv.wrong(keys, blocks) == 0
        kv.views[0][2][100] ^= 0xFF
        assert kv.wrong(keys, blocks) == 1
        kv.zero(blocks)
        assert kv.wrong(keys, blocks) == 3
    finally:
        kv.close()


def test_blocks_gone_torn_or_wrong_on_disk_are_seen(tmp_path: Path):
    backend = DiskBackend(str(tmp_path), 16 * slot_bytes_for(PAGE), block_bytes=PAGE,
                          namespace="default", o_direct=False)
    try:
        for key in (b"k1", b"k2", b"k3"):
            backend.store(key, memoryview(key_bytes(key, 0, PAGE)))
        backend.store(b"k4", memoryview(key_bytes(b"other", 0, PAGE)))  # whole, wrong bytes
    finally:
        backend.close()
    found, wrong = keys_on_disk(tmp_path, "default")
    assert found == {b"k1", b"k2", b"k3", b"k4"} and wrong == 1
    slab = next((tmp_path / namespace_dir("default")).glob("slab-*.dat"))
    raw = bytearray(slab.read_bytes())
    raw[slot_bytes_for(PAGE) + HEADER_AREA + 7] ^= 0xFF  # k2's payload: a torn write
    slab.write_bytes(bytes(raw))
    found, _ = keys_on_disk(tmp_path, "default")
    assert found == {b"k1", b"k3", b"k4"}


def test_a_call_past_its_timeout_is_a_deadline_miss(tmp_path: Path):
    config = make_config("unused", tmp_path, client={"timeout_s": 0.1})
    driver = Driver(config, None, Recorder())
    try:
        driver.call(time.sleep, 0.01)
        assert driver.tally.late_calls == 0
        driver.call(time.sleep, 0.7)
        assert driver.tally.late_calls == 1 and driver.tally.max_call_s >= 0.7
    finally:
        driver.close()


def test_disk_reports_are_tracked_until_an_eviction():
    recorder = Recorder("disk")
    recorder.absorb([OffloadEvent("stored", (b"a", b"b"), "disk"),
                     OffloadEvent("stored", (b"c",), "s3")])
    assert recorder.disk_held() == {b"a", b"b"}
    mark = recorder.mark()
    recorder.absorb([OffloadEvent("removed", (b"a",), "disk")])
    assert recorder.disk_held() == {b"b"} and recorder.removed_since(mark) == {b"a"}
    later = recorder.mark()
    recorder.absorb([OffloadEvent("stored", (b"a",), "disk")])
    assert recorder.disk_held() == {b"a", b"b"} and recorder.removed_since(later) == set()


def test_figures_render_as_a_table_row():
    row = FaultResult("broker SIGKILL", 7, detected_s=0.1, recovered_s=1.5).row()
    assert row.startswith("broker SIGKILL") and "seed=7" in row
    assert len(HEADER.split()) >= 8
