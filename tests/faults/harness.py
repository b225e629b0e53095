"""Fault-injection harness: a supervised node, the engine's KV cache, a steady
replayed load that checks every byte it loads, and the figures of docs/reliability.md
(detected in, recovered in, failed jobs, deadline misses, wrong bytes, lost blocks).

Why a supervisor subprocess: faults are real signals to real processes, and only
a supervisor restarts what dies, so the node under test is the one `tierkv up`
runs. Why a `Recorder` that listens to the broker's events socket: a client hears
only of the blocks it stored, and the load's client stops stepping before the disk
tier reports its last evictions, so "stored on disk" reports taken from the clients
would miss some and blocks would look lost (or lost ones would go unnoticed).
"""

from __future__ import annotations

import contextlib
import random
import signal
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.faults.load import (
    CHECK_SAMPLE,
    LOAD_BLOCKS,
    PROBE_BLOCKS,
    Driver,
    EngineKV,
    LoadGen,
    Recorder,
    Tally,
    replayed_requests,
)
from tests.faults.node import SupervisedNode, fault_config, gone, keys_on_disk
from tierkv.client import BrokerUnavailable, RemoteError
from tierkv.node.config import Config

RESULTS: list[FaultResult] = []  # every fault measured in this session (conftest prints them)


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
    monitor: Driver = field(init=False)  # stats only: it never steps
    position: int = 0  # where the replay goes on

    def __post_init__(self) -> None:
        self.monitor = Driver(self.node.config, None, self.recorder, timeout=1.0)
        self.recorder.listen(self.node.config.broker.events_address)

    @property
    def config(self) -> Config:
        return self.node.config

    def register(self) -> None:
        """The engine hands its KV cache to the workers (again, after they all died)."""
        self.kv.register(self.monitor.client)

    def close(self) -> None:
        self.monitor.close()
        self.recorder.close()

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
