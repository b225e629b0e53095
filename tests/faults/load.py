"""The engine's side under fault: its KV cache, a steady replayed load that checks
every byte it loads, and the `Recorder` of what the node said it stored on disk."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import zmq

from tests.integration.cluster import LAYOUT, key_bytes
from tierkv.client import BrokerUnavailable, Client, RemoteError
from tierkv.node.config import Config
from tierkv.wire.protocol import EventBatch, TransferResult, decode

GPU_BLOCKS = 64
LOAD_BLOCKS = tuple(range(0, 32))  # the load generator's KV blocks
PROBE_BLOCKS = tuple(range(32, 64))  # the probe's and the checker's
MAX_KEYS = 8  # blocks per request: reuse enough to hit every tier, small enough for 2 cores
# A call that returns this much later than its timeout is a deadline miss. Slack for a
# loaded 2-core machine, where a thread may wait its turn for the GIL or a core.
CALL_GRACE_S = 0.5
CHECK_SAMPLE = 48  # disk keys looked up again after each fault (all are read from the slabs)
_PROBES = itertools.count(1)  # probe keys are never reused, in a whole session


# -- the engine's side -----------------------------------------------------------------------


@lru_cache(maxsize=16384)
def expected(key: bytes, rank: int, size: int) -> np.ndarray:
    return np.frombuffer(key_bytes(key, rank, size), dtype=np.uint8)


class EngineKV:
    """The engine's KV cache: CPU tensors in shared memory owned by the test process,
    every block filled with bytes derived from its key so any copy is checkable."""

    def __init__(self, instance: str, world_size: int = 1) -> None:
        from tierkv.engine import KVLayout, allocate_kv_cache

        layout = KVLayout.blocks_outer(num_blocks=GPU_BLOCKS, **LAYOUT)
        self.page = layout.page_size
        self.caches: list[Any] = []
        try:
            for rank in range(world_size):
                self.caches.append(allocate_kv_cache(instance, rank, layout))
        except BaseException:
            self.close()
            raise
        self.views = [kv.tensors[0].view(GPU_BLOCKS, -1).numpy().view(np.uint8)
                      for kv in self.caches]
        self.tokens: dict[int, str] = {}  # rank -> its registration's token (`register`)

    def register(self, client: Client, timeout: float = 60.0) -> None:
        """Hand the cache to every rank's worker, waiting while none is ready. The
        tokens the registrations return let the other drivers store and load."""
        deadline = time.monotonic() + timeout
        for rank, kv in enumerate(self.caches):
            while True:
                try:
                    client.register_kv(rank, kv.registration(), timeout=10.0)
                    self.tokens[rank] = client.registration_tokens[rank]
                    break
                except (RemoteError, BrokerUnavailable):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    def fill(self, keys: list[bytes], blocks: list[int]) -> None:
        for rank, view in enumerate(self.views):
            for key, block in zip(keys, blocks, strict=True):
                view[block] = expected(key, rank, self.page)

    def zero(self, blocks: list[int]) -> None:
        for view in self.views:
            view[list(blocks)] = 0

    def wrong(self, keys: list[bytes], blocks: list[int]) -> int:
        """Blocks (per rank) that do not hold their key's bytes."""
        return sum(not np.array_equal(view[block], expected(key, rank, self.page))
                   for rank, view in enumerate(self.views)
                   for key, block in zip(keys, blocks, strict=True))

    def close(self) -> None:
        self.views = []
        for kv in self.caches:
            kv.close()
        self.caches = []


# -- measured clients ----------------------------------------------------------------------


