"""The disk tier's own promises, beyond the conformance suite: slab layout, crash
safety, verification, budget, restart, O_DIRECT, group commit, clear start errors."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tierkv.core.blockformat import HEADER_SIZE, pack_header
from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.shm import SharedRegion
from tierkv.tiers.base import Job, JobKind
from tierkv.tiers.registry import TierConfigError, create_backend
from tierkv.tiers.runner import JobRunner
from workers.disk import HEADER_AREA, DiskBackend, namespace_dir, slot_bytes_for
from workers.disk import startup as disk_startup

BLOCK = 8192
SLOT = slot_bytes_for(BLOCK)


def key(n: int) -> bytes:
    return b"key-" + n.to_bytes(4, "big")


def payload(n: int, size: int = BLOCK) -> bytes:
    seed = n.to_bytes(4, "big") * 4
    return (seed * (size // len(seed) + 1))[:size]


@pytest.fixture
def opened():
    """Backends made by a test, closed at its end whatever happened."""
    backends: list[DiskBackend] = []
    yield backends
    for backend in backends:
        backend.close()


@pytest.fixture
def make(tmp_path, opened):
    def make(slots: int = 16, root: Path | None = None, **kw) -> DiskBackend:
        kw.setdefault("block_bytes", BLOCK)
        kw.setdefault("namespace", "test-model")
        budget = slots * slot_bytes_for(kw["block_bytes"])
        backend = DiskBackend(str(root or tmp_path), budget, **kw)
        opened.append(backend)
        return backend

    return make


def loads(backend: DiskBackend, n: int, size: int = BLOCK) -> bytes:
    out = bytearray(size)
    backend.load(key(n), memoryview(out))
    return bytes(out)


def backend_keys(backend: DiskBackend) -> list[int]:
    return [int.from_bytes(k[4:], "big") for k in backend.inventory()]


def slot_of(backend: DiskBackend, n: int) -> int:
    return backend._index[key(n)].slot


def patch_slab(backend: DiskBackend, slot: int, offset: int, data: bytes) -> None:
    """Write raw bytes into a slot, as a bit flip or a crash would leave them."""
    assert backend._slabs is not None
    slab_no, start = backend._slabs.locate(slot)
    with open(backend._slabs.path(slab_no), "r+b") as f:
        f.seek(start + offset)
        f.write(data)


def flip(backend: DiskBackend, slot: int, offset: int) -> None:
    assert backend._slabs is not None
    slab_no, start = backend._slabs.locate(slot)
    with open(backend._slabs.path(slab_no), "r+b") as f:
        f.seek(start + offset)
        byte = f.read(1)
        f.seek(start + offset)
        f.write(bytes([byte[0] ^ 0x10]))


# -- layout ----------------------------------------------------------------------------


def test_blocks_live_in_preallocated_slabs_at_aligned_slots(make, tmp_path):
    backend = make(slots=10, slab_bytes=4 * SLOT)
    for n in range(10):
        backend.store(key(n), memoryview(payload(n)))
    directory = tmp_path / namespace_dir("test-model")
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["lock", "meta.json", "slab-00000.dat", "slab-00001.dat", "slab-00002.dat"]
    sizes = [(directory / f"slab-0000{i}.dat").stat().st_size for i in range(3)]
    assert sizes == [4 * SLOT, 4 * SLOT, 2 * SLOT]  # the last slab stops at the budget
    assert SLOT % 4096 == 0 and HEADER_AREA % 4096 == 0
    slab_no, offset = backend._slabs.locate(slot_of(backend, 5))
    raw = (directory / f"slab-{slab_no:05d}.dat").read_bytes()
    assert raw[offset + HEADER_AREA : offset + HEADER_AREA + BLOCK] == payload(5)


def test_namespaces_never_escape_the_root_nor_share_slots(make, tmp_path):
    evil = make(namespace="../../etc/passwd")
    plain = make(namespace="model-a")
    assert evil.directory.parent == tmp_path and "/" not in namespace_dir("../../x/y")
    assert namespace_dir("a/b") != namespace_dir("a_b")  # the hash tells them apart
    evil.store(b"../../same/key", memoryview(payload(1)))
    plain.store(b"../../same/key", memoryview(payload(2)))
    out = bytearray(BLOCK)
    evil.load(b"../../same/key", memoryview(out))
    assert bytes(out) == payload(1)
    plain.load(b"../../same/key", memoryview(out))
    assert bytes(out) == payload(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [namespace_dir("../../etc/passwd"), namespace_dir("model-a")])


def test_a_block_of_another_namespace_is_never_served(make, tmp_path):
    a = make(namespace="model-a")
    a.store(key(1), memoryview(payload(1)))
    a.close()
    # Someone copies model-a's slab into model-b's directory.
    b = make(namespace="model-b")
    b.close()
    src, dst = tmp_path / namespace_dir("model-a"), tmp_path / namespace_dir("model-b")
    (dst / "slab-00000.dat").write_bytes((src / "slab-00000.dat").read_bytes())
    b = make(namespace="model-b")
    assert b.inventory() == [] and b.stats()["invalid_slots_at_start"] == 1


# -- restart ---------------------------------------------------------------------------


def test_restart_finds_every_block_and_keeps_lru_order(make):
    backend = make(slots=4)
    for n in range(4):
        backend.store(key(n), memoryview(payload(n)))
    backend.close()
    again = make(slots=4)
    assert again.inventory() == [key(n) for n in range(4)]
    assert all(loads(again, n) == payload(n) for n in range(4))
    # Loads are uses: 0..3 were loaded in order, so 0 is the oldest.
    again.store(key(9), memoryview(payload(9)))
    assert again.take_evicted() == [key(0)]


def test_restart_recovers_10000_blocks_fast_with_progress(make, monkeypatch, caplog):
    backend = make(slots=10_000, block_bytes=512, durable=False)
    for n in range(10_000):
        backend.store(key(n), memoryview(payload(n, 512)))
    backend.close()
    monkeypatch.setattr(disk_startup, "SCAN_PROGRESS_SLOTS", 2500)
    caplog.set_level(logging.INFO, logger="tierkv.disk")
    t0 = time.perf_counter()
    again = make(slots=10_000, block_bytes=512)
    took = time.perf_counter() - t0
    assert len(again.inventory()) == 10_000
    assert all(loads(again, n, 512) == payload(n, 512) for n in range(0, 10_000, 997))
    assert took < 5, f"scan of 10,000 slots took {took:.2f}s"
    progress = [r for r in caplog.records if "scan:" in r.getMessage()]
    assert len(progress) == 4


def test_deleted_and_replaced_blocks_do_not_come_back(make):
    backend = make(slots=8)
    backend.store(key(1), memoryview(payload(1)))
    backend.store(key(2), memoryview(payload(2)))
    backend.store(key(2), memoryview(payload(22)))  # the old copy's slot is freed
    backend.delete(key(1))
    backend.close()
    again = make(slots=8)
    assert again.inventory() == [key(2)] and loads(again, 2) == payload(22)


def test_restart_prefers_the_later_of_two_valid_copies(make):
    backend = make(slots=8)
    backend.store(key(1), memoryview(payload(1)))
    old_slot = slot_of(backend, 1)
    old = pack_header(key(1), b"test-model", payload(1), seq=backend._index[key(1)].seq)
    backend.store(key(1), memoryview(payload(11)))
    # A crash between writing the new copy and clearing the old one's header.
    patch_slab(backend, old_slot, 0, old)
    backend.close()
    again = make(slots=8)
    assert again.inventory() == [key(1)] and loads(again, 1) == payload(11)
    again.close()
    # The loser's header was cleared at that start: deleting the winner is final.
    again = make(slots=8)
    again.delete(key(1))
    again.close()
    assert make(slots=8).inventory() == []


def test_budget_shrink_drops_slots_beyond_it(make, tmp_path):
    backend = make(slots=8, slab_bytes=4 * SLOT)
    for n in range(8):
        backend.store(key(n), memoryview(payload(n)))
    backend.close()
    small = make(slots=3, slab_bytes=4 * SLOT)
    assert set(small.inventory()) == {key(0), key(1), key(2)}
    files = list((tmp_path / namespace_dir("test-model")).glob("slab-*"))
    assert sum(f.stat().st_size for f in files) == 3 * SLOT


# -- integrity -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["payload", "header", "padding-key"])
def test_flipped_byte_is_detected_and_the_key_becomes_a_miss(make, where):
    backend = make(slots=4)
    for n in range(3):
        backend.store(key(n), memoryview(payload(n)))
    slot = slot_of(backend, 1)
    offset = {"payload": HEADER_AREA + 777, "header": 40, "padding-key": 60}[where]
    flip(backend, slot, offset)
    with pytest.raises(TierError) as e:
        loads(backend, 1)
    assert e.value.code is ErrorCode.CORRUPT
    assert not backend.exists(key(1)) and key(1) not in backend.inventory()
    assert backend.stats()["corrupt_blocks"] == 1
    with pytest.raises(TierError) as again:
        loads(backend, 1)
    assert again.value.code is ErrorCode.NOT_FOUND
    # The slot is free again, and its bad block is gone for good.
    backend.store(key(7), memoryview(payload(7)))
    assert slot_of(backend, 7) == slot
    backend.close()
    assert set(make(slots=4).inventory()) == {key(0), key(2), key(7)}


def test_a_torn_write_is_never_served(make):
    backend = make(slots=4)
    backend.store(key(1), memoryview(payload(1)))
    backend.close()
    # A crash mid-write: a whole header for key 2, half of its payload.
    torn = pack_header(key(2), b"test-model", payload(2), seq=99)
    again = make(slots=4)
    patch_slab(again, 3, 0, torn + payload(2)[: BLOCK // 2])
    again.close()
    after = make(slots=4)
    with pytest.raises(TierError) as e:
        loads(after, 2)
    assert e.value.code is ErrorCode.CORRUPT
    assert loads(after, 1) == payload(1)


def test_wrong_buffer_size_and_bad_key_are_bad_requests(make):
    backend = make()
    for call in (lambda: backend.store(key(1), memoryview(bytes(BLOCK - 1))),
                 lambda: backend.load(key(1), memoryview(bytearray(BLOCK + 1))),
                 lambda: backend.store(b"k" * 65, memoryview(bytes(BLOCK)))):
        with pytest.raises(TierError) as e:
            call()
        assert e.value.code is ErrorCode.BAD_REQUEST


# -- budget and a full disk --------------------------------------------------------------


def test_budget_is_respected_under_a_stream_larger_than_it(make, tmp_path):
    backend = make(slots=8, slab_bytes=3 * SLOT)
    evicted: list[bytes] = []
    for n in range(50):
        backend.store(key(n), memoryview(payload(n)))
        evicted += backend.take_evicted()
    held = backend.inventory()
    assert held == [key(n) for n in range(42, 50)]
    assert set(evicted) == {key(n) for n in range(42)}
    assert all(loads(backend, n) == payload(n) for n in range(42, 50))
    files = list((tmp_path / namespace_dir("test-model")).glob("slab-*"))
    assert sum(f.stat().st_size for f in files) <= 8 * SLOT
    assert sum(f.stat().st_blocks * 512 for f in files) <= 8 * SLOT
    stats = backend.stats()
    assert stats["blocks"] == 8 and stats["evictions"] == 42 and stats["capacity_blocks"] == 8


def test_enospc_growing_a_slab_fails_the_store_cleanly(make, monkeypatch):
    backend = make(slots=8, slab_bytes=2 * SLOT)
    backend.store(key(0), memoryview(payload(0)))
    backend.store(key(1), memoryview(payload(1)))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TierError) as e:
        backend.store(key(2), memoryview(payload(2)))
    assert e.value.code is ErrorCode.NO_SPACE and "No space" in e.value.message
    assert backend.stats()["enospc_failures"] == 1 and not backend.exists(key(2))
    assert loads(backend, 0) == payload(0) and loads(backend, 1) == payload(1)
    # The tier now lives within the slab it has: the next store evicts, no retry storm.
    backend.store(key(2), memoryview(payload(2)))
    assert backend.take_evicted() == [key(0)] and loads(backend, 2) == payload(2)
    assert backend.stats()["usable_blocks"] == 2


def test_a_filesystem_smaller_than_the_budget_holds_what_fits_and_fails_no_store(make,
                                                                               tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        # A budget of 1.5 MiB on a 1 MiB filesystem.
        backend = make(slots=128, root=mnt, block_bytes=BLOCK, slab_bytes=16 * SLOT,
                       o_direct=False)
        fits = backend.stats()["capacity_blocks"]
        assert 0.9 * (1 << 20) // SLOT <= fits < 128
        for n in range(128):
            backend.store(key(n), memoryview(payload(n)))
        # The tier grew its slabs to what fits (the last one short), then evicted.
        stats = backend.stats()
        assert stats["enospc_failures"] == 0 and stats["evictions"] == 128 - fits
        assert stats["blocks"] == stats["capacity_blocks"] == fits
        assert backend.capacity() == fits * BLOCK and stats["budget_blocks"] == 128
        assert all(loads(backend, n) == payload(n) for n in backend_keys(backend))
        backend.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- start-up errors ---------------------------------------------------------------------


def test_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(TierError, match="does not exist") as e:
        DiskBackend(str(tmp_path / "nope"), 10 * SLOT, block_bytes=BLOCK)
    assert e.value.code is ErrorCode.FATAL and str(tmp_path / "nope") in e.value.message
    (tmp_path / "file").write_text("x")
    with pytest.raises(TierError, match="not a directory"):
        DiskBackend(str(tmp_path / "file"), 10 * SLOT, block_bytes=BLOCK)


def test_unwritable_root_is_a_clear_error(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    if os.geteuid() == 0:
        # Root ignores mode bits; an immutable directory refuses even root.
        if subprocess.run(["chattr", "+i", str(root)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here")
        undo = ["chattr", "-i", str(root)]
    else:
        root.chmod(0o500)
        undo = ["chmod", "700", str(root)]
    try:
        with pytest.raises(TierError, match="not writable") as e:
            DiskBackend(str(root), 10 * SLOT, block_bytes=BLOCK)
        assert str(root) in e.value.message
    finally:
        subprocess.run(undo, check=True)


def test_one_process_per_directory(make):
    make()
    with pytest.raises(TierError, match="in use by another tier process"):
        make()


def test_other_block_size_under_the_same_namespace_is_refused(make):
    make().close()
    with pytest.raises(TierError, match="8192-byte blocks"):
        make(block_bytes=4096)


def test_bad_options_are_config_errors(tmp_path):
    with pytest.raises(TierConfigError, match="at least one slot"):
        DiskBackend(str(tmp_path), SLOT - 1, block_bytes=BLOCK)
    with pytest.raises(TierConfigError, match="o_direct"):
        DiskBackend(str(tmp_path), 4 * SLOT, block_bytes=BLOCK, o_direct="maybe")


def test_config_entry_builds_the_disk_tier(tmp_path, opened):
    entry = {"type": "disk", "name": "disk", "root": str(tmp_path), "budget_bytes": 4 * SLOT,
             "threads": 4}
    backend = create_backend(entry, block_bytes=BLOCK, namespace="m", instance="i", name="disk")
    opened.append(backend)
    assert isinstance(backend, DiskBackend) and backend.capacity() == 4 * BLOCK
    with pytest.raises(TierConfigError, match="unknown option"):
        create_backend({**entry, "rooot": "x"}, block_bytes=BLOCK)


# -- data path -----------------------------------------------------------------------------


def store_first(runner: JobRunner, region: SharedRegion, n: int) -> None:
    """Blocks 0..n-1 of `region` filled with their payloads and submitted as store job
    1 of keys 0..n-1."""
    for b in range(n):
        region.block(b)[:] = payload(b)
    runner.submit(Job(1, tuple(key(b) for b in range(n)), tuple(range(n)), JobKind.STORE))


def test_o_direct_moves_aligned_rows_and_buffered_the_rest(make, instance, caplog):
    caplog.set_level(logging.WARNING, logger="tierkv.disk")
    backend = make(slots=16, block_bytes=BLOCK, o_direct="auto")
    if not backend.stats()["o_direct"]:
        pytest.skip(f"no O_DIRECT on this filesystem: {caplog.text}")
    with SharedRegion.create(instance, num_blocks=8, page_size=BLOCK) as region:
        runner = JobRunner(backend, region, threads=4)
        try:
            store_first(runner, region, 4)
            assert runner.drain(30)
            runner.submit(Job(2, (key(0), key(3)), (4, 5), JobKind.PROMOTION))
            assert runner.drain(30)
            assert [r.success for r in runner.take_finished()] == [True, True]
            assert bytes(region.block(4)) == payload(0) and bytes(region.block(5)) == payload(3)
        finally:
            runner.close()
            runner.rows = None
    # An unaligned buffer takes the buffered path, same bytes.
    odd = bytearray(BLOCK + 1)
    view = memoryview(odd)[1:]
    backend.load(key(2), view)
    assert bytes(view) == payload(2)
    # Blocks that are not a multiple of 4 KiB: buffered, with one warning.
    small = make(slots=4, block_bytes=1024, namespace="small", o_direct="auto")
    assert small.stats()["o_direct"] is False and "not a multiple of 4096" in caplog.text


def test_group_commit_shares_fdatasync_between_threads(make, monkeypatch):
    real = os.fdatasync

    def slow(fd):  # a disk where a flush costs 5 ms
        time.sleep(0.005)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)
    grouped = make(slots=64, namespace="grouped", sync_per="store")
    single = make(slots=64, namespace="single", group_commit=False, sync_per="store")
    for backend in (grouped, single):
        threads = [threading.Thread(target=lambda b=backend, i=i: [
            b.store(key(i * 8 + j), memoryview(payload(j))) for j in range(8)])
            for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert grouped.stats()["durable_writes"] == single.stats()["durable_writes"] == 64
    assert single.stats()["fdatasyncs"] == 64
    assert grouped.stats()["fdatasyncs"] <= 32, grouped.stats()


def test_failed_fdatasync_fails_every_store_it_covered(make, monkeypatch):
    backend = make(slots=8, sync_per="store")
    backend.store(key(0), memoryview(payload(0)))

    def broken(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    with pytest.raises(TierError) as e:
        backend.store(key(1), memoryview(payload(1)))
    assert e.value.code is ErrorCode.FATAL and "Input/output" in e.value.message
    assert not backend.exists(key(1)) and backend.exists(key(0))
    monkeypatch.undo()
    backend.store(key(1), memoryview(payload(1)))
    assert loads(backend, 1) == payload(1)


def test_a_store_job_is_made_durable_with_one_flush_per_slab(make, monkeypatch, instance):
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    backend = make(slots=32)  # sync_per="job": the default
    with SharedRegion.create(instance, num_blocks=16, page_size=BLOCK) as region:
        runner = JobRunner(backend, region, threads=4)
        try:
            store_first(runner, region, 16)
            assert runner.drain(30)
            (result,) = runner.take_finished()
        finally:
            runner.close()
    assert result.success
    assert 1 <= len(synced) <= 2  # one flush per slab file written, not one per key
    assert backend.stats()["durable_writes"] == len(synced)


def test_a_failed_job_flush_fails_the_whole_job(make, monkeypatch, instance):
    backend = make(slots=8)

    def broken(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    with SharedRegion.create(instance, num_blocks=2, page_size=BLOCK) as region:
        runner = JobRunner(backend, region, threads=0)
        runner.submit(Job(1, (key(0), key(1)), (0, 1), JobKind.STORE))
        (result,) = runner.take_finished()
    assert not result.success and result.successful_keys == ()
    assert result.error_code is ErrorCode.FATAL and "Input/output" in result.error


def test_loads_racing_restores_deletes_and_evictions_never_see_bad_bytes(make):
    backend = make(slots=6, durable=False)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(ns: range) -> None:
        try:
            while not stop.is_set():
                for n in ns:
                    backend.store(key(n), memoryview(payload(n)))
                    if n % 3 == 0:
                        backend.delete(key(n))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader() -> None:
        try:
            while not stop.is_set():
                for n in range(12):
                    try:
                        assert loads(backend, n) == payload(n)
                    except TierError as e:
                        assert e.code is ErrorCode.NOT_FOUND, e
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(range(0, 12, 2),)),
               threading.Thread(target=writer, args=(range(1, 12, 2),)),
               threading.Thread(target=reader), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors[:3]
    stats = backend.stats()
    assert stats["corrupt_blocks"] == 0 and stats["blocks"] <= 6
    # Every slot is accounted for: held, free, or never handed out.
    free = len(backend._free) + (stats["capacity_blocks"] - backend._fresh)
    assert free + stats["blocks"] == 6 and not backend._readers and not backend._retired


def test_evicted_keys_leave_out_keys_stored_again(make):
    backend = make(slots=2)
    for n in (1, 2, 3):  # evicts 1
        backend.store(key(n), memoryview(payload(n)))
    backend.store(key(1), memoryview(payload(1)))  # evicts 2; 1 is back
    assert backend.take_evicted() == [key(2)]


def test_stats_name_what_the_issue_asks_for(make):
    backend = make(slots=4)
    backend.store(key(1), memoryview(payload(1)))
    stats = backend.stats()
    for name in ("blocks", "bytes_used", "capacity_bytes", "corrupt_blocks", "evictions",
                 "o_direct", "enospc_failures", "fdatasyncs"):
        assert name in stats
    assert stats["bytes_used"] == BLOCK and stats["capacity_bytes"] == 4 * BLOCK
    assert HEADER_SIZE <= HEADER_AREA


# -- runs of adjacent slots (store_many / load_many) -----------------------------------


def counting(monkeypatch, name: str) -> list[int]:
    """Count the calls of os.<name> (preadv or pwritev), and the iovecs of each."""
    calls: list[int] = []
    real = getattr(os, name)

    def counted(fd, iov, offset):
        calls.append(len(iov))
        return real(fd, iov, offset)

    monkeypatch.setattr(os, name, counted)
    return calls


@pytest.mark.parametrize("staging", [True, False])
def test_a_job_moves_in_one_request_per_run_of_adjacent_slots(make, instance, monkeypatch,
                                                               staging):
    backend = make(slots=32, run_bytes=4 * SLOT, staging=staging)
    assert backend.batch_keys(BLOCK) == 4
    writes, reads = counting(monkeypatch, "pwritev"), counting(monkeypatch, "preadv")
    with SharedRegion.create(instance, num_blocks=16, page_size=BLOCK) as region:
        runner = JobRunner(backend, region, threads=2)
        try:
            store_first(runner, region, 8)
            assert runner.drain(30)
            runner.submit(Job(2, tuple(key(b) for b in range(8)), tuple(range(8, 16)),
                              JobKind.PROMOTION))
            assert runner.drain(30)
            assert [r.success for r in runner.take_finished()] == [True, True]
            assert all(bytes(region.block(8 + b)) == payload(b) for b in range(8))
        finally:
            runner.close()
            runner.rows = None
    assert sorted(slot_of(backend, b) for b in range(8)) == list(range(8))  # adjacent
    assert len(writes) == len(reads) == 2  # two runs of four blocks each way
    staged = staging and backend.stats()["o_direct"]
    assert writes == reads == ([1, 1] if staged else [8, 8])  # one iovec: the whole run
    assert backend.stats()["stores"] == backend.stats()["loads"] == 8


@pytest.mark.parametrize("staging", [True, False])
def test_a_bad_block_in_a_run_fails_its_key_only(make, staging):
    backend = make(slots=8, staging=staging)
    srcs = [memoryview(payload(n)) for n in range(5)]
    assert backend.store_many([key(n) for n in range(5)], srcs) == [None] * 5
    flip(backend, slot_of(backend, 2), HEADER_AREA + 100)
    dsts = [bytearray(b"\xee" * BLOCK) for _ in range(5)]
    errors = backend.load_many([key(n) for n in range(5)], [memoryview(d) for d in dsts])
    assert [e is None for e in errors] == [True, True, False, True, True]
    assert errors[2] is not None and errors[2].code is ErrorCode.CORRUPT
    assert [bytes(dsts[n]) == payload(n) for n in (0, 1, 3, 4)] == [True] * 4
    if staging and backend.stats()["o_direct"]:
        assert bytes(dsts[2]) == b"\xee" * BLOCK  # verified before it reached the row
    assert not backend.exists(key(2)) and backend.stats()["corrupt_blocks"] == 1


def test_a_slab_cut_inside_a_run_fails_the_blocks_after_the_cut(make):
    backend = make(slots=8)
    backend.store_many([key(n) for n in range(4)], [memoryview(payload(n)) for n in range(4)])
    assert backend._slabs is not None
    slab_no, start = backend._slabs.locate(slot_of(backend, 2))
    os.truncate(backend._slabs.path(slab_no), start + SLOT // 2)
    dsts = [bytearray(BLOCK) for _ in range(4)]
    errors = backend.load_many([key(n) for n in range(4)], [memoryview(d) for d in dsts])
    assert [e is None for e in errors] == [True, True, False, False]
    assert all(e.code is ErrorCode.CORRUPT for e in errors[2:] if e is not None)
    assert "truncated" in str(errors[2].message if errors[2] else "")
    assert bytes(dsts[0]) == payload(0) and bytes(dsts[1]) == payload(1)


def test_store_many_and_load_many_answer_each_key(make):
    backend = make(slots=4)
    errors = backend.store_many([key(0), b"", key(2)], [memoryview(payload(0)),
                                                        memoryview(payload(1)),
                                                        memoryview(payload(2)[:100])])
    assert errors[0] is None
    assert [e.code if e else None for e in errors[1:]] == [ErrorCode.BAD_REQUEST] * 2
    out = [bytearray(BLOCK), bytearray(BLOCK)]
    loaded = backend.load_many([key(9), key(0)], [memoryview(b) for b in out])
    assert loaded[0] is not None and loaded[0].code is ErrorCode.NOT_FOUND
    assert loaded[1] is None and bytes(out[1]) == payload(0)
    assert backend.inventory() == [key(0)]  # refused keys took no slot for good
    assert backend.stats()["usable_blocks"] == 4 and len(backend._free) == 0


def test_a_run_of_a_job_never_spans_two_slabs(make, monkeypatch):
    backend = make(slots=8, slab_bytes=3 * SLOT, run_bytes=8 * SLOT)
    writes = counting(monkeypatch, "pwritev")
    assert backend.store_many([key(n) for n in range(8)],
                              [memoryview(payload(n)) for n in range(8)]) == [None] * 8
    assert len(writes) == 3  # slots 0-2, 3-5, 6-7: one request per slab
    for n in range(8):
        assert loads(backend, n) == payload(n)


def test_staging_buffers_are_huge_page_aligned():
    from workers.disk.layout import buffer_address
    from workers.disk.runs import HUGE, staging_buffer

    buf = staging_buffer(3 * SLOT)
    assert len(buf) == 3 * SLOT and buffer_address(buf) % HUGE == 0
    buf[:] = b"\x01" * len(buf)  # writable, private


def test_keys_that_find_no_slot_wait_for_the_rest_of_their_call(make):
    # 4 slots, 6 keys in one call: the first 4 take the free slots; the last 2
    # find none while those are being written, so they ask again once they are
    # in, and evict the oldest, as a block-at-a-time store would.
    backend = make(slots=4, run_bytes=8 * SLOT)
    errors = backend.store_many([key(n) for n in range(6)],
                                [memoryview(payload(n)) for n in range(6)])
    assert errors == [None] * 6
    assert sorted(backend_keys(backend)) == [2, 3, 4, 5]
    assert [loads(backend, n) == payload(n) for n in (2, 3, 4, 5)] == [True] * 4
    # Pinned (one job's keys), nothing can make room: refused, not forced.
    errors = backend.store_many([key(n) for n in range(10, 16)],
                                [memoryview(payload(n)) for n in range(10, 16)],
                                pinned={key(n) for n in range(10, 16)})
    assert [e.code if e else None for e in errors] == [None] * 4 + [ErrorCode.NO_SPACE] * 2
    assert all(e is None or e.__traceback__ is None for e in errors)  # keeps no frame


def test_a_failed_load_keeps_no_view_of_the_row_alive(make):
    import gc

    backend = make(slots=4)
    backend.store(key(1), memoryview(payload(1)))
    flip(backend, slot_of(backend, 1), HEADER_AREA + 5)
    row = bytearray(BLOCK)
    gc.disable()  # reference counting only: a cycle would keep the row's view alive
    try:
        with pytest.raises(TierError):
            backend.load(key(1), memoryview(row))
        row.extend(b"x")  # BufferError while any view of `row` is still alive
    finally:
        gc.enable()
