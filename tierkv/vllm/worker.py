"""vLLM's worker-side `OffloadingWorker`: copies between the engine's KV cache and
the tierkv node's CPU tier, in the engine's own process.

The node's CPU tier is a POSIX shared-memory region; this worker maps it by the
node's instance name and copies with tierkv's transfer engine
(`workers.gpu.transfer`): its CUDA backend for GPU tensors (batched DMA on its own
streams, ordered after the model's work on the calling thread's current stream),
its CPU backend for CPU tensors (a copy thread).

A row holds a chunk: block j of it on rank r is page ``r * blocks_per_chunk + j``
(`layout.py`), so this worker has a copy engine per page it copies (one when a
chunk is one GPU block).

Ordering after the model: a CUDA copy waits for the work queued on the submitting
thread's current stream. CPU KV tensors have no stream; an engine whose model
writes them on a thread of its own hands `order_after` a `HostOrder` (asked when a
batch is handed to the copy engines, on that thread), whose fence every copy waits
for. vLLM's CPU model runner computes on the submitting thread and needs none.

`submit_*` only queue. vLLM submits a step's transfers job by job (hundreds in a
busy step); they are handed to the copy engines as one job per direction, region
and page when vLLM next asks what finished or waits (`_launch`), on the same
thread, so one step's copies are a few batches, not hundreds of small launches.

Rows name one creation of the region (`TierkvLoadStoreSpec.region`). A broker
restarted on the same instance makes a new region under the same name: rows of
the old one are copied against the old mapping while this worker still holds it
(a pinned block there still has its bytes), and a store for a region that is gone
writes nothing (its commit is refused by the new broker).

A copy that fails: vLLM's offloading worker asserts every copy succeeded, so under
`TierkvConnector` (`report_failures`) a failed job is reported done and handed to
the connector (`take_failures`), which has vLLM recompute a failed load and abort a
failed store. Without it, a failed job raises from `get_finished`, naming it: the
engine stops rather than compute with KV it did not get.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tierkv.core.shm import RegionError, SharedRegion
from tierkv.engine import KVLayout, OpenedKV
from tierkv.vllm.jobs import TierkvLoadStoreSpec
from tierkv.vllm.layout import check_node, pair_blocks
from tierkv.wire.protocol import TransferJob, TransferOutcome
from workers.gpu.jobs import TransferError
from workers.gpu.streams import HostOrder
from workers.gpu.transfer import TransferEngine

log = logging.getLogger("tierkv.vllm")

REGIONS_KEPT = 2  # the current region and the one a restarted broker replaced
WAIT_TIMEOUT_S = 120.0


class TransferFailed(RuntimeError):
    """A copy could not be done, and no connector takes failures."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A vLLM job that could not be copied: its direction, the GPU blocks it named,
    and why."""

    job_id: int
    direction: str
    gpu_block_ids: tuple[int, ...]
    why: str


@dataclass(slots=True)
class _Job:
    """One vLLM job, its copies sorted by the page of the row they touch."""

    job_id: int
    direction: str
    region: str
    gpu_ids: list[int]  # every GPU block it names (what a failure reports)
    by_page: dict[int, tuple[list[int], list[int]]]  # page -> (GPU ids, rows)


def kv_layout(kv_caches: CanonicalKVCaches, tokens_per_block: int) -> KVLayout:
    """The engine's canonical KV tensors (``(num_blocks, page bytes)`` int8 each) as
    a tierkv layout: a tierkv page is one GPU block of every tensor."""
    shapes = tuple(tuple(t.tensor.shape) for t in kv_caches.tensors)
    return KVLayout(shapes[0][0], tokens_per_block, "int8", shapes, 0)


class TierkvOffloadingWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, instance: str, rank: int,
                 world_size: int, blocks_per_chunk: int, tokens_per_block: int,
                 allow_unpinned: bool = False) -> None:
        self.instance = instance
        self.allow_unpinned = allow_unpinned
        self.rank = rank  # 0 if every rank holds the same bytes (replicated)
        self.blocks_per_chunk = blocks_per_chunk
        layout = kv_layout(kv_caches, tokens_per_block)
        self._kv = OpenedKV.local([t.tensor for t in kv_caches.tensors], layout)
        self._world_size = world_size
        # Per region: a copy engine per page of a chunk this worker copies.
        self._engines: OrderedDict[str, list[TransferEngine]] = OrderedDict()
        self._pending: list[_Job] = []
        self._batches: dict[int, tuple[int, list[_Job]]] = {}  # engine job -> its page and
        # the vLLM jobs in it
        self._parts: dict[int, int] = {}  # vLLM job -> its engine jobs not yet done
        self._moved: dict[int, tuple[int, float]] = {}  # vLLM job -> its bytes, seconds
        self._failed_jobs: set[int] = set()
        self._batch_ids = itertools.count(1)
        self._done: list[TransferResult] = []
        self._failures: list[Failure] = []
        self._reported: list[int] = []  # vLLM jobs reported done, for the connector
        self._report = False  # a connector takes failures (`report_failures`)
        self._order: HostOrder | None = None  # CPU copies wait for its fence
        self._engine_for(None)  # map the region now: a node that is not there fails here

    # -- OffloadingWorker --------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, "store", src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # Both backends run waiting loads before waiting stores, so an expedited load
        # does not queue behind stores.
        return self._submit(job_id, "load", dst_spec, src_spec)

    def get_finished(self) -> list[TransferResult]:
        self._launch()
        self._collect()
        if self._failures and not self._report:
            failures, self._failures = self._failures, []
            raise TransferFailed("; ".join(f"tierkv {f.direction} job {f.job_id} failed: "
                                           f"{f.why}" for f in failures))
        done, self._done = self._done, []
        if self._report:
            self._reported.extend(r.job_id for r in done)
        return done

    def wait(self, job_ids: set[int]) -> None:
        self._launch()
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while job_ids & self.in_flight():
            if time.monotonic() > deadline:
                raise TimeoutError(f"tierkv copies {sorted(job_ids & self.in_flight())} "
                                   f"did not finish within {WAIT_TIMEOUT_S:.0f}s")
            for engine in self._all_engines():
                if engine.in_flight:
                    self._take(engine.wait(timeout=0.05))

    def shutdown(self) -> None:
        self._launch()
        for engines in self._engines.values():
            self._close(engines)
        self._engines.clear()
        self._kv.close()

    def order_after(self, order: HostOrder | None) -> None:
        """Order every CPU copy handed to the copy engines from now on after the
        fence `order` returns at that moment (None: after nothing): the CPU analogue
        of the CUDA path's wait for the current stream, for a model that writes the
        KV cache on another thread than the one that submits transfers."""
        self._order = order
        for engine in self._all_engines():
            engine.order = order

    def in_flight(self) -> set[int]:
        """vLLM jobs handed to the copy engines and not yet finished."""
        return set(self._parts)

    # -- failures (TierkvConnector) ----------------------------------------------------

    def report_failures(self) -> None:
        """From now on a failed job is reported done to vLLM and kept for
        `take_failures` (the connector turns it into vLLM's failure path)."""
        self._report = True

    def take_failures(self) -> list[Failure]:
        failures, self._failures = self._failures, []
        return failures

    def take_reported(self) -> list[int]:
        """vLLM jobs reported done since the last call (the connector forgets them)."""
        reported, self._reported = self._reported, []
        return reported

    # -- jobs --------------------------------------------------------------------------

    def _submit(self, job_id: int, direction: str, gpu: GPULoadStoreSpec,
                cpu: LoadStoreSpec) -> bool:
        gpu_ids_all = gpu.block_ids.tolist()
        if not isinstance(cpu, TierkvLoadStoreSpec):
            self._fail(job_id, direction, gpu_ids_all, f"not a tierkv spec: {cpu!r}")
            return True
        try:
            pairs = pair_blocks(gpu_ids_all, gpu.group_sizes, gpu.block_indices,
                                cpu.rows.tolist(), cpu.chunks_per_group, self.blocks_per_chunk)
        except ValueError as e:
            self._fail(job_id, direction, gpu_ids_all, str(e))
            return True
        if pairs.missing and direction == "load":
            self._fail(job_id, direction, gpu_ids_all,
                       f"{pairs.missing} blocks have no CPU row (not hits)")
            return True
        if not pairs.gpu:  # nothing to write (present already) or to read
            self._done.append(TransferResult(job_id, True, 0, 0.0))
            return True
        by_page: dict[int, tuple[list[int], list[int]]] = {}
        for g, row, page in zip(pairs.gpu, pairs.rows, pairs.page, strict=True):
            ids, rows = by_page.setdefault(page, ([], []))
            ids.append(g)
            rows.append(row)
        self._pending.append(_Job(job_id, direction, cpu.region, gpu_ids_all, by_page))
        return True

    def _launch(self) -> None:
        """Hand every queued vLLM job to the copy engines, one engine job per
        direction, region and page (a region that is gone: a load fails, a store
        writes nothing)."""
        pending, self._pending = self._pending, []
        batches: dict[tuple[str, str, int], list[_Job]] = {}
        for job in pending:
            engines = self._engine_for(job.region)
            if engines is None:
                if job.direction == "load":
                    self._fail(job.job_id, job.direction, job.gpu_ids, f"the CPU region "
                               f"{job.region} is gone (the node's broker restarted)")
                else:
                    self._done.append(TransferResult(job.job_id, True, 0, 0.0))
                continue
            self._parts[job.job_id] = len(job.by_page)
            for page in job.by_page:
                batches.setdefault((job.direction, job.region, page), []).append(job)
        for (direction, region, page), jobs in batches.items():
            engines = self._engine_for(region)
            assert engines is not None
            batch_id = next(self._batch_ids)
            self._batches[batch_id] = (page, jobs)
            engines[page].submit(TransferJob(
                batch_id, direction, [g for j in jobs for g in j.by_page[page][0]],
                [r for j in jobs for r in j.by_page[page][1]]))

    def _all_engines(self) -> list[TransferEngine]:
        return [e for engines in self._engines.values() for e in engines]

    def _collect(self) -> None:
        for engine in self._all_engines():
            if engine.in_flight:
                self._take(engine.poll())

    def _take(self, outcomes: list[TransferOutcome]) -> None:
        """Outcomes of engine jobs; a vLLM job is done when all its pages are, and
        failed if any of them failed."""
        for outcome in outcomes:
            page, jobs = self._batches.pop(outcome.job_id, (0, []))
            total = sum(len(j.by_page[page][0]) for j in jobs) or 1
            for job in jobs:
                share = len(job.by_page[page][0]) / total
                moved, seconds = self._moved.get(job.job_id, (0, 0.0))
                self._moved[job.job_id] = (moved + int(outcome.bytes_moved * share),
                                           seconds + outcome.seconds * share)
                if not outcome.success and job.job_id not in self._failed_jobs:
                    self._failed_jobs.add(job.job_id)
                    self._fail(job.job_id, job.direction, job.gpu_ids,
                               f"[{outcome.error_code}] {outcome.error}", report=False)
                left = self._parts[job.job_id] - 1
                if left:
                    self._parts[job.job_id] = left
                    continue
                del self._parts[job.job_id]
                moved, seconds = self._moved.pop(job.job_id)
                if job.job_id in self._failed_jobs:
                    self._failed_jobs.discard(job.job_id)
                    if self._report:
                        self._done.append(TransferResult(job.job_id, True, 0, 0.0))
                else:
                    self._done.append(TransferResult(job.job_id, True, moved, seconds))

    def _fail(self, job_id: int, direction: str, gpu_ids: list[int], why: str,
              report: bool = True) -> None:
        """A failed job: kept for the connector (and reported done to vLLM, which
        asserts success, once all of it ended: `report`), or raised by `get_finished`."""
        log.error("tierkv %s job %d failed: %s", direction, job_id, why)
        self._failures.append(Failure(job_id, direction, tuple(gpu_ids), why))
        if self._report and report:
            self._done.append(TransferResult(job_id, True, 0, 0.0))

    # -- regions -----------------------------------------------------------------------

    def _engine_for(self, generation: str | None) -> list[TransferEngine] | None:
        """The copy engines of region `generation` (None: whichever is current),
        mapping the instance's region again if it is new; None if that region is gone."""
        if generation is not None and generation in self._engines:
            return self._engines[generation]
        try:
            region = SharedRegion.attach(self.instance, populate=True)
        except RegionError as e:
            if generation is None:
                raise RegionError(f"tierkv: {e}") from e
            return None
        current = region.generation
        if current in self._engines or (generation is not None and current != generation):
            region.close()
            return self._engines.get(current) if generation in (None, current) else None
        engines: list[TransferEngine] = []
        try:
            check_node(region.layout.page_size, region.layout.world_size,
                       self._kv.layout.page_size, self._world_size, self.instance)
            for page in range(self.blocks_per_chunk):
                engine = TransferEngine(region, self.rank * self.blocks_per_chunk + page,
                                        "auto", allow_unpinned=self.allow_unpinned,
                                        order=self._order)
                engines.append(engine)
                engine.attach(self._kv)
        except TransferError as e:
            self._close(engines, region)
            raise TransferError(f"tierkv in vLLM's worker (rank {self.rank}): {e}. Inside "
                                "vLLM: start vLLM with a locked-memory limit that covers the "
                                "CPU tier (ulimit -l unlimited; docker run --ulimit "
                                "memlock=-1), or set \"allow_unpinned\": true in "
                                "kv_connector_extra_config") from e
        except Exception:
            self._close(engines, region)
            raise
        self._engines[current] = engines
        while len(self._engines) > REGIONS_KEPT:
            _, old = self._engines.popitem(last=False)
            self._close(old)
        log.info("rank %d copies with %s's CPU tier (region %s, %s backend)", self.rank,
                 self.instance, current, self._kv.kind)
        return engines

    def _close(self, engines: list[TransferEngine], region: SharedRegion | None = None) -> None:
        """Wait for their copies, then close the engines and their region."""
        for engine in engines:
            self._take(engine.wait(timeout=WAIT_TIMEOUT_S))
            engine.close()
            region = engine.region
        if region is not None:
            region.close()
