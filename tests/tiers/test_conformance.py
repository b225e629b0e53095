"""Behaviour every tier backend promises (run against each in conftest.BACKENDS)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.shm import SharedRegion
from tierkv.tiers.base import Job, JobKind
from tierkv.tiers.memory import MemoryBackend
from tierkv.tiers.runner import JobRunner

BLOCK = 8192


def key(n: int) -> bytes:
    return b"key-" + n.to_bytes(4, "big")


def payload(n: int, size: int = BLOCK) -> bytes:
    return (os.urandom(16) + n.to_bytes(4, "big")) * (size // 20) + b"\x00" * (size % 20)


def test_store_then_load_round_trip(backend_factory):
    backend = backend_factory(BLOCK)
    data = payload(1)
    backend.store(key(1), memoryview(data))
    out = bytearray(BLOCK)
    backend.load(key(1), memoryview(out))
    assert bytes(out) == data
    assert backend.exists(key(1))
    assert key(1) in backend.inventory()


def test_load_of_missing_key_is_not_found(backend_factory):
    backend = backend_factory(BLOCK)
    with pytest.raises(TierError) as e:
        backend.load(key(9), memoryview(bytearray(BLOCK)))
    assert e.value.code is ErrorCode.NOT_FOUND
    assert not backend.exists(key(9))


def test_delete_is_idempotent(backend_factory):
    backend = backend_factory(BLOCK)
    backend.store(key(1), memoryview(payload(1)))
    backend.delete(key(1))
    backend.delete(key(1))
    assert not backend.exists(key(1))
    with pytest.raises(TierError):
        backend.load(key(1), memoryview(bytearray(BLOCK)))


def test_overwrite_keeps_latest_bytes(backend_factory):
    backend = backend_factory(BLOCK)
    backend.store(key(1), memoryview(payload(1)))
    second = payload(2)
    backend.store(key(1), memoryview(second))
    out = bytearray(BLOCK)
    backend.load(key(1), memoryview(out))
    assert bytes(out) == second


def test_capacity_bounds_and_reports_evictions(backend_factory):
    backend = backend_factory(BLOCK, capacity_blocks=4)
    for n in range(10):
        backend.store(key(n), memoryview(payload(n)))
    evicted = backend.take_evicted()
    held = [key(n) for n in range(10) if backend.exists(key(n))]
    assert len(held) <= 4
    assert set(evicted) == {key(n) for n in range(10)} - set(held)
    assert backend.take_evicted() == []
    assert key(9) in held  # the newest survives


def test_eviction_spares_pinned_keys(backend_factory):
    backend = backend_factory(BLOCK, capacity_blocks=2)
    backend.store(key(1), memoryview(payload(1)))
    backend.store(key(2), memoryview(payload(2)), pinned={key(1), key(2)})
    backend.store(key(3), memoryview(payload(3)), pinned={key(1), key(3)})
    assert backend.exists(key(1)) and backend.exists(key(3)) and not backend.exists(key(2))


def test_touch_protects_from_eviction(backend_factory):
    backend = backend_factory(BLOCK, capacity_blocks=2)
    backend.store(key(1), memoryview(payload(1)))
    backend.store(key(2), memoryview(payload(2)))
    backend.touch([key(1)])
    backend.store(key(3), memoryview(payload(3)))
    assert backend.exists(key(1)) and not backend.exists(key(2))


def test_concurrent_stores_and_loads(backend_factory):
    backend = backend_factory(BLOCK, capacity_blocks=64)
    datas = {n: payload(n) for n in range(32)}
    errors: list[BaseException] = []

    def work(ns: range) -> None:
        try:
            for n in ns:
                backend.store(key(n), memoryview(datas[n]))
            for n in ns:
                out = bytearray(BLOCK)
                backend.load(key(n), memoryview(out))
                assert bytes(out) == datas[n]
        except BaseException as e:  # noqa: BLE001 - collected for the assert below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(range(i, 32, 4),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_jobs_through_the_runner_against_shared_memory(backend_factory, instance):
    with SharedRegion.create(instance, num_blocks=8, page_size=BLOCK) as region:
        backend = backend_factory(region.block_bytes, capacity_blocks=64)
        runner = JobRunner(backend, region, threads=3)
        try:
            for b in range(4):
                region.block(b)[:] = payload(b)
            expected = {b: bytes(region.block(b)) for b in range(4)}
            runner.submit(Job(1, tuple(key(b) for b in range(4)), (0, 1, 2, 3), JobKind.STORE))
            assert runner.drain(30)
            (stored,) = runner.take_finished()
            assert stored.success and stored.bytes_moved == 4 * region.block_bytes
            # Load into other rows; key 7 was never stored: a partial result.
            runner.submit(Job(2, (key(0), key(3), key(7)), (4, 5, 6), JobKind.PROMOTION))
            assert runner.drain(30)
            (loaded,) = runner.take_finished()
            assert not loaded.success
            assert loaded.successful_keys == (key(0), key(3))
            assert loaded.error_code is ErrorCode.NOT_FOUND
            assert bytes(region.block(4)) == expected[0]
            assert bytes(region.block(5)) == expected[3]
            runner.submit(Job(3, (key(1), key(7)), (), JobKind.EXISTS))
            assert runner.drain(30)
            (exists,) = runner.take_finished()
            assert exists.successful_keys == (key(1),)
        finally:
            runner.close()


class _SlowBackend(MemoryBackend):
    """Each store takes 50 ms: a queue of them outlives a short deadline."""

    def store(self, key, data, pinned=()):  # noqa: ANN001, ANN201
        time.sleep(0.05)
        return super().store(key, data, pinned)


def test_keys_not_started_by_the_deadline_fail_as_timeout_without_io(instance):
    """A tier behind a long queue reports "too late" for what it has not started,
    instead of running it late and being fenced by the broker for holding it."""
    with SharedRegion.create(instance, num_blocks=8, page_size=BLOCK) as region:
        backend = _SlowBackend(capacity_blocks=64, block_bytes=BLOCK)
        runner = JobRunner(backend, region, threads=1)
        try:
            keys = tuple(key(b) for b in range(8))
            runner.submit(Job(1, keys, tuple(range(8)), JobKind.STORE),
                          deadline=time.monotonic() + 0.12)
            assert runner.drain(30)
            (result,) = runner.take_finished()
            assert not result.success and result.error_code is ErrorCode.TIMEOUT
            # The keys that started before the deadline were stored (and reported),
            # the rest were never written.
            assert 1 <= len(result.successful_keys) < 8
            assert result.successful_keys == keys[: len(result.successful_keys)]
            assert set(backend.inventory()) == set(result.successful_keys)
            runner.submit(Job(2, keys[:2], (0, 1), JobKind.STORE))  # no deadline: all run
            assert runner.drain(30)
            assert runner.take_finished()[0].success
        finally:
            runner.close()
