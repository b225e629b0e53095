"""The transfer engine on CPU: real shared memory for the KV cache and the CPU tier,
one engine per rank; the engine contract it checks. (The CUDA backend's logic on
CPU is in test_cuda_logic.py.)"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workers.gpu.copy_cpu as transfer_cpu
from tierkv.core.shm import SharedRegion
from tierkv.engine import KVLayout, OpenedKV, allocate_kv_cache, open_kv_cache
from tierkv.wire.protocol import TransferJob, TransferOutcome
from workers.gpu.jobs import TransferError, runs
from workers.gpu.transfer import TransferEngine

NUM_BLOCKS = 24  # KV cache blocks
CPU_BLOCKS = 20  # CPU-tier rows

LAYOUTS = {
    # 3 layers, pieces of 4*2*8*2 = 128 bytes: page 768 bytes, rows padded to 4 KiB
    "per_layer": lambda n=NUM_BLOCKS: KVLayout.per_layer(3, n, 4, 2, 8, "float16"),
    # one tensor, a block is one 1536-byte slice (2 pages = 3072 B, padded)
    "blocks_outer": lambda n=NUM_BLOCKS: KVLayout.blocks_outer(n, 3, 2, 4, 16, "bfloat16"),
}


def page_of(kv: OpenedKV, block: int) -> bytes:
    """The page layout, written independently of the engine: tensor after tensor,
    the block's slice in row-major order."""
    d = kv.layout.block_dim
    return b"".join(
        t.select(d, block).contiguous().view(torch.uint8).numpy().tobytes() for t in kv.tensors
    )


def fill_random(kv: OpenedKV, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv.tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8, generator=gen))


def zero_blocks(kv: OpenedKV, blocks: list[int]) -> None:
    for t in kv.tensors:
        t.index_fill_(kv.layout.block_dim, torch.tensor(blocks), 0)


def run(engine: TransferEngine, *jobs: TransferJob) -> dict[int, TransferOutcome]:
    for job in jobs:
        engine.submit(job)
    out = engine.wait(timeout=30)
    assert engine.in_flight == 0
    assert sorted(o.job_id for o in out) == sorted(j.job_id for j in jobs)  # once each
    return {o.job_id: o for o in out}


class Rank:
    """One rank: its engine-side KV cache, the worker's view of it, its engine."""

    def __init__(self, instance: str, rank: int, region: SharedRegion, layout: KVLayout):
        self.cache = allocate_kv_cache(instance, rank, layout)
        self.kv = open_kv_cache(self.cache.registration())
        self.engine = TransferEngine(region, rank, "cpu")
        self.engine.attach(self.kv)

    def close(self) -> None:
        self.engine.close()
        self.kv.close()
        self.cache.close()


@contextlib.contextmanager
def ranks(instance: str, layout: KVLayout, world_size: int) -> Iterator[
    tuple[SharedRegion, list[Rank]]
]:
    """A region (owned) and, per rank, an attached view of it like a worker has."""
    region = SharedRegion.create(instance, CPU_BLOCKS, layout.page_size, world_size)
    attached = [SharedRegion.attach(instance) for _ in range(world_size)]
    made: list[Rank] = []
    try:
        for r in range(world_size):
            made.append(Rank(instance, r, attached[r], layout))
        yield region, made
    finally:
        for rank in made:
            rank.close()
        for a in attached:
            a.close()
        region.close()
        region.unlink()


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_store_zero_load_is_bit_exact(instance, kind, world_size):
    layout = LAYOUTS[kind]()
    rng = np.random.default_rng(7)
    with ranks(instance, layout, world_size) as (region, rs):
        region.numpy()[:] = 0xAB  # sentinel: nobody may touch bytes outside its page
        for r, rank in enumerate(rs):
            fill_random(rank.kv, seed=r)
        others = rng.permutation([g for g in range(NUM_BLOCKS) if not 5 <= g < 10])
        gpu = [*others[:3].tolist(), 5, 6, 7, 8, 9, *others[3:7].tolist()]  # scattered + a run
        cpu = [*rng.choice(CPU_BLOCKS, 8, replace=False).tolist()]
        cpu += [c for c in range(CPU_BLOCKS) if c not in cpu][:4]
        before = [[page_of(rank.kv, g) for g in gpu] for rank in rs]
        for r, rank in enumerate(rs):
            out = run(rank.engine, TransferJob(1, "store", gpu, cpu))
            assert out[1].success and out[1].bytes_moved == 12 * layout.page_size
            if r == 0 and world_size == 2:  # rank 0 wrote its pages only
                assert (region.numpy_pages(1) == 0xAB).all()
        for r in range(world_size):
            assert [bytes(region.page(c, r)) for c in cpu] == before[r]
        untouched = [c for c in range(CPU_BLOCKS) if c not in cpu]
        assert (region.numpy()[untouched] == 0xAB).all()
        assert (region.numpy()[:, world_size * layout.page_size:] == 0xAB).all()  # padding

        target = rng.permutation(NUM_BLOCKS)[:12].tolist()
        for rank in rs:
            zero_blocks(rank.kv, gpu)
            zero_blocks(rank.kv, target)
            out = run(rank.engine, TransferJob(2, "load", target, cpu))
            assert out[2].success
        for r, rank in enumerate(rs):
            assert [page_of(rank.kv, g) for g in target] == before[r]


