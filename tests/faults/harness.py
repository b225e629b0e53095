"""Fault-injection harness: a supervised node, the engine's KV cache, a steady
replayed load that checks every byte it loads, and the figures of docs/reliability.md
(detected in, recovered in, failed jobs, deadline misses, wrong bytes, lost blocks).

Why a supervisor subprocess: faults are real signals to real processes, and only
a supervisor restarts what dies, so the node under test is the one `tierkv up`
runs. Why one `Recorder` for every client: `step` hands the broker's events to
whichever client steps first, so the load, the probe and the checker all feed it,
or "stored on disk" reports would fall between them and lost blocks would go
unnoticed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from tests.integration.cluster import LAYOUT, key_bytes, make_config
from tierkv.blockformat import HEADER_SIZE, CorruptBlock, unpack_header, verify
from tierkv.client import BrokerUnavailable, Client, RemoteError
from tierkv.config import Config, dump_config, tier_name
from tierkv.protocol import TransferResult
from tierkv.shm import process_start_time
from workers.disk import HEADER_AREA, namespace_dir, namespace_tag, slot_bytes_for

REPO = Path(__file__).resolve().parents[2]
PAGE = 1024  # LAYOUT's block: 2 layers x K/V x 4 tokens x 2 heads x 16 dims x fp16
GPU_BLOCKS = 64
LOAD_BLOCKS = tuple(range(0, 32))  # the load generator's KV blocks
PROBE_BLOCKS = tuple(range(32, 64))  # the probe's and the checker's
MAX_KEYS = 8  # blocks per request: reuse enough to hit every tier, small enough for 2 cores
# A call that returns this much later than its timeout is a deadline miss. Slack for a
# loaded 2-core machine, where a thread may wait its turn for the GIL or a core.
CALL_GRACE_S = 0.5
CHECK_SAMPLE = 48  # disk keys looked up again after each fault (all are read from the slabs)
_PROBES = itertools.count(1)  # probe keys are never reused, in a whole session
RESULTS: list[FaultResult] = []  # every fault measured in this session (conftest prints them)


def seed_from_env() -> int:
    """TIERKV_FAULT_SEED replays a run; otherwise a fresh seed (printed by the tests)."""
    value = os.environ.get("TIERKV_FAULT_SEED")
    return int(value) if value else random.SystemRandom().randrange(2**31)


# -- configs -------------------------------------------------------------------------------


def fault_config(instance: str, run_dir: Path, tiers: list[dict[str, Any]],
                 **sections: Any) -> Config:
    """Heartbeats of 0.5 s, job deadlines of 3 s and broker probes of 1 s, so a fault
    is detected in seconds; a short restart backoff, so recovery is measured, not
    waited for."""
    base: dict[str, Any] = {
        "cpu": {"num_blocks": 48, "page_size": PAGE},
        "broker": {"heartbeat_s": 0.5, "job_timeout_s": 3.0, "tick_ms": 2.0,
                   "drain_timeout_s": 2.0},
        "client": {"timeout_s": 3.0},
        "supervisor": {"ready_timeout_s": 60.0, "stop_timeout_s": 15.0,
                       "restart_backoff_s": 0.2, "restart_backoff_max_s": 2.0,
                       "broker_probe_s": 1.0, "broker_probe_misses": 3},
    }
    for name, value in sections.items():
        base[name] = {**base.get(name, {}), **value} if isinstance(value, dict) else value
    return make_config(instance, run_dir, tiers=tiers, **base)


def disk_tier(root: Path, slots: int, **options: Any) -> dict[str, Any]:
    return {"type": "disk", "name": "disk", "root": str(root),
            "budget_bytes": slots * slot_bytes_for(PAGE), "threads": 2, **options}


def s3_tier(endpoint_url: str, bucket: str, **options: Any) -> dict[str, Any]:
    """Fast-failing S3 settings: a dead endpoint costs one connect timeout, then the
    breaker fails jobs at once until its cool-down passes."""
    return {"type": "s3", "name": "s3", "bucket": bucket, "endpoint_url": endpoint_url,
            "create_bucket": True, "threads": 2, "max_attempts": 2, "connect_timeout_s": 1.0,
            "read_timeout_s": 2.0, "exists_timeout_s": 1.0, "negative_ttl_s": 0.5,
            "breaker_failures": 3, "breaker_cooldown_s": 1.0, **options}


# -- the supervised node -------------------------------------------------------------------


def _state(pid: int) -> str | None:
    """The process state letter (R, S, T, Z...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")


class SupervisedNode:
    """`tierkv up -c FILE` as a subprocess, watched through its status file. Every
    child pid it ever reports is remembered (with its start time) so teardown can
    kill by pid whatever a killed supervisor left behind."""

    def __init__(self, config: Config, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.workdir = workdir
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log_path = workdir / "supervisor.log"
        self.status_path = config.run_path / "supervisor.json"
        self._seen: dict[int, int] = {}  # child pid -> its start time
        self._stopped: set[int] = set()  # pids we SIGSTOPped: continued at teardown

    @property
    def names(self) -> set[str]:
        names = {"broker", *(f"worker{r}" for r in range(self.config.cpu.world_size))}
        for entry in self.config.tiers:
            names.update(f"tier:{tier_name(entry)}:{i}"
                         for i in range(int(entry.get("processes", 1))))
        return names

    def start(self, timeout: float = 90.0) -> dict[str, Any]:
        self.starts += 1
        path = self.workdir / f"node-{self.starts}.toml"
        path.write_text(dump_config(self.config))
        env = {**os.environ, **self.env, "PYTHONPATH": str(REPO)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierkv.cli", "up", "-c", str(path)], cwd=REPO, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        return self.wait_status(self.all_alive, timeout)

    def status(self) -> dict[str, Any] | None:
        """The running supervisor's status, None before it wrote one."""
        try:
            status = json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return None
        if self.proc is None or status.get("pid") != self.proc.pid:
            return None
        for child in status["children"]:
            if child["pid"] not in self._seen:
                self._seen[child["pid"]] = process_start_time(child["pid"]) or 0
        return status

    def wait_status(self, predicate: Callable[[dict[str, Any]], bool],
                    timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the supervisor exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            status = self.status()
            if status is not None and predicate(status):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"supervisor status not as expected within {timeout}s: "
                                   f"{status}\n{self.log_tail()}")
            time.sleep(0.05)

    def all_alive(self, status: dict[str, Any]) -> bool:
        return {c["name"] for c in status["children"] if c["alive"]} >= self.names

    def pids(self) -> dict[str, int]:
        status = self.status()
        return {} if status is None else {c["name"]: c["pid"] for c in status["children"]}

    def pid(self, name: str) -> int:
        status = self.status()
        assert status is not None, "no supervisor status"
        return next(c["pid"] for c in status["children"] if c["name"] == name)

    def child_down(self, name: str, old_pid: int) -> bool:
        """The supervisor noticed that `old_pid` died (or already replaced it)."""
        status = self.status()
        return status is not None and any(
            c["name"] == name and (c["pid"] != old_pid or not c["alive"])
            for c in status["children"])

    def child_restarted(self, name: str, old_pid: int) -> bool:
        status = self.status()
        return status is not None and any(
            c["name"] == name and c["pid"] != old_pid and c["alive"] for c in status["children"])

    def send(self, pid: int, sig: int) -> None:
        if sig == signal.SIGSTOP:
            self._stopped.add(pid)
        elif sig == signal.SIGCONT:
            self._stopped.discard(pid)
        os.kill(pid, sig)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def children_gone(self) -> bool:
        return all(gone(pid) for pid in self._seen)

    def stop(self) -> int | None:
        """SIGTERM the supervisor (it stops its children), then kill by pid whatever is
        still alive, and sweep what a killed node left in /dev/shm and the run dir."""
        for pid in list(self._stopped):
            with contextlib.suppress(OSError):
                self.send(pid, signal.SIGCONT)
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(10)
        for pid, started in self._seen.items():
            if not gone(pid) and process_start_time(pid) == started:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while not self.children_gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        from tierkv.supervisor import Node

        Node(self.config).cleanup()  # a no-op after a clean stop
        return code


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

    def register(self, client: Client, timeout: float = 60.0) -> None:
        """Hand the cache to every rank's worker, waiting while none is ready."""
        deadline = time.monotonic() + timeout
        for rank, kv in enumerate(self.caches):
            while True:
                try:
                    client.register_kv(rank, kv.registration(), timeout=10.0)
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
    before and stored again is as good as any other."""

    def __init__(self, disk: str | None = "disk") -> None:
        self.disk = disk
        self._lock = threading.Lock()
        self._seen = 0
        self._held: dict[bytes, bool] = {}
        self._removed_at: dict[bytes, int] = {}

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
        self.recorder.absorb(result.events)
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
        promoted for it would otherwise stay leased for `cpu.lease_steps`."""
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
    from tierkv.demo import demo_workload

    return [[prefix + h.to_bytes(8, "big") for h in r.hash_ids][:MAX_KEYS]
            for r in demo_workload(n, seed)]


# -- disk truth ----------------------------------------------------------------------------


def keys_on_disk(root: Path, namespace: str, block_bytes: int = PAGE) -> tuple[set[bytes], int]:
    """Keys whose block lies whole on disk (header and payload verify), found the way a
    restarted disk tier finds them; and how many of those hold bytes other than
    their key's."""
    slot = slot_bytes_for(block_bytes)
    ns = namespace_tag(namespace)
    found: set[bytes] = set()
    wrong = 0
    for slab in sorted((root / namespace_dir(namespace)).glob("slab-*.dat")):
        raw = slab.read_bytes()
        for offset in range(0, len(raw) - slot + 1, slot):
            payload = raw[offset + HEADER_AREA : offset + HEADER_AREA + block_bytes]
            try:
                header = unpack_header(raw[offset : offset + HEADER_SIZE])
                verify(header, header.key, ns, payload)
            except CorruptBlock:
                continue  # free, torn or zeroed: a restart would not serve it either
            found.add(header.key)
            wrong += payload != key_bytes(header.key, 0, block_bytes)
    return found, wrong


# -- one fault, measured ---------------------------------------------------------------------


@dataclass
class FaultResult:
    fault: str
    seed: int
    injected_after_s: float = 0.0
    detected_s: float | None = None
    recovered_s: float | None = None
    failed_jobs: int = 0  # client jobs failed or lost, plus tier jobs the broker failed
    deadline_misses: int = 0
    wrong_bytes: int = 0
    lost_blocks: int = 0
    checked_blocks: int = 0  # disk blocks reported stored before the fault, checked after
    requests: int = 0
    requests_ok: int = 0
    blocks_verified: int = 0
    client_unavailable: int = 0  # calls that raised BrokerUnavailable (within their timeout)
    jobs_lost: int = 0  # client jobs whose result never came (a broker died with them)
    slowest_call_s: float = 0.0
    fenced: int = 0  # peers the broker killed by pid (hung, or a job past its deadline)
    restarted: str = ""  # children the supervisor runs under a new pid afterwards
    notes: str = ""

    def row(self) -> str:
        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        return (f"{self.fault:<34} {s(self.detected_s):>8} {s(self.recovered_s):>9} "
                f"{self.failed_jobs:>6} {self.deadline_misses:>6} {self.wrong_bytes:>6} "
                f"{self.lost_blocks:>5}/{self.checked_blocks:<5} {self.requests_ok:>5}/"
                f"{self.requests:<5} seed={self.seed}")


HEADER = (f"{'fault':<34} {'detect s':>8} {'recover s':>9} {'failed':>6} {'late':>6} "
          f"{'wrong':>6} {'lost/checked':>11} {'ok/requests':>11}")


def summary_table(results: list[FaultResult]) -> list[str]:
    """One markdown row per fault over its runs: medians with min-max of the times
    (the machines are noisy), sums of the counts that must be 0."""
    def spread(values: list[float]) -> str:
        if not values:
            return "-"
        values = sorted(values)
        mid = statistics.median(values)
        return f"{mid:.2f}" if len(values) == 1 else f"{mid:.2f} ({values[0]:.2f}-{values[-1]:.2f})"

    rows = ["| fault | runs | detected in s | recovered in s | failed jobs | deadline misses "
            "| wrong bytes | lost blocks / checked |", "|---|---|---|---|---|---|---|---|"]
    by_fault: dict[str, list[FaultResult]] = {}
    for result in results:
        by_fault.setdefault(result.fault, []).append(result)
    for fault, runs in by_fault.items():
        detected = [r.detected_s for r in runs if r.detected_s is not None]
        recovered = [r.recovered_s for r in runs if r.recovered_s is not None]
        rows.append(
            f"| {fault} | {len(runs)} | {spread(detected)} | {spread(recovered)} "
            f"| {sum(r.failed_jobs for r in runs)} | {sum(r.deadline_misses for r in runs)} "
            f"| {sum(r.wrong_bytes for r in runs)} | {sum(r.lost_blocks for r in runs)} / "
            f"{sum(r.checked_blocks for r in runs)} |")
    return rows


@dataclass
class NodeUnderTest:
    """A supervised node and everything the fault tests drive it with."""

    node: SupervisedNode
    kv: EngineKV
    recorder: Recorder
    requests: list[list[bytes]]
    seed: int
    rng: random.Random
    disk_root: Path | None = None
    s3: Any = None  # the S3Server the s3 tier talks to (through `proxy`)
    proxy: Any = None
    interval_s: float = 0.05
    monitor: Driver = field(init=False)  # stats only: it never steps, so takes no events
    position: int = 0  # where the replay goes on

    def __post_init__(self) -> None:
        self.monitor = Driver(self.node.config, None, self.recorder, timeout=1.0)

    @property
    def config(self) -> Config:
        return self.node.config

    def register(self) -> None:
        """The engine hands its KV cache to the workers (again, after they all died)."""
        self.kv.register(self.monitor.client)

    def close(self) -> None:
        self.monitor.close()

    def stats(self) -> dict[str, Any] | None:
        return self.monitor.stats()

    def peer_listed(self, pid: int) -> bool | None:
        stats = self.stats()
        return None if stats is None else any(p["pid"] == pid for p in stats["peers"])

    def peer_ready(self, kind: str, name: str, not_pid: int = 0) -> bool:
        """A process other than `not_pid` serves `name` (a rank with its KV cache, a
        tier with its whole inventory reported)."""
        stats = self.stats()
        if stats is None:
            return False
        ready = any(p["kind"] == kind and p["name"] == name and p["pid"] != not_pid
                    and p["state"] == "ready" and p.get("kv_attached", True)
                    for p in stats["peers"])
        if kind == "tier":
            ready = ready and stats["tiers"][name]["available"]
        return ready

    def all_ready(self) -> bool:
        """Every rank and tier served, by exactly the processes the supervisor runs: no
        session of a dead or replaced process is still listed (it would be fenced
        later, killing the pid that now serves a new session)."""
        ranks = [f"rank{r}" for r in range(self.config.cpu.world_size)]
        if not (all(self.peer_ready("worker", r) for r in ranks)
                and all(self.peer_ready("tier", t) for t in self.config.tier_names)):
            return False
        stats, pids = self.stats(), self.node.pids()
        if stats is None:
            return False
        listed = sorted(p["pid"] for p in stats["peers"])
        return listed == sorted(pid for name, pid in pids.items() if name != "broker")

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout}s (seed {self.seed})\n"
                                     f"{self.node.log_tail(30)}")
            time.sleep(0.05)

    def failures(self) -> Counter[str] | None:
        """Failed jobs the broker counted, by "tier:cause" ("gpu:transfer" for workers),
        and the peers it fenced ("broker:fenced")."""
        stats = self.stats()
        if stats is None:
            return None
        out: Counter[str] = Counter()
        for name, tier in stats["tiers"].items():
            for cause, n in tier["failures"].items():
                out[f"{name}:{cause}"] += int(n)
        out["gpu:transfer"] += int(stats["broker"]["transfers_failed"])
        out["broker:fenced"] += int(stats["broker"]["peers_fenced"])
        return out


class FaultRun:
    """Measures one fault under load:

        with FaultRun(nut, "worker SIGKILL") as run:
            run.inject(lambda: ...)             # at a random point of the load
            run.detected(lambda: ...)           # polled: detected in
            run.recovered(lambda: ...)          # polled, with a probe round trip
        run.result                              # also in harness.RESULTS

    On exit the load stops, the disk blocks reported stored before the fault are
    looked up again (and read from the slab files), and the figures are computed."""

    def __init__(self, nut: NodeUnderTest, fault: str, check_disk: bool = True,
                 broker_survives: bool = True, settle_s: float = 1.0) -> None:
        self.nut = nut
        self.result = FaultResult(fault, nut.seed)
        self.check_disk = check_disk and nut.disk_root is not None
        self.broker_survives = broker_survives
        self.settle_s = settle_s
        self.t0 = 0.0
        self.held_at_fault: set[bytes] = set()
        self.mark = 0  # the recorder's count of events at the fault
        self.extra = Tally()  # the checker's calls
        self.errors: list[str] = []
        self._failed_before: Counter[str] | None = None
        self._monitor_late = nut.monitor.tally.late_calls
        # Round trips with fresh keys, from the test's thread: the recovery check.
        self.probe = Driver(nut.config, nut.kv, nut.recorder, PROBE_BLOCKS)

    def __enter__(self) -> FaultRun:
        nut = self.nut
        self._failed_before = nut.failures()
        self._pids_before = nut.node.pids()
        self.load = LoadGen(Driver(nut.config, nut.kv, nut.recorder, LOAD_BLOCKS),
                            nut.requests, nut.interval_s, start=nut.position)
        self.load.start()
        return self

    def inject(self, fault: Callable[[], Any], warmup: tuple[float, float] = (0.5, 2.0)) -> Any:
        """Let the load run for a random while (seeded), then inject."""
        delay = self.nut.rng.uniform(*warmup)
        time.sleep(delay)
        self.result.injected_after_s = round(delay, 2)
        self.held_at_fault = self.nut.recorder.disk_held()
        self.mark = self.nut.recorder.mark()
        self.t0 = time.monotonic()
        return fault()

    def since(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def detected(self, predicate: Callable[[], Any], timeout: float = 30.0) -> None:
        self.nut.wait(predicate, timeout, f"{self.result.fault}: detection")
        self.result.detected_s = self.since()

    def mark_detected(self, at: float | None) -> None:
        """Detection seen by a client (its first BrokerUnavailable), at monotonic `at`."""
        self.result.detected_s = None if at is None else round(at - self.t0, 2)

    def recovered(self, predicate: Callable[[], Any] | None = None,
                  timeout: float = 60.0) -> None:
        """Recovered: a full store, lookup, load round trip with fresh keys returns the
        right bytes, and then `predicate` holds (the victim is back)."""
        def back() -> bool:
            try:
                ok = self.probe.round_trip()
            except (BrokerUnavailable, RemoteError):
                return False
            return ok and (predicate is None or bool(predicate()))

        self.nut.wait(back, timeout, f"{self.result.fault}: recovery")
        self.result.recovered_s = self.since()

    def maybe_detected(self, predicate: Callable[[], Any], timeout: float) -> bool:
        """Like `detected`, for faults that may pass unnoticed (slowness within every
        deadline): False, and no figure, if nothing was detected within `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                self.result.detected_s = self.since()
                return True
            time.sleep(0.05)
        return False

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        nut = self.nut
        time.sleep(self.settle_s if exc_type is None else 0)
        load = self.load.stop()
        nut.position = self.load.position
        self.load.driver.close()
        self.probe.close()
        if exc_type is not None:
            return
        self.extra.add(self.probe.tally)
        if self.check_disk:
            self._check_disk()
        self._figures(load)
        RESULTS.append(self.result)

    def _check_disk(self) -> None:
        """Every key reported stored on disk before the fault, and not evicted since,
        must be found again: whole in the slab files (all of them), and promoted back
        by a lookup with its own bytes (a seeded sample: a lookup costs a round trip)."""
        nut = self.nut
        assert nut.disk_root is not None
        checker = Driver(nut.config, nut.kv, nut.recorder, PROBE_BLOCKS)
        try:
            # Cascades still in flight may evict (a tier at its limit): let them land
            # and their "removed" events arrive before deciding what must be there.
            quiesce(nut, checker)
            expected_keys = sorted(self.held_at_fault - nut.recorder.removed_since(self.mark))
            sample = sorted(nut.rng.sample(expected_keys,
                                           min(CHECK_SAMPLE, len(expected_keys))))
            not_found = find_again(nut, checker, sample)
            on_disk, wrong_on_disk = keys_on_disk(nut.disk_root, nut.config.namespace)
            not_on_disk = set(expected_keys) - on_disk
            quiesce(nut, checker)
            evicted = nut.recorder.removed_since(self.mark)  # evicted, and said so: not lost
            not_found -= evicted
            not_on_disk -= evicted
        finally:
            checker.close()
        self.extra.add(checker.tally)
        self.result.checked_blocks = len(expected_keys)
        self.result.lost_blocks = len(not_found | not_on_disk)
        self.result.wrong_bytes += wrong_on_disk
        if not_on_disk:
            self.result.notes += (f" {len(not_on_disk)} not on disk, e.g. "
                                  f"{sorted(not_on_disk)[:3]};")
        if not_found:
            self.result.notes += (f" {len(not_found)} of {len(sample)} not found by a "
                                  f"lookup, e.g. {sorted(not_found)[:3]};")

    def _figures(self, load: Tally) -> None:
        r = self.result
        total = Tally()
        total.add(load)
        total.add(self.extra)
        r.requests, r.requests_ok = load.requests, load.requests_ok
        r.blocks_verified = total.verified
        r.wrong_bytes += total.wrong_bytes
        r.deadline_misses = total.late_calls + (self.nut.monitor.tally.late_calls
                                                - self._monitor_late)
        r.client_unavailable = total.unavailable
        after = self.nut.failures() or Counter()
        if self.broker_survives and self._failed_before is not None:
            after.subtract(self._failed_before)
        # else: a new broker, whose counters started at its restart
        r.fenced = max(0, after.pop("broker:fenced", 0))
        causes = {k: v for k, v in after.items() if v > 0}
        # Transfer failures are in both tallies (the broker's and the client's): count
        # the client's failed and lost jobs, plus the tier jobs only the broker sees.
        r.failed_jobs = total.jobs_failed + total.jobs_lost + max(
            0, sum(causes.values()) - total.jobs_failed)
        r.jobs_lost = total.jobs_lost
        r.slowest_call_s = round(max(total.max_call_s, self.nut.monitor.tally.max_call_s), 2)
        if causes:
            r.notes += " failed: " + ", ".join(f"{k} {v}" for k, v in sorted(causes.items()))
        if total.late:
            r.notes += "; late: " + "; ".join(total.late[:3])
        after_pids = self.nut.node.pids()
        restarted = sorted(n for n, pid in self._pids_before.items() if after_pids.get(n) != pid)
        r.restarted = ", ".join(restarted)
        self.errors = total.errors

    def check(self, lost_jobs_ok: bool = False) -> FaultResult:
        """The issue's bounds: no call past its deadline, no wrong byte, no lost block;
        and no job left without a result unless its broker died with it."""
        r = self.result
        print(r.row(), r.notes)
        assert r.deadline_misses == 0, f"client calls past their deadline: {r}"
        assert r.wrong_bytes == 0, f"blocks served with wrong bytes: {r}"
        assert r.lost_blocks == 0, f"disk blocks lost: {r}"
        assert lost_jobs_ok or r.jobs_lost == 0, f"jobs left without a result: {r}"
        assert not self.errors, f"unexpected errors in the load: {self.errors[:5]} ({r})"
        return r


def quiesce(nut: NodeUnderTest, driver: Driver, timeout: float = 20.0) -> None:
    """Step until no tier job is queued or in flight, then once more (events)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        driver.step()
        stats = nut.stats()
        if stats is not None and stats["tiering"]["cascades_in_flight"] == 0 and all(
                t["in_flight"] == 0 and t["queued"] == 0 for t in stats["tiers"].values()):
            break
        time.sleep(0.02)
    driver.step()


def find_again(nut: NodeUnderTest, driver: Driver, keys: list[bytes],
               chunk: int = 8) -> set[bytes]:
    """Look `keys` up in chunks (a key held by a tier is promoted back), load the hits
    and compare their bytes. Returns the keys no tier served. A lookup that stopped
    because the CPU tier had no room for a promotion (blocks leased to requests a
    fault cut short) is asked again: that is a busy cache, not a lost block."""
    def refused() -> int:
        stats = nut.stats()
        return -1 if stats is None else int(stats["tiering"]["promotions_refused"])

    missing: set[bytes] = set()
    todo = list(keys)
    n = 0
    while todo:
        part, todo = todo[:chunk], todo[chunk:]
        deadline = time.monotonic() + 30.0
        while True:
            n += 1
            before = refused()
            hits = driver.lookup(part, f"check{n}", pending_s=10.0)
            loaded = (driver.load_checked(part[:hits], driver.blocks[:hits], f"check{n}")
                      if hits else True)
            driver.finish(f"check{n}")
            busy = loaded is not True or (hits < len(part) and refused() != before)
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if hits < len(part):
            missing.add(part[hits])
            todo = part[hits + 1 :] + todo
    return missing


@contextlib.contextmanager
def stopped(node: SupervisedNode, pid: int) -> Iterator[None]:
    """SIGSTOP `pid` for the block's duration (SIGCONT even if the block fails)."""
    node.send(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if not gone(pid):
            node.send(pid, signal.SIGCONT)


@contextlib.contextmanager
def running_node(instance: str, work: Path, tiers: list[dict[str, Any]], seed: int,
                 disk_root: Path | None = None, s3: Any = None, proxy: Any = None,
                 env: dict[str, str] | None = None) -> Iterator[NodeUnderTest]:
    """A supervised node with the engine's KV cache registered, serving fully; at
    exit everything is stopped by pid and nothing may be left behind."""
    from tests.integration.cluster import leftovers

    config = fault_config(instance, work / "run", tiers)
    node = SupervisedNode(config, work, env=env)
    kv: EngineKV | None = None
    nut: NodeUnderTest | None = None
    try:
        node.start()
        kv = EngineKV(instance)
        nut = NodeUnderTest(node, kv, Recorder(), replayed_requests(3000, seed), seed,
                            random.Random(seed), disk_root=disk_root, s3=s3, proxy=proxy)
        nut.register()
        nut.wait(nut.all_ready, 60, "node ready")
        yield nut
    finally:
        if nut is not None:
            nut.close()
        code = node.stop()
        if kv is not None:
            kv.close()
    assert code == 0, f"the supervisor exited with {code}:\n{node.log_tail()}"
    assert leftovers(config.run_path, instance) == []