class Recorder:
    """Which keys the broker reported stored on (and removed from) the disk tier, and
    when (in events seen): a key evicted after a fault is not lost, one evicted
    before and stored again is as good as any other. It watches the whole node
    (`listen` to the broker's events socket): a client hears only of its own blocks,
    and the load's client stops stepping before the tier's last evictions."""

    def __init__(self, disk: str | None = "disk") -> None:
        self.disk = disk
        self._lock = threading.Lock()
        self._seen = 0
        self._held: dict[bytes, bool] = {}
        self._removed_at: dict[bytes, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def listen(self, address: str) -> None:
        """Absorb every event the broker publishes, on a thread, until `close`."""
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(address)

        def run() -> None:
            try:
                while not self._stop.is_set():
                    if sub.poll(100):
                        batch = decode(sub.recv())
                        if isinstance(batch, EventBatch):
                            self.absorb(batch.events)
            finally:
                sub.close()

        self._thread = threading.Thread(target=run, name="events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def absorb(self, events: list[Any]) -> None:
        with self._lock:
            for event in events:
                self._seen += 1
                if event.tier != self.disk:
                    continue
                for key in event.keys:
                    self._held[key] = event.kind == "stored"
                    if event.kind == "removed":
                        self._removed_at[key] = self._seen

    def mark(self) -> int:
        with self._lock:
            return self._seen

    def disk_held(self) -> set[bytes]:
        with self._lock:
            return {k for k, held in self._held.items() if held}

    def removed_since(self, mark: int) -> set[bytes]:
        with self._lock:
            return {k for k, seen in self._removed_at.items() if seen > mark}


@dataclass
class Tally:
    calls: int = 0
    max_call_s: float = 0.0
    late_calls: int = 0  # returned later than timeout + CALL_GRACE_S: must stay 0
    unavailable: int = 0  # BrokerUnavailable within the timeout: allowed
    first_unavailable: float | None = None  # when the first BrokerUnavailable was raised
    remote_errors: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    requests_ok: int = 0
    jobs: int = 0
    jobs_failed: int = 0  # a result with success=False
    jobs_lost: int = 0  # no result: its broker died, or this client had to reconnect
    verified: int = 0
    wrong_bytes: int = 0
    late: list[str] = field(default_factory=list)  # what the late calls were
    errors: list[str] = field(default_factory=list)  # exceptions no fault explains

    def add(self, other: Tally) -> None:
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "max_call_s":
                self.max_call_s = max(mine, theirs)
            elif f.name == "first_unavailable":
                if theirs is not None and (mine is None or theirs < mine):
                    self.first_unavailable = theirs
            elif isinstance(mine, Counter):
                mine.update(theirs)
            elif isinstance(mine, list):
                mine.extend(theirs)
            else:
                setattr(self, f.name, mine + theirs)


class Driver:
    """One client of the node playing the engine; every call is timed against the
    client's timeout and every loaded block compared with its key's bytes."""

    def __init__(self, config: Config, kv: EngineKV | None, recorder: Recorder,
                 blocks: tuple[int, ...] = (), timeout: float | None = None) -> None:
        self.client = Client(config.connect_address("client"),
                             timeout=timeout or config.client.timeout_s,
                             curve=config.client.curve_keys())
        self.kv = kv
        self.recorder = recorder
        self.blocks = list(blocks)
        # The broker fails a job by its deadline, or its holder within 3 heartbeats.
        self.job_bound = config.broker.job_timeout_s + 3 * config.broker.heartbeat_s + 2.0
        self.tally = Tally()
        self._finished: dict[int, TransferResult] = {}

    def close(self) -> None:
        self.client.close()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.kv is not None:
            self.client.use_kv(self.kv.tokens)  # also those of a registration made again
        t0 = time.monotonic()
        try:
            return fn(*args)
        except BrokerUnavailable:
            self.tally.unavailable += 1
            if self.tally.first_unavailable is None:
                self.tally.first_unavailable = time.monotonic()
            raise
        except RemoteError as e:
            self.tally.remote_errors[e.code] += 1
            raise
        finally:
            took = time.monotonic() - t0
            self.tally.calls += 1
            self.tally.max_call_s = max(self.tally.max_call_s, took)
            if took > self.client.timeout + CALL_GRACE_S:
                self.tally.late_calls += 1
                self.tally.late.append(f"{getattr(fn, '__name__', fn)} took {took:.2f}s "
                                       f"(timeout {self.client.timeout}s)")

    def stats(self) -> dict[str, Any] | None:
        try:
            return self.call(self.client.stats)
        except (BrokerUnavailable, RemoteError):
            return None

    def step(self) -> None:
        result = self.call(self.client.step)
        for done in result.finished:
            self._finished[done.job_id] = done

    def wait_job(self, job_id: int) -> bool | None:
        """True/False: the job's result; None: no result came (counted lost)."""
        self.tally.jobs += 1
        deadline = time.monotonic() + self.job_bound
        while True:
            done = self._finished.pop(job_id, None)
            if done is not None:
                self.tally.jobs_failed += not done.success
                return done.success
            if time.monotonic() > deadline:
                self.tally.jobs_lost += 1
                return None
            try:
                self.step()
            except BrokerUnavailable:
                # Results go to the socket that asked; the rebuilt one will not see it.
                self.tally.jobs_lost += 1
                raise
            time.sleep(0.002)

    def lookup(self, keys: list[bytes], req_id: str, pending_s: float) -> int:
        """Hits, asking again while blocks are promoted (for at most `pending_s`)."""
        deadline = time.monotonic() + pending_s
        while True:
            found = self.call(self.client.lookup, keys, req_id)
            if not found.pending or time.monotonic() > deadline:
                return found.hits
            self.step()
            time.sleep(0.003)

    def store(self, keys: list[bytes], blocks: list[int], req_id: str) -> bool:
        """Offload; a refusal (no room now) is retried for a while, as an engine does."""
        deadline = time.monotonic() + 2.0
        while True:
            out = self.call(self.client.store, keys, blocks, req_id)
            if out.refused and time.monotonic() < deadline:
                self.step()
                time.sleep(0.01)
                continue
            return True if out.job_id is None else bool(self.wait_job(out.job_id))

    def load_checked(self, keys: list[bytes], blocks: list[int], req_id: str) -> bool | None:
        """Load into zeroed blocks and compare every byte. None: refused (evicted)."""
        assert self.kv is not None
        self.kv.zero(blocks)
        try:
            load = self.call(self.client.load, keys, blocks, req_id)
        except RemoteError as e:
            if e.code != "bad_request":
                raise
            return None  # evicted since the lookup: an engine recomputes
        if not self.wait_job(load.job_id):
            return False
        wrong = self.kv.wrong(keys, blocks)
        self.tally.verified += len(keys) * len(self.kv.views)
        self.tally.wrong_bytes += wrong
        return wrong == 0

    def serve(self, keys: list[bytes], req_id: str) -> bool:
        """One engine request: lookup (waiting while blocks are promoted), load the
        hits and check them, compute and store the rest, finish. True if all worked."""
        assert self.kv is not None
        blocks = self.blocks[: len(keys)]
        try:
            hits = self.lookup(keys, req_id, pending_s=2.0)
            ok = True
            if hits:
                loaded = self.load_checked(keys[:hits], blocks[:hits], req_id)
                ok = loaded is not False
                if not loaded:
                    hits = 0
            self.kv.fill(keys[hits:], blocks[hits:])
            return self.store(keys, blocks, req_id) and ok
        finally:
            self.finish(req_id)

    def finish(self, req_id: str) -> None:
        """Best effort, also for a request that failed, as an engine does: blocks
        promoted for it would otherwise stay leased for `broker.lease_s`."""
        with contextlib.suppress(BrokerUnavailable, RemoteError):
            self.call(self.client.finish, req_id)

    def round_trip(self, n: int = 4) -> bool:
        """Fresh keys: store, look up (all hits), load elsewhere, same bytes."""
        assert self.kv is not None
        probe = next(_PROBES)
        keys = [b"probe-%d-%d-%d" % (os.getpid(), probe, i) for i in range(n)]
        req = f"probe{probe}"
        src, dst = self.blocks[:n], self.blocks[n : 2 * n]
        self.kv.fill(keys, src)
        try:
            return (self.store(keys, src, req) and self.lookup(keys, req, 5.0) == n
                    and bool(self.load_checked(keys, dst, req)))
        finally:
            self.finish(req)


class LoadGen(threading.Thread):
    """A steady replayed load: the requests of a trace, one at a time, at a fixed
    pace, until stopped. Errors a fault explains (broker unavailable, a refused
    request) are counted and the next request goes on; anything else is kept."""

    def __init__(self, driver: Driver, requests: list[list[bytes]], interval_s: float,
                 start: int = 0) -> None:
        super().__init__(name="tierkv-load", daemon=True)
        self.driver = driver
        self.requests = requests
        self.interval_s = interval_s
        self.position = start
        self._stop_event = threading.Event()

    def run(self) -> None:
        tally = self.driver.tally
        next_at = time.monotonic()
        while not self._stop_event.is_set():
            keys = self.requests[self.position % len(self.requests)]
            self.position += 1
            tally.requests += 1
            try:
                ok = self.driver.serve(keys, f"load{self.position}")
            except (BrokerUnavailable, RemoteError):
                ok = False
                self._stop_event.wait(0.05)
            except Exception as e:  # noqa: BLE001 - kept for the test to report
                ok = False
                tally.errors.append(f"{type(e).__name__}: {e}")
                self._stop_event.wait(0.1)
            tally.requests_ok += ok
            next_at = max(next_at + self.interval_s, time.monotonic() - self.interval_s)
            self._stop_event.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> Tally:
        self._stop_event.set()
        self.join(timeout=self.driver.job_bound * 3 + 10)
        assert not self.is_alive(), "the load generator did not stop"
        return self.driver.tally


def replayed_requests(n: int = 400, seed: int = 0, prefix: bytes = b"f") -> list[list[bytes]]:
    """Key lists of a synthetic multi-turn conversation trace (Mooncake format): shared
    system prompts and documents make later requests hit what earlier ones stored."""
    from tierkv.demo.command import demo_workload

    return [[prefix + h.to_bytes(8, "big") for h in r.hash_ids][:MAX_KEYS]
            for r in demo_workload(n, seed)]
