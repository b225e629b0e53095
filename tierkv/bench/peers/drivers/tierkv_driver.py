"""tierkv's side of every comparison, in its own process like each peer's.

    python -m tierkv.bench.peers.drivers.tierkv_driver

Runs in tierkv's environment and speaks the drivers' protocol (`common`), so the
parent treats tierkv and the peers alike: same keys, same bytes, same requests,
a fresh process each. Everything goes through tierkv's public pieces as they
are shipped, so a change to them is measured without touching this file:

* Disk: `DiskBackend` behind a `JobRunner` of 8 I/O threads (the tier process's
  data path, as `tierkv/bench/disk_io.py` runs it: a job's keys in runs of adjacent
  slots, through the backend's staging buffers) over rows of a real shared-memory
  region; durable as shipped (one flush per job), or `durable=False`.
* Manager: `TieringManager` over `PrimaryTier` in process, and a real node
  (broker + CPU worker, `tierkv.bench.broker_ops.bench_node`, as `tierkv bench
  control` starts one) through
  `Client.batch()`, one round trip for the lookups of an engine step and one for
  its loads, stores and finishes.
* CPU tier: `tierkv.bench.broker_ops.data_path` through broker + CPU worker.
* Policies: `tierkv.bench.replay.replay`, the real `PrimaryTier` with a policy from the
  registry (`tierkv.core.policies.known_policies()`).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import numpy as np

from tierkv.bench.peers.drivers.common import (
    MODES,
    StoreDriver,
    Unsupported,
    base_block,
    corrupt,
    count_bad,
    fill_blocks,
    key_bytes,
    manager_requests,
    outcome,
    serve,
)
from tierkv.core.shm import SharedRegion
from tierkv.tiers.base import Job, JobKind
from tierkv.tiers.runner import JobRunner
from workers.disk import DiskBackend, slot_bytes_for

THREADS = 8  # the disk tier's default I/O threads
BATCH = 32  # keys per job
JOB_TIMEOUT_S = 600.0
REQUESTS_PER_STEP = 16  # requests per engine step in the manager replay
BROKER_PAGE = 4096  # the broker's cost does not depend on the page: keep shm small
KV_BLOCKS = 1024  # GPU blocks of the bench engine's (CPU) KV cache


def budget(block_bytes: int, capacity_blocks: int) -> int:
    """The bound every system is given: `capacity_blocks` blocks' bytes. tierkv's
    slots hold a 4 KiB header too, so it keeps a few fewer blocks in the same bytes."""
    return max(capacity_blocks * block_bytes, slot_bytes_for(block_bytes))


class DiskTier:
    """The disk tier as its process runs it, over `rows` rows of shared memory."""

    def __init__(self, directory: str, block_bytes: int, capacity_blocks: int, rows: int,
                 durable: bool) -> None:
        self.directory, self.block_bytes = directory, block_bytes
        self.region = SharedRegion.create(f"peers{uuid.uuid4().hex[:8]}", num_blocks=rows,
                                          page_size=block_bytes)
        try:
            self.rows: Any = self.region.numpy()
            self.rows[:] = 0  # fault the pages in before anything is timed
            self.backend = DiskBackend(directory, budget(block_bytes, capacity_blocks),
                                       block_bytes=block_bytes, namespace="bench",
                                       durable=durable)
            self.runner = JobRunner(self.backend, self.region, threads=THREADS)
        except BaseException:
            self._drop_region()
            raise
        self.job_ids = iter(range(1, 1 << 62))

    def run(self, keys: list[bytes], kind: JobKind) -> bool:
        for j in range(0, len(keys), BATCH):
            rows = tuple(range(j, min(len(keys), j + BATCH)))
            self.runner.submit(Job(next(self.job_ids), tuple(keys[j:j + BATCH]), rows, kind))
        if not self.runner.drain(JOB_TIMEOUT_S):
            raise TimeoutError(f"tierkv disk tier jobs did not finish in {JOB_TIMEOUT_S:.0f} s")
        return all(r.success for r in self.runner.take_finished())

    def record(self, key: bytes) -> tuple[str, int, int]:
        slabs = self.backend._require()
        n, offset = slabs.locate(self.backend._index[key].slot)
        return str(slabs.path(n)), offset, offset + slabs.slot_bytes

    def close(self) -> None:
        self.runner.close()
        self.runner.rows = None
        self.backend.close()
        self._drop_region()

    def _drop_region(self) -> None:
        self.rows = None  # no view may outlive the region
        self.region.close()
        self.region.unlink()


class Driver(StoreDriver[DiskTier]):
    def disk_open(self, system: str, dir: str, block_bytes: int, capacity_blocks: int,
                  pool_blocks: int, durable: bool = True) -> dict[str, Any]:
        if system != "disk":
            raise Unsupported(f"tierkv has no disk system {system!r}")
        disk = self._open(DiskTier(dir, block_bytes, capacity_blocks, pool_blocks, durable))
        backend = disk.backend
        return {"settings": f"disk tier, {THREADS} threads, runs of {backend.run_bytes >> 20} MiB, "
                            f"staging={backend.staging}, durable={durable}",
                "o_direct": backend.direct}

    def disk_store(self, tag: str, count: int, seed: int, first: int = 0,
                   sync: bool = False) -> dict[str, Any]:
        """`sync` is the backend's own (`durable`, fixed at disk_open)."""
        disk = self._need()
        fill_blocks(disk.rows[:count, :disk.block_bytes], base_block(disk.block_bytes, seed),
                    first)
        keys = [key_bytes(tag, i) for i in range(first, first + count)]
        t0 = time.perf_counter()
        if not disk.run(keys, JobKind.STORE):
            raise RuntimeError("a tierkv disk store job failed")
        return {"seconds": time.perf_counter() - t0,
                "fdatasyncs": disk.backend.commit.syncs}

    def disk_load(self, tag: str, count: int, seed: int, first: int = 0) -> dict[str, Any]:
        disk = self._need()
        disk.rows[:count] = 0
        keys = [key_bytes(tag, i) for i in range(first, first + count)]
        t0 = time.perf_counter()
        ok = disk.run(keys, JobKind.PROMOTION)
        took = time.perf_counter() - t0
        bad = count_bad(disk.rows[:count, :disk.block_bytes],
                        base_block(disk.block_bytes, seed), first)
        return {"seconds": took, "missing": 0 if ok else -1, "bad": bad}

    def disk_recover(self, system: str, dir: str, block_bytes: int, capacity_blocks: int,
                     tag: str, count: int) -> dict[str, Any]:
        """A new process over the directory: the tier scans its slots at start."""
        t0 = time.perf_counter()
        backend = DiskBackend(dir, budget(block_bytes, capacity_blocks),
                              block_bytes=block_bytes, namespace="bench")
        try:
            found = sum(backend.exists(key_bytes(tag, i)) for i in range(count))
            return {"found": found, "seconds": time.perf_counter() - t0}
        finally:
            backend.close()

    def integrity(self, system: str, dir: str, block_bytes: int) -> dict[str, Any]:
        out = {}
        for mode in MODES:
            sub = os.path.join(dir, mode)
            os.makedirs(sub)
            self.disk_open(system, sub, block_bytes, 16, 2)
            disk = self._need()
            self.disk_store(mode, 2, seed=7)
            keys = [key_bytes(mode, 0), key_bytes(mode, 1)]
            did = corrupt(mode, disk.record(keys[0]), disk.record(keys[1]))
            disk.rows[:] = 0
            try:
                ok = disk.run(keys[:1], JobKind.PROMOTION)
                bad = count_bad(disk.rows[:1, :block_bytes], base_block(block_bytes, 7))
                out[mode] = {"outcome": outcome(ok, bad == 0), "did": did,
                             "still_indexed": disk.backend.exists(keys[0])}
            except Exception as e:  # noqa: BLE001 - the row records it
                out[mode] = {"outcome": outcome(None, False, type(e).__name__), "did": did}
            self.disk_close()
        return out

    def manager_rps(self, policy: str, capacity: int, n_requests: int, keys_per_request: int,
                    seed: int, repeats: int, mode: str = "inprocess") -> dict[str, Any]:
        requests = manager_requests(n_requests, keys_per_request, seed)
        if mode == "inprocess":
            run = _inprocess
        elif mode == "broker":
            run = _through_broker
        else:
            raise ValueError(f"unknown manager mode {mode!r}")
        seconds, hits = [], 0
        for _ in range(repeats):
            took, hits = run(requests, capacity, policy)
            seconds.append(took)
        return {"seconds": seconds, "hits": hits, "keys": sum(len(k) for k in requests)}

    def hit_ratio(self, trace: str, capacity: int, policy: str) -> dict[str, Any]:
        from tierkv.bench.replay import replay
        from tierkv.workloads.traces import read_trace

        result = replay(read_trace(trace), capacity, policy)
        return {"hits": result.hit_blocks, "total": result.total_blocks,
                "hit_ratio": result.hit_ratio}

    def cpu_tier(self, block_bytes: int, count: int, repeats: int, seed: int) -> dict[str, Any]:
        from tierkv.bench.broker_ops import bench_node, data_path

        with bench_node(count, block_bytes) as (client, kv):
            runs = data_path(client, kv, count, block_bytes, repeats)
        return {"store_s": runs["store"], "load_s": runs["load"], "bad": 0}

    def policies(self) -> dict[str, Any]:
        from tierkv.core.policies import known_policies
        from tierkv.node.config import CpuConfig

        return {"known": known_policies(), "default": CpuConfig().policy}