def test_consecutive_and_scattered_paths_agree(instance, monkeypatch):
    """The same job through slice copies, fancy assignment and chunked gathers."""
    layout = LAYOUTS["per_layer"]()
    gpu = [0, 1, 2, 3, 10, 11, 12, 5, 7, 9, 20, 21]
    cpu = [4, 5, 6, 7, 0, 2, 1, 19, 18, 17, 8, 9]
    results = []
    for min_run, chunk in ((1, 1 << 20), (1 << 30, 256), (1 << 30, 1 << 20)):
        monkeypatch.setattr(transfer_cpu, "MIN_RUN_BYTES", min_run)
        monkeypatch.setattr(transfer_cpu, "CHUNK_BYTES", chunk)
        with ranks(f"{instance}{min_run}", layout, 1) as (region, (rank,)):
            fill_random(rank.kv, seed=3)
            assert run(rank.engine, TransferJob(1, "store", gpu, cpu))[1].success
            assert all(bytes(region.page(c)) == page_of(rank.kv, g)
                       for g, c in zip(gpu, cpu, strict=True))
            results.append(region.numpy().copy())
    assert all((r == results[0]).all() for r in results)


@pytest.mark.parametrize("world_size", [1, 2])
def test_grouped_copies_land_what_the_page_layout_says(instance, monkeypatch, world_size):
    """Stores from and loads into a per_layer KV cache through the grouped copies
    (every tensor at once: a store's run whole, a load's two blocks a call; a run of
    5, runs of 1) beside the other paths (a run whose ids are scattered) copy each
    page to its block and nothing else."""
    monkeypatch.setattr(transfer_cpu, "GROUP_MIN_PIECE", 1)  # the test's pieces are small
    monkeypatch.setattr(transfer_cpu, "MIN_RUN_BYTES", 1)
    grouped: list[tuple[int, int | None]] = []
    real = transfer_cpu._copy_grouped

    def counting(src, dst, s0, d0, n, group):
        grouped.append((n, group))
        real(src, dst, s0, d0, n, group)

    monkeypatch.setattr(transfer_cpu, "_copy_grouped", counting)
    layout = LAYOUTS["per_layer"]()
    every = list(range(CPU_BLOCKS))
    gpu = [3, 4, 5, 6, 7, 12, 0, 20, 21, 9, 15]
    cpu = [10, 11, 12, 13, 14, 2, 5, 6, 7, 19, 0]
    with ranks(instance, layout, world_size) as (region, rs):
        for r, rank in enumerate(rs):
            fill_random(rank.kv, seed=r)
            assert run(rank.engine, TransferJob(1, "store", every, every))[1].success
        pages = [[bytes(region.page(c, r)) for c in every] for r in range(world_size)]
        for r, rank in enumerate(rs):
            assert pages[r] == [page_of(rank.kv, g) for g in every]
            fill_random(rank.kv, seed=10 + r)
            assert run(rank.engine, TransferJob(3, "store", gpu, cpu))[3].success
            new = {c: page_of(rank.kv, g) for g, c in zip(gpu, cpu, strict=True)}
            for c in every:  # the stored rows are the new pages; the others are as they were
                assert bytes(region.page(c, r)) == new.get(c, pages[r][c])
            pages[r] = [bytes(region.page(c, r)) for c in every]
        for rank in rs:
            zero_blocks(rank.kv, list(range(NUM_BLOCKS)))
            assert run(rank.engine, TransferJob(2, "load", gpu, cpu))[2].success
        for r, rank in enumerate(rs):
            assert [page_of(rank.kv, g) for g in gpu] == [pages[r][c] for c in cpu]
            assert not any(any(page_of(rank.kv, g)) for g in range(NUM_BLOCKS) if g not in gpu)
    stores = sorted(n for n, group in grouped if group is None)
    loads = sorted(n for n, group in grouped if group is not None)
    # the first store whole; then gpu 0, 9, 12, 15 alone, 3..7 to 10..14, 20 and 21 to 6, 7
    assert stores == sorted([CPU_BLOCKS, 1, 1, 1, 1, 5, 2] * world_size)
    assert loads == sorted([1, 1, 1, 5] * world_size)  # cpu 0, 2, 19; 10..14


