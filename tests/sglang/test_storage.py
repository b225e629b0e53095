"""SGLang's HiCache L3 on a tierkv node: pages stored from a real host pool through
`batch_set_v1` come back through `batch_get_v1` into other pages byte for byte, in
every host-pool layout, after the node restarts, in another process, and never
wrong (a page that fails its check is a miss)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sglang.pools import (
    SHAPES,
    PoolShape,
    backend_for,
    extra_config,
    fill_pages,
    host_pool,
    indices,
    node_page,
    page_bytes,
    page_keys,
)
from tierkv.core.shm import SharedRegion
from tierkv.sglang.pages import PageMismatch

PAGES = 6
DISK_WAIT_S = 60.0  # a hang guard only: the cascade takes milliseconds
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def stored(start_node, request):
    """A node, a pool of `request.param`'s shape, and PAGES pages stored from it."""
    shape: PoolShape = request.param
    pool = host_pool(shape)
    node = start_node(node_page(pool))
    storage = backend_for(pool, shape, extra_config(node))
    keys = page_keys(PAGES)
    written = fill_pages(pool, 0, PAGES, seed=1)
    assert storage.batch_set_v1(keys, indices(0, PAGES)) == [True] * PAGES
    yield node, pool, storage, keys, written, shape
    storage.close()


@pytest.mark.parametrize("stored", SHAPES, ids=str, indirect=True)
def test_pages_come_back_byte_for_byte_into_other_pages(stored):
    _, pool, storage, keys, written, _ = stored
    assert storage.batch_exists(keys) == PAGES
    assert storage.batch_get_v1(keys, indices(PAGES, PAGES)) == [True] * PAGES
    assert page_bytes(pool, PAGES, PAGES) == written
    assert storage.counters()["pages_read"] == PAGES


@pytest.mark.parametrize("stored", [SHAPES[1]], ids=str, indirect=True)
def test_only_the_leading_stored_pages_are_hits(stored):
    _, _, storage, keys, _, _ = stored
    unknown = page_keys(2, seed=9)
    assert storage.batch_exists(keys[:3] + unknown + keys[3:]) == 3
    assert storage.batch_exists(unknown + keys) == 0
    got = storage.batch_get_v1(keys[:2] + unknown, indices(PAGES, 4))
    assert got == [True, True, False, False]


@pytest.mark.parametrize("stored", [SHAPES[1]], ids=str, indirect=True)
def test_another_model_or_rank_never_sees_the_pages(stored):
    node, pool, _, keys, _, shape = stored
    other_model = backend_for(pool, shape, extra_config(node, namespace="another-model"))
    other_rank = backend_for(pool, shape, extra_config(node), tp_rank=1, tp_size=2)
    try:
        assert other_model.batch_exists(keys) == 0
        assert other_rank.batch_exists(keys) == 0
    finally:
        other_model.close()
        other_rank.close()


@pytest.mark.parametrize("stored", [PoolShape("mla", "page_first")], ids=str, indirect=True)
def test_mla_one_rank_writes_every_rank_reads(stored):
    node, pool, _, keys, written, shape = stored
    reader = backend_for(pool, shape, extra_config(node), tp_rank=1, tp_size=2)
    fresh = page_keys(2, seed=5)
    try:
        assert reader.batch_set_v1(fresh, indices(0, 2)) == [True, True]  # not the writer
        assert reader.batch_exists(fresh) == 0  # ... so nothing was stored
        assert reader.batch_exists(keys) == PAGES
        assert reader.batch_get_v1(keys, indices(PAGES, PAGES)) == [True] * PAGES
        assert page_bytes(pool, PAGES, PAGES) == written
    finally:
        reader.close()


@pytest.mark.parametrize("stored", [SHAPES[0]], ids=str, indirect=True)
def test_a_corrupted_page_in_the_cpu_tier_is_a_miss(stored, instance):
    _, pool, storage, keys, written, _ = stored
    before = fill_pages(pool, PAGES, PAGES, seed=2)
    assert storage.batch_exists(keys) == PAGES
    with SharedRegion.attach(instance) as region:
        rows = region.numpy()
        row = storage.link._held[storage._keys([keys[2]])[0]].row
        rows[row, 7] ^= 0xFF
        del rows
    got = storage.batch_get_v1(keys, indices(PAGES, PAGES))
    assert got == [True, True, False, False, False, False]
    landed = page_bytes(pool, PAGES, PAGES)
    assert landed[:2] == written[:2]
    assert landed[2:] == before[2:]  # untouched: no wrong byte reached the pool
    assert storage.counters()["pages_failed_check"] == 1


@pytest.mark.parametrize("stored", [SHAPES[1], SHAPES[5]], ids=str, indirect=True)
def test_pages_survive_a_node_restart_from_the_disk_tier(stored, start_node):
    node, pool, storage, keys, written, shape = stored
    run_dir = node.config.run_path
    wait_on_disk(storage, PAGES)
    node.stop()
    again = start_node(node_page(pool), run_dir=run_dir)
    # The same backend: its client finds the new broker, it maps the new region.
    assert storage.batch_exists(keys) == PAGES
    assert storage.batch_get_v1(keys, indices(PAGES, PAGES)) == [True] * PAGES
    assert page_bytes(pool, PAGES, PAGES) == written
    fresh = backend_for(pool, shape, extra_config(again))
    try:
        assert fresh.batch_exists(keys) == PAGES
    finally:
        fresh.close()


