"""The demo's engine: plays an inference engine against a tierkv node, and checks
every byte it loads back.

Every block's bytes are derived from its key (`block_bytes`), so any copy that comes
back from any tier can be verified without keeping the originals.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierkv.client import Client, RemoteError
from tierkv.node.config import Config
from tierkv.workloads.traces import Request

log = logging.getLogger("tierkv.demo")

CONCURRENCY = 4  # requests the engine serves at once
MAX_PENDING_S = 2.0  # an engine would recompute rather than wait longer for promotions
MAX_STORE_RETRY_S = 5.0  # and drop an offload the CPU tier has had no room for
STEP_PAUSE_S = 0.005  # the engine's compute between steps


def block_key(hash_id: int) -> bytes:
    return b"demo" + hash_id.to_bytes(8, "big")


def block_bytes(key: bytes, rank: int, size: int) -> np.ndarray:
    """The KV bytes of `key` on `rank`, derived from the key: any copy is checkable."""
    seed = int.from_bytes(hashlib.blake2b(key + bytes([rank]), digest_size=8).digest(), "big")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


# Why a request's lookup took as long as it did. "promotion": it answered "pending"
# and the request then loaded blocks a promotion had brought; "other wait": it
# answered "pending" for something else (a shared tier's existence check of a key
# the node does not know, or another request's promotion); "at once": no wait.
LOOKUP_KINDS = ("at once", "promotion", "other wait")


@dataclass
class Totals:
    """What the engine saw, in one accounting: every block a completed request needed
    was either loaded (and counted once, by the tier it came from: `served`) or
    recomputed, so `sum(served.values()) + recomputed == blocks`."""

    requests: int = 0
    blocks: int = 0
    # Loaded blocks by origin: "cpu" for blocks that were in the CPU tier already, a
    # tier's name for blocks a promotion brought from it (the broker says which, in
    # each load's reply, once per promoted block).
    served: dict[str, int] = field(default_factory=lambda: {"cpu": 0})
    recomputed: int = 0
    verified: int = 0
    mismatches: int = 0
    failed_jobs: int = 0
    gave_up_waiting: int = 0
    stores_refused: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    # From a request's admission until its lookup was answered (asking again while
    # it answered "pending"), by why it took that long (`LOOKUP_KINDS`).
    lookup_s: dict[str, list[float]] = field(
        default_factory=lambda: {kind: [] for kind in LOOKUP_KINDS})
    load_s: list[float] = field(default_factory=list)  # from issue to landed
    step_s: list[float] = field(default_factory=list)  # one batched round trip


class Phase(enum.Enum):
    LOOKUP = "lookup"  # asking, and asking again while blocks are promoted
    LOADING = "loading"  # hits on their way into the KV cache
    STORE_WAIT = "store_wait"  # the CPU tier had no room: offload again next step
    STORING = "storing"  # every block on its way to the CPU tier
    DONE = "done"


@dataclass(eq=False)
class Active:
    """One request the engine is serving."""

    index: int
    keys: list[bytes]
    gpu: list[int]
    started: float
    phase: Phase = Phase.LOOKUP
    hits: int = 0
    waited: bool = False  # a lookup answered "pending": promotions were on their way
    lookup_s: float = 0.0  # from admission until the lookup was answered
    sources: dict[str, int] = field(default_factory=dict)  # of the loaded hits, by tier
    job: int | None = None
    job_started: float = 0.0

    @property
    def req_id(self) -> str:
        return f"req{self.index}"


class Engine:
    """Plays an inference engine: up to `concurrency` requests at once, and every
    engine step is one batched round trip (lookups, loads, stores, finishes, step)."""

    def __init__(self, config: Config, client: Client, gpu_blocks: int,
                 concurrency: int = CONCURRENCY) -> None:
        from tierkv.engine import KVLayout, allocate_kv_cache

        self.config = config
        self.client = client
        self.gpu_blocks = gpu_blocks
        self.concurrency = concurrency
        self.page = config.cpu.page_size
        # One uint8 tensor, blocks outermost, K and V halves: a page of exactly page_size.
        layout = KVLayout.blocks_outer(gpu_blocks, 1, 1, 1, self.page // 2, "uint8")
        self.kv = []
        try:
            for rank in range(config.cpu.world_size):
                self.kv.append(allocate_kv_cache(config.instance, rank, layout))
                client.register_kv(rank, self.kv[-1].registration())
        except BaseException:
            self.close()
            raise
        self._views = [kv.tensors[0].numpy().reshape(gpu_blocks, self.page) for kv in self.kv]
        self._free = list(range(gpu_blocks - 1, -1, -1))
        self._finished: dict[int, Any] = {}
        self.totals = Totals()

    def close(self) -> None:
        self._views = []
        for kv in self.kv:
            kv.close()

    def run(self, requests: list[Request], tick: Callable[[int], None], speedup: float) -> None:
        """Serve every request, each no earlier than its arrival time (the trace's
        timestamp, `speedup` times faster); `tick(n)` after each engine step in which
        n requests completed (the totals then hold all of them)."""
        waiting = list(enumerate(requests))
        waiting.reverse()
        active: list[Active] = []
        origin = requests[0].timestamp_ms if requests else 0.0
        start = time.perf_counter()
        while waiting or active:
            now = time.perf_counter() - start
            while waiting and len(active) < self.concurrency:
                index, request = waiting[-1]
                if (request.timestamp_ms - origin) / 1000 / speedup > now:
                    break  # not arrived yet
                keys = [block_key(h) for h in request.hash_ids][: self.gpu_blocks // 2]
                if len(keys) > len(self._free):
                    break  # the KV cache is full: wait for running requests to finish
                waiting.pop()
                gpu = [self._free.pop() for _ in keys]
                active.append(Active(index, keys, gpu, time.perf_counter()))
            self._step(active)
            done = [a for a in active if a.phase is Phase.DONE]
            for a in done:
                active.remove(a)
                self._free.extend(a.gpu)
            if done:
                tick(len(done))

    # -- one engine step -------------------------------------------------------------

    def _step(self, active: list[Active]) -> None:
        batch = self.client.batch()
        asked: list[tuple[Active, str]] = []
        for a in active:
            if a.phase is Phase.LOOKUP:
                batch.lookup(a.keys, a.req_id)
                asked.append((a, "lookup"))
        batch.step()
        t0 = time.perf_counter()
        results = batch.send()
        self.totals.step_s.append(time.perf_counter() - t0)
        for result in results[-1].finished:
            self._finished[result.job_id] = result
        answered = [a for (a, _), found in zip(asked, results, strict=False)
                    if self._looked_up(a, found)]
        # Loads first: a store (or another request's promotion) may evict a hit
        # that has not been loaded yet, which an engine notices as a failed load.
        for a in answered:
            if a.hits:
                self._load(a)
        for a in answered:
            if a.phase is Phase.LOOKUP and not a.hits:
                self._compute_and_store(a)
        for a in active:
            if a.phase is Phase.STORE_WAIT:
                self._store(a)
        for a in active:
            if a.job is not None and a.job in self._finished:
                result = self._finished.pop(a.job)
                self.totals.failed_jobs += not result.success
                if a.phase is Phase.LOADING:
                    self._landed(a, result.success)
                else:
                    self._stored(a)
        if not self._views:
            return
        time.sleep(STEP_PAUSE_S)

    def _looked_up(self, a: Active, found: Any) -> bool:
        """Record a lookup's answer; True once the request stops asking."""
        if isinstance(found, Exception):
            raise found
        a.waited = a.waited or found.pending
        waited = time.perf_counter() - a.started
        if found.pending and waited < MAX_PENDING_S:
            return False
        self.totals.gave_up_waiting += found.pending
        a.lookup_s = waited
        a.hits = found.hits
        return True

    def _load(self, a: Active) -> None:
        for block in a.gpu[: a.hits]:  # whatever was there must be overwritten
            for view in self._views:
                view[block] = 0
        try:
            load = self.client.load(a.keys[: a.hits], a.gpu[: a.hits], a.req_id)
        except RemoteError as e:
            if e.code != "bad_request":
                raise
            a.hits = 0  # evicted since the lookup: recompute (its lookup time stands)
            return
        a.sources = dict(load.sources)
        a.phase, a.job, a.job_started = Phase.LOADING, load.job_id, time.perf_counter()

    def _landed(self, a: Active, ok: bool) -> None:
        t = self.totals
        t.load_s.append(time.perf_counter() - a.job_started)
        if ok:
            t.bytes_loaded += a.hits * self.page * len(self._views)
            for key, block in zip(a.keys[: a.hits], a.gpu[: a.hits], strict=True):
                for rank, view in enumerate(self._views):
                    t.verified += 1
                    if not np.array_equal(view[block], block_bytes(key, rank, self.page)):
                        t.mismatches += 1
                        log.error("block %s on rank %d came back with wrong bytes", key.hex(),
                                  rank)
        else:
            a.hits, a.sources = 0, {}  # an engine recomputes what it could not load
        self._compute_and_store(a)

    def _compute_and_store(self, a: Active) -> None:
        for key, block in zip(a.keys[a.hits :], a.gpu[a.hits :], strict=True):
            for rank, view in enumerate(self._views):
                view[block] = block_bytes(key, rank, self.page)
        a.job_started = time.perf_counter()
        self._store(a)

    def _store(self, a: Active) -> None:
        """Offload the request's blocks; if the CPU tier has no room right now (its
        blocks are being loaded or cascaded), keep the GPU blocks and try again next
        step, for a while: that is the engine's backpressure."""
        store = self.client.store(a.keys, a.gpu, a.req_id)
        if store.refused and time.perf_counter() - a.job_started < MAX_STORE_RETRY_S:
            a.phase = Phase.STORE_WAIT
            return
        self.totals.stores_refused += store.refused
        self.totals.bytes_stored += len(store.keys_accepted) * self.page * len(self._views)
        if store.job_id is None:
            self._stored(a)
        else:
            a.phase, a.job = Phase.STORING, store.job_id

    def _stored(self, a: Active) -> None:
        self.client.finish(a.req_id)
        t = self.totals
        t.requests += 1
        t.blocks += len(a.keys)
        promoted = 0
        for tier, n in a.sources.items():
            t.served[tier] = t.served.get(tier, 0) + n
            promoted += n
        t.served["cpu"] += a.hits - promoted
        t.recomputed += len(a.keys) - a.hits
        kind = "promotion" if promoted else "other wait" if a.waited else "at once"
        t.lookup_s[kind].append(a.lookup_s)
        a.phase, a.job = Phase.DONE, None