def test_stacked_views_only_for_evenly_spaced_tensors():
    """One view of every tensor, element for element the same bytes, or none."""
    buf = np.zeros(400, np.uint8)

    def tensor(at: int) -> np.ndarray:  # (blocks 3, outer 2, inner 8), blocks inner
        return buf[at : at + 48].reshape(2, 3, 8).transpose(1, 0, 2)

    views = [tensor(at) for at in (0, 64, 128)]
    stacked = transfer_cpu.SideViews(views).stacked
    assert stacked is not None and stacked.shape == (3, 3, 2, 8)
    stacked[2, 1, 0, 5] = 7  # block 2 of tensor 1
    assert views[1][2, 0, 5] == 7 and buf.sum() == 7
    for b, t in np.ndindex(3, 3):
        assert (stacked[b, t] == views[t][b]).all()
        assert stacked[b, t].__array_interface__ == views[t][b].__array_interface__
    assert transfer_cpu.SideViews([tensor(0), tensor(64), tensor(200)]).stacked is None
    odd = buf[300:348].reshape(3, 2, 8)  # blocks outer: other strides
    assert transfer_cpu.SideViews([tensor(0), odd]).stacked is None
    assert transfer_cpu.SideViews([tensor(0)]).stacked.shape == (3, 1, 2, 8)


def test_runs():
    starts, lengths = runs(np.array([3, 4, 5, 9, 2, 3, 7]))
    assert starts.tolist() == [0, 3, 4, 6]
    assert lengths.tolist() == [3, 1, 2, 1]
    assert [x.tolist() for x in runs(np.array([], dtype=np.int64))] == [[], []]


# -- bad jobs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job", "code", "match"),
    [
        (TransferJob(1, "store", [0, NUM_BLOCKS], [0, 1]), "bad_request", "gpu block id 24"),
        (TransferJob(1, "store", [0, 1], [0, CPU_BLOCKS]), "bad_request", "cpu block id 20"),
        (TransferJob(1, "load", [-1], [0]), "bad_request", "gpu block id -1 out of range"),
        (TransferJob(1, "store", [0, 1], [2]), "bad_request", "2 gpu ids but 1 cpu ids"),
        (TransferJob(1, "store", [0, 1], [2, 2]), "bad_request", "destination twice"),
        (TransferJob(1, "load", [3, 3], [1, 2]), "bad_request", "destination twice"),
        (TransferJob(1, "swap", [0], [0]), "bad_request", "direction"),
        (TransferJob(1, "store", [0], [0], deadline=time.monotonic() - 1), "timeout", "deadline"),
    ],
)
def test_bad_jobs_fail_cleanly_and_copy_nothing(instance, job, code, match):
    layout = LAYOUTS["per_layer"]()
    with ranks(instance, layout, 1) as (region, (rank,)):
        fill_random(rank.kv, seed=1)
        kv_before = [t.clone() for t in rank.kv.tensors]
        out = run(rank.engine, job)[1]
        assert not out.success and out.error_code == code
        assert match in out.error
        assert not region.numpy().any()
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(kv_before, rank.kv.tensors, strict=True))
        # the engine keeps serving
        assert run(rank.engine, TransferJob(2, "store", [1], [1]))[2].success


def test_no_kv_attached_is_unavailable(instance):
    with SharedRegion.create(instance, 4, 768) as region, TransferEngine(region, 0) as engine:
        engine.submit(TransferJob(5, "store", [0], [0]))
        (out,) = engine.poll()
        assert (out.job_id, out.success, out.error_code) == (5, False, "unavailable")
        assert engine.in_flight == 0