@pytest.mark.parametrize("stored", [SHAPES[1]], ids=str, indirect=True)
def test_a_corrupted_page_on_disk_is_a_miss_after_a_restart(stored, start_node):
    node, pool, storage, keys, written, _ = stored
    run_dir = node.config.run_path
    wait_on_disk(storage, PAGES)
    node.stop()
    flipped = flip_payload_bytes(run_dir / "disk")
    assert flipped
    start_node(node_page(pool), run_dir=run_dir)
    before = fill_pages(pool, PAGES, PAGES, seed=3)
    hits = storage.batch_exists(keys)
    got = storage.batch_get_v1(keys, indices(PAGES, PAGES))
    assert got == [True] * hits + [False] * (PAGES - hits)
    assert hits < PAGES
    landed = page_bytes(pool, PAGES, PAGES)
    assert landed[:hits] == written[:hits]
    assert landed[hits:] == before[hits:]


def wait_on_disk(storage, pages: int) -> None:
    """Until the node's disk tier holds `pages` blocks: the node cascades a stored
    page to disk after the store, and a broker that stops does not wait for that."""
    deadline = time.monotonic() + DISK_WAIT_S
    while True:
        with storage.link._lock:
            blocks = storage.link.client.stats()["tiers"]["disk"]["blocks"]
        if blocks >= pages:
            return
        assert time.monotonic() < deadline, f"the disk tier holds {blocks} of {pages} pages"
        time.sleep(0.02)


def flip_payload_bytes(disk_root: Path) -> int:
    """Flip a byte inside every block payload the disk tier wrote (its slab files:
    header area first, then the payload), so every page read from disk is bad."""
    from workers.disk import HEADER_AREA

    count = 0
    for path in sorted(disk_root.rglob("*")):
        if not path.is_file() or path.stat().st_size <= HEADER_AREA:
            continue
        with open(path, "r+b") as f:
            f.seek(HEADER_AREA + 3)
            byte = f.read(1)
            f.seek(HEADER_AREA + 3)
            f.write(bytes([byte[0] ^ 0xFF]))
        count += 1
    return count


@pytest.mark.parametrize("stored", [SHAPES[1]], ids=str, indirect=True)
def test_a_second_sglang_process_reads_the_pages(stored):
    node, pool, _, keys, written, shape = stored
    out = run_instance("READ", node, shape, PAGES, seed=0)
    assert out["hits"] == PAGES and out["read"] == PAGES
    assert [bytes.fromhex(p) for p in out["pages"]] == written


@pytest.mark.parametrize("stored", [SHAPES[1]], ids=str, indirect=True)
def test_pages_a_second_process_wrote_are_read_here(stored):
    node, pool, storage, _, _, shape = stored
    out = run_instance("WRITE", node, shape, 3, seed=7)
    assert out["written"] == 3
    theirs = page_keys(3, seed=7)
    assert storage.batch_exists(theirs) == 3
    assert storage.batch_get_v1(theirs, indices(PAGES, 3)) == [True] * 3
    # The other process filled its pool with the same generator: same bytes.
    expected = fill_pages(host_pool(shape), 0, 3, seed=7)
    assert page_bytes(pool, PAGES, 3) == expected


def run_instance(what: str, node, shape: PoolShape, pages: int, seed: int) -> dict:
    """Another SGLang instance (a process of its own), ended by pid if it hangs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sglang.pools", what, str(node.config_path),
         shape.kind, shape.layout, str(pages), str(seed)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_node_with_other_page_sizes_is_refused_saying_what_to_set(start_node):
    shape = SHAPES[1]
    pool = host_pool(shape)
    need = node_page(pool)
    node = start_node(need + 4096)
    with pytest.raises(PageMismatch, match=f"cpu.page_size = {need}"):
        backend_for(pool, shape, extra_config(node))


def test_flat_pages_of_the_non_v1_path_round_trip(start_node):
    shape = SHAPES[0]
    pool = host_pool(shape)
    node = start_node(node_page(pool))
    extra = extra_config(node)
    extra.pop("interface_v1")
    storage = backend_for(pool, shape, extra)
    try:
        fill_pages(pool, 0, 2, seed=4)
        values = [pool.get_data_page(i * 4, flat=True) for i in range(2)]
        keys = page_keys(2, seed=4)
        assert storage.batch_set(keys, values)
        # Without interface_v1 SGLang's exists queries name these flat pages.
        assert storage.exists(keys[0]) is True
        assert storage.batch_exists(keys + page_keys(1, seed=99)) == 2
        targets = [pool.get_dummy_flat_data_page() for _ in range(3)]
        got = storage.batch_get(keys + page_keys(1, seed=99), targets)
        assert got[2] is None
        assert [bytes(t.view(-1).view(dtype=__import__("torch").uint8).numpy())
                for t in got[:2]] == [
            bytes(v.view(-1).view(dtype=__import__("torch").uint8).numpy()) for v in values]
    finally:
        storage.close()
