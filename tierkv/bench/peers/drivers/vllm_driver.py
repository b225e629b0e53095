"""vLLM 0.33's offloading managers, driven as its scheduler drives them, in their
own process.

    <peers' venv>/bin/python -m tierkv.bench.peers.drivers.vllm_driver

Runs in the peers' environment (never in tierkv's), with vLLM installed without
its dependencies (see `tierkv.bench.peers.env`).

* Manager: `CPUOffloadingManager(num_chunks, cache_policy)` with its built-in
  `lru` or `arc`. Per request, as `OffloadingConnectorScheduler` does:
  `on_new_request`, one `lookup(key)` per key up to the first miss (its
  `_maximal_prefix_lookup`), `prepare_load`/`complete_load` of the hits,
  `prepare_store`/`complete_store` of the rest, `on_request_finished`; and
  `on_schedule_end` once per engine step.
* Disk: the tiering manager's `fs` tier, `FileSystemTierManager`, over a primary
  view of CPU rows, with its defaults (16 read and 16 write threads, O_DIRECT when
  the filesystem allows it, a file per block written to a temporary name and
  renamed, no fsync, no size bound; the synced variant `fdatasync`s every file
  from 16 threads, as many as it writes with). Jobs are submitted as the tiering manager
  submits them (`submit_store`/`submit_load` of `TransferJob`s) and finished when
  `get_finished_jobs` reports them. Its C I/O extension (`vllm.fs_io_C`) links
  against CUDA libraries and does not load on a CPU-only machine; the tier then
  uses its pure-Python path, as vLLM does there.

The `fs` tier is given an `OffloadingSpec`-shaped namespace with the few fields
it reads (model name, dtype, parallel sizes, block geometry): building a real
spec needs a whole `VllmConfig` and a model.
"""

from __future__ import annotations

import mmap
import os
import time
import types
from typing import Any

import numpy as np

from tierkv.bench.peers.drivers.common import (
    MODES,
    StoreDriver,
    Unsupported,
    base_block,
    block_intact,
    corrupt,
    count_bad,
    fill_blocks,
    key_bytes,
    manager_requests,
    outcome,
    read_trace,
    serve,
    sync_files,
    wait_until,
)

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from vllm.v1.kv_offload.base import (  # noqa: E402 - after the telemetry switches
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: E402

BATCH = 32  # blocks per job, as tierkv's bench jobs
WRITE_THREADS = 16  # the fs tier's default n_write_threads: the synced variant flushes with as many
JOB_TIMEOUT_S = 600.0
REQUESTS_PER_STEP = 16  # requests scheduled per engine step in the manager replay


def _spec() -> Any:
    """The fields of an OffloadingSpec that the fs tier reads."""
    parallel = types.SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                                     is_parallelism_agnostic=True)
    config = types.SimpleNamespace(
        groups=[types.SimpleNamespace(tokens_per_block=16, layer_names=["layers"])],
        parallel=parallel, cache=types.SimpleNamespace(tokens_per_hash=16),
        model=types.SimpleNamespace(name="bench", dtype="float16"),
        canonical_layout=False, replicated_layout=False, kv_cache_layout=None)
    return types.SimpleNamespace(config=config, blocks_per_chunk=1, kv_events_config=None)


def offload_key(tag: str, i: int) -> Any:
    return make_offload_key(key_bytes(tag, i), 0)