def test_empty_job_succeeds(instance):
    with ranks(instance, LAYOUTS["per_layer"](), 1) as (_, (rank,)):
        assert run(rank.engine, TransferJob(1, "load", [], []))[1].success


def test_deadline_checked_when_the_job_starts(instance, monkeypatch):
    """A job queued behind a slow one times out if its deadline passes meanwhile."""
    layout = LAYOUTS["per_layer"]()
    real = transfer_cpu.copy_blocks

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(transfer_cpu, "copy_blocks", slow)
    with ranks(instance, layout, 1) as (region, (rank,)):
        out = run(rank.engine, TransferJob(1, "store", [0], [0]),
                  TransferJob(2, "store", [1], [1], deadline=time.monotonic() + 0.05))
        assert out[1].success
        assert (out[2].success, out[2].error_code) == (False, "timeout")
        assert not region.numpy()[1].any()


def test_attach_checks_page_size_and_reattach_replaces(instance):
    layout = LAYOUTS["per_layer"]()
    with ranks(instance, layout, 1) as (region, (rank,)):
        other = KVLayout.per_layer(2, NUM_BLOCKS, 4, 2, 8, "float16")
        with allocate_kv_cache(instance, 1, other) as cache, open_kv_cache(
            cache.registration()
        ) as kv:
            with pytest.raises(TransferError, match="page_size 512 .* page_size 768"):
                rank.engine.attach(kv)
        fill_random(rank.kv, seed=1)
        assert run(rank.engine, TransferJob(1, "store", [2], [3]))[1].success
        first = bytes(region.page(3))
        # engine restart: a new cache and registration; the worker swaps, then closes
        with allocate_kv_cache(instance, 2, layout) as cache:
            new = open_kv_cache(cache.registration())
            fill_random(new, seed=2)
            rank.engine.attach(new)
            rank.kv.close()
            rank.kv = new
            assert run(rank.engine, TransferJob(2, "store", [2], [3]))[2].success
            assert bytes(region.page(3)) == page_of(new, 2) != first
            rank.engine.detach()
            new.close()
            rank.engine.submit(TransferJob(3, "store", [0], [0]))
            assert rank.engine.poll()[0].error_code == "unavailable"


def test_device_and_rank_checks(instance):
    with SharedRegion.create(instance, 4, 768, world_size=2) as region:
        with pytest.raises(TransferError, match="rank 2 out of range"):
            TransferEngine(region, 2)
        with pytest.raises(TransferError, match="device must be"):
            TransferEngine(region, 0, "tpu")
        cache = allocate_kv_cache(instance, 0, LAYOUTS["per_layer"](4))
        kv = open_kv_cache(cache.registration())
        with TransferEngine(region, 0, "cuda") as engine:
            with pytest.raises(TransferError, match="copies for cuda, the KV cache is on cpu"):
                engine.attach(kv)
        kv.close()
        cache.close()


def test_loads_run_before_waiting_stores_and_close_fails_queued(instance, monkeypatch):
    layout = LAYOUTS["per_layer"]()
    order: list[str] = []
    real = transfer_cpu.copy_blocks

    def tracking(src, dst, src_ids, dst_ids):
        order.append("load" if dst is rank.engine._backend._views[0] else "store")
        time.sleep(0.05)
        return real(src, dst, src_ids, dst_ids)

    monkeypatch.setattr(transfer_cpu, "copy_blocks", tracking)
    with ranks(instance, layout, 1) as (_, (rank,)):
        e = rank.engine
        e.submit(TransferJob(1, "store", [0], [0]))  # starts at once
        time.sleep(0.01)
        e.submit(TransferJob(2, "store", [1], [1]))
        e.submit(TransferJob(3, "load", [2], [0]))
        assert e.in_flight == 3
        out = {o.job_id: o for o in e.wait()}
        assert all(o.success for o in out.values())
        assert order == ["store", "load", "store"]
        for i in range(4, 8):
            e.submit(TransferJob(i, "store", [i], [i]))
        deadline = time.monotonic() + 10
        while len(order) < 4 and time.monotonic() < deadline:  # job 4 is running
            time.sleep(0.001)
        e.close()
        out = {o.job_id: o for o in e.poll()}
        assert sorted(out) == [4, 5, 6, 7]
        assert out[4].success  # it was running
        assert {o.error_code for o in out.values() if not o.success} <= {"unavailable"}
        e.submit(TransferJob(9, "store", [0], [0]))
        assert e.poll()[0].error_code == "unavailable"
        assert e.in_flight == 0


