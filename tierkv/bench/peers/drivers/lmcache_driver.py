"""LMCache 0.5.6, driven as its engine drives it, in its own process.

    <peers' venv>/bin/python -m tierkv.bench.peers.drivers.lmcache_driver

Runs in the peers' environment (never in tierkv's). Everything goes through
LMCache's `StorageManager`, the object its cache engine stores and retrieves
through: memory objects come from its allocator (`LocalCPUBackend`), a store is
`batched_put(keys, objs, location=...)`, a retrieve `batched_get(keys,
location=...)`, a lookup `contains`. Two disk systems:

* `disk`: the local disk backend (`local_disk`, `max_local_disk_size`): a file
  per chunk written by its I/O threads (`disk_io_threads`, default 4), buffered,
  no fsync, index in memory, LRU within the size bound.
* `fs`: the `fs://` remote connector (`remote_url`), which writes each chunk to
  a temporary file and renames it, and finds chunks by their file's existence.

Both run with LMCache's defaults (no O_DIRECT, 4 threads, LRU), its recommended
settings for a local disk. A store is finished when the backend says it holds
every key (its own completion); the synced variant then `fdatasync`s every file
it wrote from 4 threads, as many as it writes with, and each directory once.
"""

from __future__ import annotations

import os
import time
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
    fill_block,
    key_bytes,
    outcome,
    read_trace,
    serve,
    sync_files,
    wait_until,
)

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch  # noqa: E402 - after the environment that silences its telemetry
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.cache_policy import get_cache_policy  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

TOKENS = 256  # LMCache's default chunk size
BATCH = 32  # chunks per batched_put / batched_get, as tierkv's and vLLM's jobs
STORE_TIMEOUT_S = 600.0
IO_THREADS = 4  # LMCache's default disk_io_threads: the synced variant flushes with as many
LOCATION = {"disk": "LocalDiskBackend", "fs": "RemoteBackend", "cpu": "LocalCPUBackend"}


def _gb(nbytes: float) -> float:
    return nbytes / 2**30


