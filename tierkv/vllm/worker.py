"""vLLM's worker-side `OffloadingWorker`: copies between the engine's KV cache and
the tierkv node's CPU tier, in the engine's own process.

The node's CPU tier is a POSIX shared-memory region; this worker maps it by the
node's instance name and copies with tierkv's transfer engine
(`workers.gpu.transfer`): its CUDA backend for GPU tensors (batched DMA, its own
streams), its CPU backend for CPU tensors (a copy thread). `submit_*` only queue.

Rows name one creation of the region (`TierkvLoadStoreSpec.region`). A broker
restarted on the same instance makes a new region under the same name: rows of
the old one are copied against the old mapping while this worker still holds it
(a pinned block there still has its bytes), and a store for a region that is gone
writes nothing (its commit is refused by the new broker). vLLM's worker API has no
failure path (`get_finished` results are asserted successful), so a job that
cannot be done raises from `get_finished` naming it: the engine stops rather than
compute with KV it did not get.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tierkv.core.shm import RegionError, SharedRegion
from tierkv.engine import KVLayout, OpenedKV
from tierkv.vllm.layout import check_node, pair_blocks
from tierkv.vllm.manager import TierkvLoadStoreSpec
from tierkv.wire.protocol import TransferJob, TransferOutcome
from workers.gpu.transfer import TransferEngine

log = logging.getLogger("tierkv.vllm")

REGIONS_KEPT = 2  # the current region and the one a restarted broker replaced
WAIT_TIMEOUT_S = 120.0


class TransferFailed(RuntimeError):
    """A copy could not be done; vLLM has no way to recompute around it."""


def kv_layout(kv_caches: CanonicalKVCaches, tokens_per_block: int) -> KVLayout:
    """The engine's canonical KV tensors (``(num_blocks, page bytes)`` int8 each) as
    a tierkv layout: a tierkv page is one GPU block of every tensor."""
    shapes = tuple(tuple(t.tensor.shape) for t in kv_caches.tensors)
    return KVLayout(shapes[0][0], tokens_per_block, "int8", shapes, 0)


class TierkvOffloadingWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, instance: str, rank: int,
                 world_size: int, blocks_per_chunk: int, tokens_per_block: int) -> None:
        self.instance = instance
        self.rank = rank
        self.blocks_per_chunk = blocks_per_chunk
        layout = kv_layout(kv_caches, tokens_per_block)
        self._kv = OpenedKV.local([t.tensor for t in kv_caches.tensors], layout)
        self._world_size = world_size
        self._engines: OrderedDict[str, TransferEngine] = OrderedDict()
        self._jobs: dict[int, str] = {}  # job id -> "store" / "load", while in flight
        self._done: list[TransferResult] = []
        self._failed: list[str] = []
        self._engine_for(None)  # map the region now: a node that is not there fails here

    # -- OffloadingWorker --------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, "store", src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # Loads run before waiting stores in both backends: an expedited load does
        # not queue behind stores.
        return self._submit(job_id, "load", dst_spec, src_spec)

    def get_finished(self) -> list[TransferResult]:
        self._collect()
        if self._failed:
            failures, self._failed = self._failed, []
            raise TransferFailed("; ".join(failures))
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while job_ids & self._jobs.keys():
            if time.monotonic() > deadline:
                raise TimeoutError(f"tierkv copies {sorted(job_ids & self._jobs.keys())} "
                                   f"did not finish within {WAIT_TIMEOUT_S:.0f}s")
            for engine in self._engines.values():
                if engine.in_flight:
                    self._take(engine.wait(timeout=0.05))
            self._collect()

    def shutdown(self) -> None:
        for engine in self._engines.values():
            self._take(engine.wait(timeout=WAIT_TIMEOUT_S))
            engine.close()
            engine.region.close()
        self._engines.clear()
        self._kv.close()

    # -- jobs --------------------------------------------------------------------------

    def _submit(self, job_id: int, direction: str, gpu: GPULoadStoreSpec,
                cpu: LoadStoreSpec) -> bool:
        if not isinstance(cpu, TierkvLoadStoreSpec) or cpu.rows is None:
            self._fail(job_id, direction, f"not a tierkv spec with rows: {cpu!r}")
            return True
        try:
            gpu_ids, rows, missing = pair_blocks(
                gpu.block_ids.tolist(), gpu.group_sizes, gpu.block_indices,
                cpu.rows.tolist(), cpu.chunks_per_group, self.blocks_per_chunk)
        except ValueError as e:
            self._fail(job_id, direction, str(e))
            return True
        if missing and direction == "load":
            self._fail(job_id, direction, f"{missing} blocks have no CPU row (not hits)")
            return True
        engine = self._engine_for(cpu.region) if rows else None
        if engine is None:
            if rows and direction == "load":
                self._fail(job_id, direction, f"the CPU region {cpu.region} is gone (the "
                           f"node's broker restarted)")
            else:  # nothing to write, or a store into a region that is gone
                self._done.append(TransferResult(job_id, True, 0, 0.0))
            return True
        self._jobs[job_id] = direction
        engine.submit(TransferJob(job_id, direction, gpu_ids, rows))
        return True

    def _collect(self) -> None:
        for engine in self._engines.values():
            if engine.in_flight:
                self._take(engine.poll())

    def _take(self, outcomes: list[TransferOutcome]) -> None:
        for outcome in outcomes:
            direction = self._jobs.pop(outcome.job_id, "?")
            if outcome.success:
                self._done.append(TransferResult(outcome.job_id, True, outcome.bytes_moved,
                                                 outcome.seconds))
            else:
                self._fail(outcome.job_id, direction,
                           f"[{outcome.error_code}] {outcome.error}")

    def _fail(self, job_id: int, direction: str, why: str) -> None:
        log.error("tierkv %s job %d failed: %s", direction, job_id, why)
        self._failed.append(f"tierkv {direction} job {job_id} failed: {why}")

    # -- regions -----------------------------------------------------------------------

    def _engine_for(self, generation: str | None) -> TransferEngine | None:
        """The copy engine of region `generation` (None: whichever is current), mapping
        the instance's region again if it is new; None if that region is gone."""
        if generation is not None and generation in self._engines:
            return self._engines[generation]
        try:
            region = SharedRegion.attach(self.instance)
        except RegionError as e:
            if generation is None:
                raise RegionError(f"tierkv: {e}") from e
            return None
        current = region.generation
        if current in self._engines or (generation is not None and current != generation):
            region.close()
            return self._engines.get(current) if generation in (None, current) else None
        try:
            check_node(region.layout.page_size, region.layout.world_size,
                       self._kv.layout.page_size, self._world_size, self.instance)
            engine = TransferEngine(region, self.rank, "auto")
            engine.attach(self._kv)
        except Exception:
            region.close()
            raise
        self._engines[current] = engine
        while len(self._engines) > REGIONS_KEPT:
            _, old = self._engines.popitem(last=False)
            self._take(old.wait(timeout=WAIT_TIMEOUT_S))
            old.close()
            old.region.close()
        log.info("rank %d copies with %s's CPU tier (region %s, %s backend)", self.rank,
                 self.instance, current, self._kv.device.type)
        return engine