class FsTier:
    """One FileSystemTierManager over a directory, with `rows` CPU rows."""

    def __init__(self, directory: str, block_bytes: int, rows: int) -> None:
        self.directory, self.block_bytes = directory, block_bytes
        self.buffer = mmap.mmap(-1, rows * block_bytes)
        self.rows = np.frombuffer(self.buffer, dtype=np.uint8).reshape(rows, block_bytes)
        self.rows[:] = 0  # fault the pages in before anything is timed
        self._base = memoryview(self.buffer)
        self.view = self._base.cast("B", (rows, block_bytes))
        self.tier = FileSystemTierManager(_spec(), self.view, "fs", directory)
        self.context = ReqContext("bench")
        self.job_ids = iter(range(1, 1 << 62))

    def run(self, keys: list[Any], promotion: bool) -> bool:
        """Submit jobs of BATCH keys (row r holds keys[r]); wait for them all."""
        pending = set()
        for j in range(0, len(keys), BATCH):
            job = TransferJob(next(self.job_ids), keys[j:j + BATCH],
                              np.arange(j, min(len(keys), j + BATCH)), promotion, self.context)
            pending.add(job.job_id)
            (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        ok = True

        def finished() -> bool:
            nonlocal ok
            for result in self.tier.get_finished_jobs():
                pending.discard(result.job_id)
                ok &= bool(result.success)
            return not pending

        wait_until(finished, JOB_TIMEOUT_S, "vLLM fs tier jobs")
        return ok

    def lookup_all(self, keys: list[Any]) -> list[LookupResult]:
        """Ask until no key is RETRY: the tier checks files asynchronously, and the
        scheduler asks again after each step's end flushes the checks."""
        def ask() -> list[LookupResult]:
            return [self.tier.lookup(k, self.context) for k in keys]

        answers = ask()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while LookupResult.RETRY in answers:
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM fs tier lookups stayed RETRY")
            self.tier.on_schedule_end(ScheduleEndContext((), ()))
            time.sleep(0.001)
            answers = ask()
        return answers

    def record(self, key: Any) -> tuple[str, int, int]:
        path = self.tier.file_mapper.get_file_name(key)
        return path, 0, os.path.getsize(path)

    def close(self) -> None:
        """Stop the tier's threads, then unmap the rows (no view may outlive them)."""
        self.tier.shutdown()
        del self.tier, self.rows
        self.view.release()
        self._base.release()
        self.buffer.close()


class Driver(StoreDriver[FsTier]):
    def disk_open(self, system: str, dir: str, block_bytes: int, capacity_blocks: int,
                  pool_blocks: int, durable: bool = True) -> dict[str, Any]:
        """`durable` is tierkv's option; this peer never syncs (the synced variant
        adds `sync_files` to `disk_store`). The fs tier has no size bound."""
        if system != "fs":
            raise Unsupported(f"vLLM has no disk system {system!r}")
        fs = self._open(FsTier(dir, block_bytes, pool_blocks))
        return {"settings": "fs tier defaults (no size bound: capacity not enforced)",
                "o_direct": fs.tier._use_o_direct}

    def disk_store(self, tag: str, count: int, seed: int, first: int = 0,
                   sync: bool = False) -> dict[str, Any]:
        fs = self._need()
        fill_blocks(fs.rows[:count], base_block(fs.block_bytes, seed), first)
        keys = [offload_key(tag, i) for i in range(first, first + count)]
        t0 = time.perf_counter()
        if not fs.run(keys, promotion=False):
            raise RuntimeError("a vLLM fs store job failed")
        if sync:
            sync_files(fs.directory, WRITE_THREADS)
        return {"seconds": time.perf_counter() - t0}

    def disk_load(self, tag: str, count: int, seed: int, first: int = 0) -> dict[str, Any]:
        fs = self._need()
        fs.rows[:count] = 0
        keys = [offload_key(tag, i) for i in range(first, first + count)]
        t0 = time.perf_counter()
        ok = fs.run(keys, promotion=True)
        took = time.perf_counter() - t0
        bad = count_bad(fs.rows[:count], base_block(fs.block_bytes, seed), first)
        return {"seconds": took, "missing": 0 if ok else -1, "bad": bad}

    def disk_recover(self, system: str, dir: str, block_bytes: int, capacity_blocks: int,
                     tag: str, count: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.disk_open(system, dir, block_bytes, capacity_blocks, 1)
        answers = self._need().lookup_all([offload_key(tag, i) for i in range(count)])
        took = time.perf_counter() - t0
        self.disk_close()
        return {"found": sum(a is LookupResult.HIT for a in answers), "seconds": took}

    def integrity(self, system: str, dir: str, block_bytes: int) -> dict[str, Any]:
        out = {}
        for mode in MODES:
            sub = os.path.join(dir, mode)
            os.makedirs(sub)
            self.disk_open(system, sub, block_bytes, 16, 2)
            fs = self._need()
            self.disk_store(mode, 2, seed=7)
            keys = [offload_key(mode, 0), offload_key(mode, 1)]
            did = corrupt(mode, fs.record(keys[0]), fs.record(keys[1]))
            fs.rows[:] = 0
            try:
                ok = fs.run(keys[:1], promotion=True)
                intact = block_intact(fs.rows[0], base_block(block_bytes, 7), 0)
                out[mode] = {"outcome": outcome(ok, intact), "did": did}
            except Exception as e:  # noqa: BLE001 - the row records it
                out[mode] = {"outcome": outcome(None, False, type(e).__name__), "did": did}
            self.disk_close()
        return out

    def manager_rps(self, policy: str, capacity: int, n_requests: int, keys_per_request: int,
                    seed: int, repeats: int) -> dict[str, Any]:
        requests = [[make_offload_key(k, 0) for k in keys]
                    for keys in manager_requests(n_requests, keys_per_request, seed)]
        seconds, hits = [], 0
        for _ in range(repeats):
            manager = CPUOffloadingManager(capacity, cache_policy=policy)
            t0 = time.perf_counter()
            hits = replay(manager, requests, REQUESTS_PER_STEP)
            seconds.append(time.perf_counter() - t0)
        return {"seconds": seconds, "hits": hits,
                "keys": sum(len(keys) for keys in requests)}

    def hit_ratio(self, trace: str, capacity: int, policy: str) -> dict[str, Any]:
        requests = [[make_offload_key(k, 0) for k in keys] for keys in read_trace(trace)]
        hits = replay(CPUOffloadingManager(capacity, cache_policy=policy), requests)
        total = sum(len(keys) for keys in requests)
        return {"hits": hits, "total": total, "hit_ratio": hits / total if total else 0.0}

    def cpu_tier(self, **_: Any) -> None:
        raise Unsupported("vLLM's CPU-tier copies are its GPU worker's (CUDA only)")


def replay(manager: CPUOffloadingManager, requests: list[list[Any]],
           per_step: int = 1) -> int:
    """Every request through the manager as the connector's scheduler drives it;
    returns the keys that hit. Per engine step of `per_step` requests: each is
    looked up (one call per key, up to the first miss) and its hits prepared for
    loading when it is scheduled; at the step's end the rest of its keys are
    stored, its loads complete and it finishes."""
    hits = 0
    for s in range(0, len(requests), per_step):
        scheduled = []
        for r, keys in enumerate(requests[s:s + per_step], s):
            context = ReqContext(f"r{r}")
            for i, key in enumerate(keys):
                context.set_offload_key_position(key, (i + 1) * 16)
            manager.on_new_request(context)
            n = 0
            for key in keys:
                if manager.lookup(key, context) is LookupResult.MISS:
                    break
                n += 1
            if n:
                manager.prepare_load(keys[:n], context)
            scheduled.append((context, keys, n))
            hits += n
        for context, keys, n in scheduled:
            stored = manager.prepare_store(keys[n:], context)
            if stored is not None and stored.keys_to_store:
                manager.complete_store(stored.keys_to_store, context)
            if n:
                manager.complete_load(keys[:n], context)
            manager.on_request_finished(context)
        manager.on_schedule_end(ScheduleEndContext([c.req_id for c, _, _ in scheduled], ()))
    return hits


def main() -> int:
    import importlib.metadata as metadata

    driver = Driver()
    ops = {name: getattr(driver, name) for name in (
        "disk_open", "disk_close", "disk_store", "disk_load", "disk_recover", "integrity",
        "cpu_tier", "hit_ratio", "manager_rps")}
    try:
        return serve("vllm", {"vllm": metadata.version("vllm")}, ops)
    finally:
        driver.disk_close()


if __name__ == "__main__":
    raise SystemExit(main())