class Store:
    """One StorageManager over one directory (or the CPU backend alone)."""

    def __init__(self, kind: str, directory: str, block_bytes: int, capacity_blocks: int,
                 pool_blocks: int) -> None:
        if kind not in LOCATION:
            raise ValueError(f"unknown LMCache system {kind!r}")
        self.kind, self.directory, self.block_bytes = kind, directory, block_bytes
        settings: dict[str, Any] = {
            "chunk_size": TOKENS, "local_cpu": kind == "cpu",
            # The allocator pool: room for the objects of one pass (plus slack).
            "max_local_cpu_size": _gb(pool_blocks * block_bytes * 1.25) + 0.05,
        }
        if kind == "disk":
            settings.update(local_disk=directory,
                            max_local_disk_size=_gb(capacity_blocks * block_bytes))
        elif kind == "fs":
            settings.update(remote_url=f"fs://127.0.0.1:0{directory}", remote_serde="naive")
        config = LMCacheEngineConfig.from_defaults(**settings)
        self.metadata = LMCacheMetadata(
            model_name="bench", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.uint8,
            kv_shape=(1, 2, TOKENS, 1, block_bytes // (2 * TOKENS)), chunk_size=TOKENS)
        self.shape = torch.Size([2, 1, TOKENS, block_bytes // (2 * TOKENS)])
        self.manager = StorageManager(config, self.metadata, EventManager())
        self.location = LOCATION[kind]
        self.backend = self.manager.storage_backends[self.location]

    def key(self, tag: str, i: int) -> CacheEngineKey:
        return CacheEngineKey(model_name="bench", world_size=1, worker_id=0,
                              chunk_hash=int.from_bytes(key_bytes(tag, i), "big"),
                              dtype=torch.uint8)

    def filled(self, base: np.ndarray, first: int, count: int) -> list[Any]:
        """Memory objects holding blocks first..first+count (as the GPU copy leaves them)."""
        objs = []
        for i in range(first, first + count):
            obj = self.manager.allocate(self.shape, torch.uint8)
            if obj is None:
                raise MemoryError("LMCache's allocator has no room for the pass")
            fill_block(obj.tensor.view(-1).numpy(), base, i)
            objs.append(obj)
        return objs

    def scrub_pool(self) -> None:
        """Overwrite every free object of the allocator's pool: a load that fills
        only part of its buffer must not find the block's old bytes there."""
        taken = []
        while (obj := self.manager.allocate(self.shape, torch.uint8, eviction=False)) is not None:
            obj.tensor.view(-1).fill_(0xAA)
            taken.append(obj)
        for obj in taken:
            obj.ref_count_down()

    def holds(self, key: CacheEngineKey) -> bool:
        if self.kind == "disk":
            return self.backend.contains(key) and not self.backend.exists_in_put_tasks(key)
        return bool(self.backend.contains(key))

    def put(self, keys: list[CacheEngineKey], objs: list[Any]) -> None:
        for j in range(0, len(keys), BATCH):
            self.manager.batched_put(keys[j:j + BATCH], objs[j:j + BATCH],
                                     location=self.location)

    def get(self, keys: list[CacheEngineKey]) -> list[Any]:
        got: list[Any] = []
        for j in range(0, len(keys), BATCH):
            got += self.manager.batched_get(keys[j:j + BATCH], location=self.location)
        return got

    def files(self) -> list[str]:
        return [os.path.join(self.directory, f) for f in os.listdir(self.directory)]

    def record(self, key: CacheEngineKey) -> tuple[str, int, int]:
        if self.kind == "disk":
            path = self.backend._key_to_path(key)
        else:  # the fs connector names a chunk's file after the key, suffix .data
            path = os.path.join(self.directory, key.to_string() + ".data")
        return path, 0, os.path.getsize(path)

    def close(self) -> None:
        self.manager.close()


class Driver(StoreDriver[Store]):
    def disk_open(self, system: str, dir: str, block_bytes: int, capacity_blocks: int,
                  pool_blocks: int, durable: bool = True) -> dict[str, Any]:
        """`durable` is tierkv's option; this peer never syncs (the synced variant
        adds `sync_files` to `disk_store`). The bound: `capacity_blocks` blocks' bytes."""
        store = self._open(Store(system, dir, block_bytes, capacity_blocks, pool_blocks))
        return {"settings": f"{store.location}, LMCache defaults"}

    def disk_store(self, tag: str, count: int, seed: int, first: int = 0,
                   sync: bool = False) -> dict[str, Any]:
        store = self._need()
        base = base_block(store.block_bytes, seed)
        keys = [store.key(tag, i) for i in range(first, first + count)]
        objs = store.filled(base, first, count)
        t0 = time.perf_counter()
        store.put(keys, objs)
        wait_until(lambda: all(store.holds(k) for k in keys), STORE_TIMEOUT_S,
                   f"LMCache {store.kind} store of {count} chunks")
        if sync:
            sync_files(store.directory, IO_THREADS)
        return {"seconds": time.perf_counter() - t0}

    def disk_load(self, tag: str, count: int, seed: int, first: int = 0) -> dict[str, Any]:
        store = self._need()
        base = base_block(store.block_bytes, seed)
        keys = [store.key(tag, i) for i in range(first, first + count)]
        t0 = time.perf_counter()
        got = store.get(keys)
        took = time.perf_counter() - t0
        missing = sum(obj is None for obj in got)
        bad = 0
        for i, obj in enumerate(got):
            if obj is not None:
                bad += not block_intact(obj.tensor.view(-1).numpy(), base, first + i)
                obj.ref_count_down()
        return {"seconds": took, "missing": missing, "bad": bad}

    def disk_recover(self, system: str, dir: str, block_bytes: int, capacity_blocks: int,
                     tag: str, count: int) -> dict[str, Any]:
        """A new process over the directory a previous one filled: how many of
        its blocks does it find, and how long until it can say so?"""
        t0 = time.perf_counter()
        self.disk_open(system, dir, block_bytes, capacity_blocks, 4)
        store = self._need()
        found = sum(store.holds(store.key(tag, i)) for i in range(count))
        took = time.perf_counter() - t0
        self.disk_close()
        return {"found": found, "seconds": took}

    def integrity(self, system: str, dir: str, block_bytes: int) -> dict[str, Any]:
        """Each corruption on its own store: store blocks 0 and 1, damage block 0
        (with block 1's record for a swap), reopen nothing (the index is in
        memory), and read block 0 back."""
        out = {}
        for mode in MODES:
            sub = os.path.join(dir, mode)
            os.makedirs(sub)
            self.disk_open(system, sub, block_bytes, 16, 8)
            store = self._need()
            self.disk_store(mode, 2, seed=7)
            did = corrupt(mode, store.record(store.key(mode, 0)), store.record(store.key(mode, 1)))
            store.scrub_pool()
            base = base_block(block_bytes, 7)
            try:
                (obj,) = store.get([store.key(mode, 0)])
                served = obj is not None
                intact = served and block_intact(obj.tensor.view(-1).numpy(), base, 0)
                if served:
                    obj.ref_count_down()
                out[mode] = {"outcome": outcome(served, intact), "did": did}
            except Exception as e:  # noqa: BLE001 - the row records it
                out[mode] = {"outcome": outcome(None, False, type(e).__name__), "did": did}
            self.disk_close()
        return out

    def cpu_tier(self, block_bytes: int, count: int, repeats: int, seed: int) -> dict[str, Any]:
        """Store then retrieve `count` chunks through the CPU backend, `repeats`
        times: a store is allocate + copy in + batched_put, a retrieve
        batched_get + copy out (the copies the GPU connector would make)."""
        store = Store("cpu", "", block_bytes, 0, count * 2)
        base = base_block(block_bytes, seed)
        src = np.empty((count, block_bytes), dtype=np.uint8)
        for i in range(count):
            fill_block(src[i], base, i)
        dst = np.zeros_like(src)
        stores, loads, bad = [], [], 0
        try:
            for rep in range(repeats):
                keys = [store.key(f"cpu{rep}", i) for i in range(count)]
                t0 = time.perf_counter()
                objs = []
                for i in range(count):
                    obj = store.manager.allocate(store.shape, torch.uint8)
                    np.copyto(obj.tensor.view(-1).numpy(), src[i])
                    objs.append(obj)
                store.put(keys, objs)
                stores.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = store.get(keys)
                for i, obj in enumerate(got):
                    np.copyto(dst[i], obj.tensor.view(-1).numpy())
                    obj.ref_count_down()
                loads.append(time.perf_counter() - t0)
                bad += count_bad(dst, base)
                dst[:] = 0
        finally:
            store.close()
        return {"store_s": stores, "load_s": loads, "bad": bad}

    def hit_ratio(self, trace: str, capacity: int, policy: str) -> dict[str, Any]:
        """Replay a trace through LMCache's CPU-backend logic with one of its cache
        policies: a lookup pins the leading run of resident chunks, a retrieve
        touches them (`touch_cache`: in reverse order), the rest are put, each
        allocation evicting `get_evict_candidates` while the backend is full."""
        requests = read_trace(trace)
        cache_policy = get_cache_policy(policy.upper())
        cache = cache_policy.init_mutable_mapping()
        hits = total = 0
        for keys in requests:
            n = 0
            for key in keys:
                if key not in cache:
                    break
                n += 1
            for key in reversed(keys[:n]):
                cache_policy.update_on_hit(key, cache)
            for key in keys[n:]:
                if key in cache:
                    continue
                while len(cache) >= capacity:
                    victims = cache_policy.get_evict_candidates(cache, num_candidates=1)
                    if not victims:
                        raise RuntimeError("LMCache policy found no eviction candidate")
                    for victim in victims:
                        del cache[victim]
                        cache_policy.update_on_force_evict(victim)
                cache[key] = _Resident()
                cache_policy.update_on_put(key)
            hits += n
            total += len(keys)
        return {"hits": hits, "total": total, "hit_ratio": hits / total if total else 0.0}

    def manager_rps(self, **_: Any) -> None:
        raise Unsupported("LMCache's scheduler-side lookup is measured by no row here")


class _Resident:
    """What the policies ask of a resident chunk: may it be evicted?"""

    can_evict = True


def main() -> int:
    import importlib.metadata as metadata

    driver = Driver()
    ops = {name: getattr(driver, name) for name in (
        "disk_open", "disk_close", "disk_store", "disk_load", "disk_recover", "integrity",
        "cpu_tier", "hit_ratio", "manager_rps")}
    try:
        return serve("lmcache", {"lmcache": metadata.version("lmcache"),
                                 "torch": torch.__version__}, ops)
    finally:
        driver.disk_close()


if __name__ == "__main__":
    raise SystemExit(main())