def _inprocess(requests: list[list[bytes]], capacity: int, policy: str) -> tuple[float, int]:
    """Engine steps of REQUESTS_PER_STEP requests on the in-process manager, in
    the order the vLLM replay uses: lookups and load preparation as each request
    is scheduled, then its stores, load completions and finish, then the step."""
    from tierkv.core.primary import PrimaryTier
    from tierkv.core.tiering import TieringManager

    manager = TieringManager(PrimaryTier(capacity, policy, enable_events=False))
    hits = 0
    t0 = time.perf_counter()
    for s in range(0, len(requests), REQUESTS_PER_STEP):
        scheduled = []
        for r, keys in enumerate(requests[s:s + REQUESTS_PER_STEP], s):
            req = f"r{r}"
            n = manager.lookup(keys, req).hits
            if n:
                manager.prepare_load(keys[:n], req)
            scheduled.append((req, keys, n))
            hits += n
        for req, keys, n in scheduled:
            out = manager.prepare_store(keys[n:], req)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store)
            if n:
                manager.complete_load(keys[:n])
            manager.finish(req)
        manager.step()
    return time.perf_counter() - t0, hits


def _through_broker(requests: list[list[bytes]], capacity: int,
                    policy: str) -> tuple[float, int]:
    """Engine steps of REQUESTS_PER_STEP requests: one round trip with their
    lookups, one with their loads, then their stores and finishes (the order of
    the in-process and vLLM replays). The step's jobs are waited for before the
    next step's lookups, as those replays complete their stores at once: the
    same requests then find the same hits, whatever the worker's speed."""
    from tierkv.bench.broker_ops import bench_node

    with bench_node(capacity, BROKER_PAGE, KV_BLOCKS, policy) as (client, _kv):
        hits = 0
        t0 = time.perf_counter()
        for s in range(0, len(requests), REQUESTS_PER_STEP):
            step = list(enumerate(requests[s:s + REQUESTS_PER_STEP], s))
            batch = client.batch()
            for r, keys in step:
                batch.lookup(keys, f"r{r}")
            *found, ended = batch.step().send()
            finished = {result.job_id for result in ended.finished}
            batch = client.batch()
            counts = [lookup.hits for lookup in found]
            hits += sum(counts)
            for (r, keys), n in zip(step, counts, strict=True):  # loads first: as scheduled
                if n:
                    batch.load(keys[:n], list(range(n)), f"r{r}")
            for (r, keys), n in zip(step, counts, strict=True):
                batch.store(keys[n:], [i % KV_BLOCKS for i in range(n, len(keys))], f"r{r}")
                batch.finish(f"r{r}")
            *sent, ended = batch.step().send()
            finished.update(result.job_id for result in ended.finished)
            jobs = {j for j in (getattr(x, "job_id", None) for x in sent) if isinstance(j, int)}
            client.wait(sorted(jobs - finished), timeout=JOB_TIMEOUT_S)
        return time.perf_counter() - t0, hits


def main() -> int:
    import tierkv

    driver = Driver()
    ops = {name: getattr(driver, name) for name in (
        "disk_open", "disk_close", "disk_store", "disk_load", "disk_recover", "integrity",
        "cpu_tier", "hit_ratio", "manager_rps", "policies")}
    try:
        return serve("tierkv", {"tierkv": getattr(tierkv, "__version__", "?"),
                                "numpy": np.__version__}, ops)
    finally:
        driver.disk_close()


if __name__ == "__main__":
    raise SystemExit(main())