# -- random job sequences vs a model -----------------------------------------------------------

job_strategy = st.tuples(
    st.sampled_from(["store", "load"]),
    st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=0, max_size=10, unique=True),
    st.lists(st.integers(0, CPU_BLOCKS - 1), min_size=10, max_size=10, unique=True),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(LAYOUTS)), world_size=st.sampled_from([1, 2]),
       jobs=st.lists(job_strategy, min_size=1, max_size=6))
def test_random_jobs_match_a_numpy_model(kind, world_size, jobs):
    layout = LAYOUTS[kind]()
    page = layout.page_size
    instance = f"t{uuid.uuid4().hex[:12]}"
    with ranks(instance, layout, world_size) as (region, rs):
        for r, rank in enumerate(rs):
            fill_random(rank.kv, seed=r)
        kv_model = [np.frombuffer(b"".join(page_of(rank.kv, g) for g in range(NUM_BLOCKS)),
                                  np.uint8).reshape(NUM_BLOCKS, page).copy() for rank in rs]
        region_model = np.zeros((CPU_BLOCKS, world_size, page), np.uint8)
        for job_id, (direction, gpu, cpu) in enumerate(jobs):
            cpu = cpu[: len(gpu)]
            for r, rank in enumerate(rs):
                assert run(rank.engine, TransferJob(job_id, direction, gpu, cpu))[job_id].success
                if direction == "store":
                    region_model[cpu, r] = kv_model[r][gpu]
                else:
                    kv_model[r][gpu] = region_model[cpu, r]
        for r, rank in enumerate(rs):
            assert (region.numpy_pages(r) == region_model[:, r]).all()
            actual = [page_of(rank.kv, g) for g in range(NUM_BLOCKS)]
            assert actual == [kv_model[r][g].tobytes() for g in range(NUM_BLOCKS)]


# -- the engine contract: a load never overwrites what a store in flight reads ---------------


@pytest.fixture
def gated_copies(monkeypatch):
    """CPU copies wait for the gate: jobs stay in flight until the test opens it."""
    gate = threading.Event()
    real = transfer_cpu.copy_blocks

    def gated(*args, **kwargs):
        assert gate.wait(30), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(transfer_cpu, "copy_blocks", gated)
    return gate


def test_load_into_a_block_a_store_in_flight_reads_is_refused(instance, gated_copies):
    with ranks(instance, LAYOUTS["per_layer"](), 1) as (region, (rank,)):
        e = rank.engine
        fill_random(rank.kv, seed=3)
        region.numpy()[:] = 0x5A
        before = page_of(rank.kv, 3)
        e.submit(TransferJob(1, "store", [3, 4], [0, 1]))
        e.submit(TransferJob(2, "load", [9, 3], [2, 3]))  # block 3: still being read
        e.submit(TransferJob(3, "load", [7], [4]))  # unrelated: accepted
        refused = e.poll()
        assert [(o.job_id, o.success, o.error_code) for o in refused] == [
            (2, False, "bad_request")]
        assert "GPU block 3" in refused[0].error and "store in flight" in refused[0].error
        gated_copies.set()
        out = {o.job_id: o for o in e.wait()}
        assert out[1].success and out[3].success
        assert page_of(rank.kv, 3) == before  # job 2 copied nothing
        assert page_of(rank.kv, 9) != bytes(region.page(2))
        # the store finished: the engine may now load into block 3
        assert run(e, TransferJob(4, "load", [3], [2]))[4].success
        assert page_of(rank.kv, 3) == bytes(region.page(2))


def test_store_of_a_block_a_load_in_flight_writes_is_refused(instance, gated_copies):
    with ranks(instance, LAYOUTS["blocks_outer"](), 1) as (region, (rank,)):
        e = rank.engine
        e.submit(TransferJob(1, "load", [5], [0]))
        e.submit(TransferJob(2, "store", [5, 6], [1, 2]))
        e.submit(TransferJob(3, "store", [6], [3]))  # reads 6: no load writes it
        (refused,) = e.poll()
        assert (refused.job_id, refused.error_code) == (2, "bad_request")
        assert "load in flight" in refused.error
        gated_copies.set()
        assert all(o.success for o in e.wait())
        assert not region.numpy()[1:3].any()  # job 2 stored nothing
        assert run(e, TransferJob(4, "store", [5], [1]))[4].success
