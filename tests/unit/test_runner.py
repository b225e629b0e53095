"""JobRunner hands stores and loads to the backend in runs (`batch_keys`), split
evenly, and reports each key of a run on its own."""

from __future__ import annotations

from collections.abc import Container, Sequence

import pytest

from tierkv.core.errors import ErrorCode, TierError
from tierkv.tiers.base import Job, JobKind
from tierkv.tiers.memory import MemoryBackend
from tierkv.tiers.runner import JobRunner

BLOCK = 64


class Rows:
    """CPU-tier rows in plain memory."""

    block_bytes = BLOCK

    def __init__(self, n: int) -> None:
        self.data = bytearray(n * BLOCK)

    def block(self, block_id: int) -> memoryview:
        return memoryview(self.data)[block_id * BLOCK:(block_id + 1) * BLOCK]


class RunBackend(MemoryBackend):
    """Takes runs of `run` keys; key b"bad" fails to load as corrupt."""

    def __init__(self, run: int) -> None:
        super().__init__(64, BLOCK)
        self.run = run
        self.calls: list[tuple[str, int]] = []

    def batch_keys(self, block_bytes: int) -> int:
        assert block_bytes == BLOCK
        return self.run

    def store_many(self, keys: Sequence[bytes], srcs: Sequence[memoryview],
                   pinned: Container[bytes] = ()) -> list[TierError | None]:
        self.calls.append(("store", len(keys)))
        assert all(k in pinned for k in keys)
        return super().store_many(keys, srcs, pinned)

    def load_many(self, keys: Sequence[bytes],
                  dsts: Sequence[memoryview]) -> list[TierError | None]:
        self.calls.append(("load", len(keys)))
        errors = super().load_many(keys, dsts)
        return [TierError(ErrorCode.CORRUPT, "bad") if k == b"bad" else e
                for k, e in zip(keys, errors, strict=True)]


def keys(n: int) -> tuple[bytes, ...]:
    return tuple(b"k%d" % i for i in range(n))


@pytest.mark.parametrize("threads", [0, 3])
def test_stores_and_loads_go_in_even_runs(threads):
    backend, rows = RunBackend(run=3), Rows(16)
    for b in range(8):
        rows.block(b)[:] = bytes([b]) * BLOCK
    runner = JobRunner(backend, rows, threads=threads)
    try:
        runner.submit(Job(1, keys(8), tuple(range(8)), JobKind.STORE))
        assert runner.drain(30)  # loads run first: the store must have landed
        runner.submit(Job(2, keys(8), tuple(range(8, 16)), JobKind.PROMOTION))
        runner.submit(Job(3, keys(2), (), JobKind.EXISTS))
        assert runner.drain(30)
        results = {r.job_id: r for r in runner.take_finished()}
    finally:
        runner.close()
    assert all(r.success for r in results.values())
    assert results[1].bytes_moved == results[2].bytes_moved == 8 * BLOCK
    assert sorted(backend.calls) == [("load", 2), ("load", 3), ("load", 3),
                                     ("store", 2), ("store", 3), ("store", 3)]
    assert all(bytes(rows.block(8 + b)) == bytes([b]) * BLOCK for b in range(8))


def test_each_key_of_a_run_is_reported_on_its_own():
    backend, rows = RunBackend(run=4), Rows(8)
    runner = JobRunner(backend, rows, threads=0)
    runner.submit(Job(1, (b"a", b"bad", b"c"), (0, 1, 2), JobKind.STORE))
    runner.submit(Job(2, (b"a", b"bad", b"zz", b"c"), (3, 4, 5, 6), JobKind.PROMOTION))
    stored, loaded = runner.take_finished()
    assert stored.success and stored.bytes_moved == 3 * BLOCK
    assert not loaded.success and loaded.successful_keys == (b"a", b"c")
    assert loaded.bytes_moved == 2 * BLOCK
    assert loaded.error_code is ErrorCode.CORRUPT  # the first failure of the job


def test_a_backend_that_answers_too_few_keys_fails_the_run():
    class Short(RunBackend):
        def load_many(self, keys, dsts):
            return [None]

    backend, rows = Short(run=2), Rows(4)
    backend.store(b"a", memoryview(bytes(BLOCK)))
    runner = JobRunner(backend, rows, threads=0)
    runner.submit(Job(1, (b"a", b"a"), (0, 1), JobKind.PROMOTION))
    (result,) = runner.take_finished()
    assert not result.success and result.error_code is ErrorCode.FATAL


def test_a_backend_without_runs_gets_a_task_per_key():
    backend, rows = MemoryBackend(16, BLOCK), Rows(4)
    assert backend.batch_keys(BLOCK) == 1
    runner = JobRunner(backend, rows, threads=0)
    runner.submit(Job(1, keys(4), (0, 1, 2, 3), JobKind.STORE))
    (result,) = runner.take_finished()
    assert result.success and set(backend.inventory()) == set(keys(4))
