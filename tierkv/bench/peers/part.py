"""`tierkv bench peers`: the run. Builds (or reuses) the peers' environment, starts
one driver process per system, makes every system do the same work in the same
run, and turns the record into rows (`rows.build_rows`).

Sections, in order (each checks the part's budget before it starts):

1. disk: store (durable / without syncs) and cold load of 1000 blocks at 256 KiB
   and 2 MiB in the same directory, every system in turn in every repeat (the
   order rotates); restart recovery in a fresh process over the stored directory.
2. integrity: a flipped, a truncated and a swapped block, read back.
3. manager: requests per second through each manager, driven as its scheduler
   drives it (`drivers.common.manager_requests`: 5000 requests x 64 keys, 16k
   blocks).
4. policies: hit ratios on the same traces (the Mooncake conversation trace and
   `tierkv.workload`'s presets), the three drivers replaying at the same time
   (a hit ratio does not depend on speed).
5. cpu: LMCache's CPU backend store/retrieve beside tierkv's CPU tier.
6. bound: disk use after storing 3x the configured bound.

Cold reads are made cold the same way for every system, by the parent between a
store and its load: `scripts.bench_disk.drop_caches` (sync, then
`/proc/sys/vm/drop_caches`, or `posix_fadvise(DONTNEED)` on every file).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.bench.common import Options, Part
from tierkv.bench.peers import env as peer_env
from tierkv.bench.peers.procs import Driver, DriverError, Unsupported
from tierkv.bench.peers.rows import HIGHER, LOWER, comparison_rows, policy_table

KIB, MIB = 1 << 10, 1 << 20
OP_TIMEOUT_S = 600.0
MODULES = {"tierkv": "tierkv.bench.peers.drivers.tierkv_driver",
           "lmcache": "tierkv.bench.peers.drivers.lmcache_driver",
           "vllm": "tierkv.bench.peers.drivers.vllm_driver"}


@dataclass(frozen=True)
class DiskSystem:
    system: str  # driver
    kind: str  # the driver's disk system
    label: str
    syncs: bool  # does it make stores durable by itself?


def disk_systems(versions: dict[str, str]) -> list[DiskSystem]:
    lm, vl = versions.get("lmcache", "0.5.6"), versions.get("vllm", "0.33.0")
    return [
        DiskSystem("tierkv", "disk", "tierkv disk tier", True),
        DiskSystem("lmcache", "disk", f"LMCache {lm} local disk backend", False),
        DiskSystem("lmcache", "fs", f"LMCache {lm} fs connector", False),
        DiskSystem("vllm", "fs", f"vLLM {vl} fs tier", False),
    ]


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


@dataclass
class Session:
    """The run's drivers (started on first use), its scratch directory and record."""

    part: Part
    opts: Options
    env: peer_env.PeerEnv
    work: Path
    logs: Path
    drivers: dict[str, Driver] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # driver that did not start
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    starts: int = 0

    def skip_reason(self, system: str) -> str | None:
        if system == "tierkv":
            return self.failed.get(system)
        if not self.env.usable(system):
            return self.env.skipped.get(system, "not installed")
        return self.failed.get(system)

    def start(self, system: str) -> Driver:
        import sys

        python = sys.executable if system == "tierkv" else self.env.python
        self.starts += 1
        return Driver(system, python, MODULES[system], self.env.process_env(),
                      self.logs / f"{self.starts:02d}-{system}.log")

    def driver(self, system: str) -> Driver | None:
        """The running driver of `system`, or None (with the reason recorded)."""
        if self.skip_reason(system):
            return None
        if system not in self.drivers:
            try:
                self.drivers[system] = self.start(system)
            except DriverError as e:
                self.failed[system] = f"driver did not start: {e}"
                self.part.note(f"{system}: {self.failed[system]}")
                return None
        return self.drivers[system]

    def close(self) -> None:
        for drv in self.drivers.values():
            drv.close()
        self.drivers.clear()

    def fresh_dir(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path


def result(label: str, samples: list[float] | None = None, *, key: str = "",
           skipped: str | None = None, error: str | None = None, note: str = "",
           headline: bool = True) -> dict[str, Any]:
    return {"label": label, "key": key, "samples": samples, "skipped": skipped,
            "error": error, "note": note, "headline": headline}


def comparison(cid: str, section: str, name: str, unit: str, better: str,
               tierkv: dict[str, Any], peers: list[dict[str, Any]], paired: bool = True,
               headline: bool = True, **extra: Any) -> dict[str, Any]:
    return {"id": cid, "section": section, "name": name, "unit": unit, "better": better,
            "paired": paired, "headline": headline, "tierkv": tierkv, "peers": peers,
            **extra}


# -- 1. disk --------------------------------------------------------------------------------


@dataclass
class DiskSamples:
    store_durable: list[float] = field(default_factory=list)
    store_plain: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    error: str | None = None


def _cold(directory: Path) -> str:
    from scripts.bench_disk import drop_caches

    return drop_caches([p for p in directory.rglob("*") if p.is_file()])


def _disk_round(s: Session, ds: DiskSystem, size: int, count: int, rep: int,
                out: DiskSamples, restart: dict[str, Any] | None) -> set[str]:
    """One system's durable store + cold load, and its store without syncs."""
    drv = s.driver(ds.system)
    assert drv is not None
    how: set[str] = set()
    nbytes = size * count
    for durable in (True, False):
        d = s.fresh_dir(f"disk-{ds.system}-{ds.kind}-{'sync' if durable else 'plain'}")
        tag = f"s{rep}"
        drv.call("disk_open", OP_TIMEOUT_S, system=ds.kind, dir=str(d), block_bytes=size,
                 capacity_blocks=2 * count, pool_blocks=count, durable=durable)
        stored = drv.call("disk_store", OP_TIMEOUT_S, tag=tag, count=count, seed=rep + 1,
                          sync=durable)
        (out.store_durable if durable else out.store_plain).append(
            nbytes / stored["seconds"] / 1e9)
        if durable:
            how.add(_cold(d))
            loaded = drv.call("disk_load", OP_TIMEOUT_S, tag=tag, count=count, seed=rep + 1)
            if loaded["bad"] or loaded["missing"]:
                raise DriverError(f"{ds.label} loaded {loaded['bad']} wrong and "
                                  f"{loaded['missing']} missing blocks")
            out.load.append(nbytes / loaded["seconds"] / 1e9)
        drv.call("disk_close", OP_TIMEOUT_S)
        if durable and restart is not None:
            restart[ds.label] = _recover(s, ds, d, size, count, tag)
        shutil.rmtree(d, ignore_errors=True)
    return how


def _recover(s: Session, ds: DiskSystem, directory: Path, size: int, count: int,
             tag: str) -> dict[str, Any]:
    """A fresh process of the same system over the directory just filled."""
    try:
        with s.start(ds.system) as fresh:
            return fresh.call("disk_recover", OP_TIMEOUT_S, system=ds.kind, dir=str(directory),
                              block_bytes=size, capacity_blocks=2 * count, tag=tag, count=count)
    except DriverError as e:
        return {"error": str(e)}


def run_disk(s: Session) -> None:
    opts = s.opts
    count = 64 if opts.quick else 1000
    sizes = [256 * KIB] if opts.quick else [256 * KIB, 2 * MIB]
    repeats = opts.pick(1, 3)
    systems = disk_systems(s.env.versions)
    restart: dict[str, Any] = {}
    how: set[str] = set()
    s.part.note(f"disk: {count} blocks per pass in {s.work} ({_fs_type(s.work)}), "
                f"{repeats} repeats, systems in rotating order")
    for size in sizes:
        if s.part.over_budget(f"disk {human(size)}"):
            break
        samples = {ds.label: DiskSamples() for ds in systems}
        for rep in range(repeats):
            if rep and s.part.over_budget(f"disk {human(size)} repeats {rep + 1}-{repeats}"):
                break
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for ds in order:
                out = samples[ds.label]
                if out.error or s.driver(ds.system) is None:
                    continue
                wants_restart = restart if (rep == 0 and size == sizes[0]) else None
                try:
                    how |= _disk_round(s, ds, size, count, rep, out, wants_restart)
                except DriverError as e:
                    out.error = str(e)
                    s.part.note(f"{ds.label}: {e}")
        _disk_comparisons(s, systems, samples, size, count)
    if restart:
        _restart_comparisons(s, systems, restart, sizes[0], count)
    if how:
        s.part.note("page cache emptied before every load with: " + "; ".join(sorted(how)))


def _disk_comparisons(s: Session, systems: list[DiskSystem], samples: dict[str, DiskSamples],
                      size: int, count: int) -> None:
    label = human(size)
    ours = samples[systems[0].label]
    peers = systems[1:]
    kinds = [
        ("store", "durable", "store_durable", f"disk store {label} x {count}, durable",
         "tierkv flushes once per job (fdatasync)",
         "+ fdatasync of every file it wrote, from as many threads as it writes with"),
        ("store", "plain", "store_plain", f"disk store {label} x {count}, no syncs",
         "durable=False", "as shipped (no sync)"),
        ("load", "cold", "load", f"disk load {label} x {count}, cold", "", ""),
    ]
    for what, variant, attr, name, our_note, peer_note in kinds:
        peer_rows = []
        for ds in peers:
            out = samples[ds.label]
            skip = s.skip_reason(ds.system)
            peer_rows.append(result(
                ds.label, getattr(out, attr) or None, key=f"{ds.system}:{ds.kind}",
                skipped=skip, error=None if skip else (out.error or (
                    None if getattr(out, attr) else "no samples")), note=peer_note))
        s.comparisons.append(comparison(
            f"disk.{what}.{label.replace(' ', '')}.{variant}", "disk", name, "GB/s", HIGHER,
            result(systems[0].label, getattr(ours, attr) or None, key="tierkv",
                   error=ours.error, note=our_note),
            peer_rows))


def _restart_comparisons(s: Session, systems: list[DiskSystem], restart: dict[str, Any],
                         size: int, count: int) -> None:
    ours = restart.get(systems[0].label, {"error": "not measured"})
    found_rows, time_rows = [], []
    for ds in systems[1:]:
        got = restart.get(ds.label)
        skip = s.skip_reason(ds.system)
        key = f"{ds.system}:{ds.kind}"
        if got is None or skip or "error" in got:
            why = skip or (got or {}).get("error") or "not measured"
            found_rows.append(result(ds.label, key=key, skipped=skip,
                                     error=None if skip else why))
            continue
        found_rows.append(result(ds.label, [float(got["found"])], key=key))
        if got["found"]:
            time_rows.append(result(ds.label, [got["seconds"] * 1e3], key=key,
                                    note=f"found {got['found']} of {count}"))
        else:
            time_rows.append(result(ds.label, key=key,
                                    skipped=f"found none of {count}: nothing to time"))
    our_found = [float(ours["found"])] if "found" in ours else None
    s.comparisons.append(comparison(
        "disk.restart.found", "disk", f"restart: blocks found of {count} ({human(size)})",
        "blocks", HIGHER, result(systems[0].label, our_found, key="tierkv",
                                 error=ours.get("error")), found_rows, paired=False))
    our_ms = [ours["seconds"] * 1e3] if "seconds" in ours else None
    s.comparisons.append(comparison(
        "disk.restart.time", "disk", f"restart: time to find them ({human(size)})", "ms",
        LOWER, result(systems[0].label, our_ms, key="tierkv", error=ours.get("error"),
                      note="scan of slot headers at start"), time_rows, paired=False))


def _fs_type(path: Path) -> str:
    from scripts.bench_disk import fs_type

    return fs_type(path)


# -- 2. integrity -----------------------------------------------------------------------


def run_integrity(s: Session) -> None:
    systems = disk_systems(s.env.versions)
    found: dict[str, dict[str, Any]] = {}
    for ds in systems:
        drv = s.driver(ds.system)
        if drv is None:
            continue
        d = s.fresh_dir(f"integrity-{ds.system}-{ds.kind}")
        try:
            found[ds.label] = drv.call("integrity", OP_TIMEOUT_S, system=ds.kind, dir=str(d),
                                       block_bytes=256 * KIB)
        except DriverError as e:
            found[ds.label] = {"error": str(e)}
        shutil.rmtree(d, ignore_errors=True)

    def entry(ds: DiskSystem) -> dict[str, Any]:
        key = "tierkv" if ds.system == "tierkv" else f"{ds.system}:{ds.kind}"
        skip = s.skip_reason(ds.system)
        got = found.get(ds.label)
        if skip or got is None or "error" in got:
            return result(ds.label, key=key, skipped=skip,
                          error=None if skip else (got or {}).get("error", "not measured"))
        detected = sum(got[m]["outcome"] == "detected" for m in ("flip", "truncate", "swap"))
        who = "tierkv" if ds.system == "tierkv" else "peer"
        note = f"{who}: " + ", ".join(f"{m} {got[m]['outcome']}"
                                      for m in ("flip", "truncate", "swap"))
        return result(ds.label, [float(detected)], key=key, note=note)

    s.comparisons.append(comparison(
        "integrity", "integrity", "integrity: damaged blocks detected of 3 (flip, truncate, "
        "swap)", "detected", HIGHER, entry(systems[0]), [entry(ds) for ds in systems[1:]],
        paired=False, outcomes=found))


# -- 3. manager -----------------------------------------------------------------------------


def run_manager(s: Session) -> None:
    from tierkv.config import CpuConfig

    default = CpuConfig().policy
    quick = s.opts.quick
    repeats = s.opts.pick(1, 3)
    work = {"n_requests": 500 if quick else 5000, "keys_per_request": 64, "seed": 11,
            "capacity": 2000 if quick else 16_000}
    ours = {f"inprocess:{p}": ("inprocess", p) for p in dict.fromkeys(("lru", "arc", default))}
    ours[f"broker:{default}"] = ("broker", default)
    theirs = {"vllm:lru": "lru", "vllm:arc": "arc"}
    seconds: dict[str, list[float]] = {k: [] for k in [*ours, *theirs]}
    errors: dict[str, str] = {}
    hits: dict[str, int] = {}
    s.part.note(f"manager: {work['n_requests']} requests x {work['keys_per_request']} keys, "
                f"{work['capacity']:,} blocks, {repeats} repeats")
    for rep in range(repeats):
        if rep and s.part.over_budget(f"manager repeats {rep + 1}-{repeats}"):
            break
        jobs: list[tuple[str, str, dict[str, Any]]] = [
            (k, "tierkv", {"mode": mode, "policy": p}) for k, (mode, p) in ours.items()]
        jobs += [(k, "vllm", {"policy": p}) for k, p in theirs.items()]
        jobs = jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]
        for key, system, args in jobs:
            drv = s.driver(system)
            if drv is None or key in errors:
                continue
            try:
                got = drv.call("manager_rps", OP_TIMEOUT_S, repeats=1, **work, **args)
            except DriverError as e:
                errors[key] = str(e)
                continue
            seconds[key] += got["seconds"]
            hits[key] = got["hits"]

    def rps(key: str) -> list[float] | None:
        return [work["n_requests"] / x for x in seconds[key]] or None

    vl = s.env.versions.get("vllm", "0.33.0")

    def peer(key: str, note: str = "") -> dict[str, Any]:
        skip = s.skip_reason("vllm")
        return result(f"vLLM {vl} CPUOffloadingManager ({key.split(':')[1]})", rps(key),
                      key=key, skipped=skip, error=None if skip else errors.get(key),
                      note=f"vLLM {hits[key]:,} key hits" if key in hits else note)

    def ours_result(key: str, label: str) -> dict[str, Any]:
        return result(label, rps(key), key="tierkv", error=errors.get(key),
                      note=f"tierkv {hits[key]:,} key hits" if key in hits else "")

    for p in ("lru", "arc"):
        s.comparisons.append(comparison(
            f"manager.inprocess.{p}", "manager", f"manager in process, {p}", "requests/s",
            HIGHER, ours_result(f"inprocess:{p}", f"tierkv TieringManager ({p})"),
            [peer(f"vllm:{p}")]))
    if default not in ("lru", "arc"):
        s.comparisons.append(comparison(
            f"manager.inprocess.{default}", "manager",
            f"manager in process, tierkv default ({default})", "requests/s", HIGHER,
            ours_result(f"inprocess:{default}", f"tierkv TieringManager ({default})"),
            [peer("vllm:lru"), peer("vllm:arc")]))
    s.comparisons.append(comparison(
        f"manager.broker.{default}", "manager", f"manager through the broker ({default})",
        "requests/s", HIGHER,
        ours_result(f"broker:{default}", f"tierkv broker + Client.batch ({default})"),
        [peer("vllm:lru"), peer("vllm:arc")]))


# -- 4. policies ----------------------------------------------------------------------------


def _trace_files(s: Session) -> list[tuple[str, Path, tuple[int, ...]]]:
    """(name, Mooncake-format file, capacities): the conversation trace when
    present, then the synthetic presets written out as traces."""
    from scripts.bench_policies import DEFAULT_TRACE
    from tierkv.workload import PRESETS, generate_workload

    quick = s.opts.quick
    out = []
    trace = s.opts.trace or DEFAULT_TRACE
    if trace.exists():
        out.append(("conversation", trace, (100, 400) if quick else (1000, 4000, 16000)))
    else:
        s.part.note(f"trace {trace} not found: the conversation trace is not replayed "
                    "(--trace PATH)")
    for name in PRESETS:
        path = s.work / f"workload-{name}.jsonl"
        with open(path, "w") as f:
            for r in generate_workload(name, 300 if quick else 6000, seed=0):
                f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                    "output_length": r.output_length,
                                    "hash_ids": list(r.hash_ids)}) + "\n")
        out.append((name, path, (400,) if quick else (4000,)))
    return out


def run_policies(s: Session) -> None:
    from tierkv.config import CpuConfig
    from tierkv.policies import known_policies

    default = CpuConfig().policy
    ours = sorted(known_policies(), key=lambda p: p != default)
    theirs = {"vllm": ("lru", "arc"), "lmcache": ("lru", "lfu", "fifo", "mru")}
    traces = _trace_files(s)
    plan: dict[str, list[tuple[str, str, int]]] = {"tierkv": [], "vllm": [], "lmcache": []}
    for _name, path, capacities in traces:
        for capacity in capacities:
            plan["tierkv"] += [(p, str(path), capacity) for p in ours]
            for system, policies in theirs.items():
                plan[system] += [(p, str(path), capacity) for p in policies]
    ratios: dict[tuple[str, str, str, int], float] = {}
    errors: dict[str, str] = {}

    def replay(system: str) -> None:
        drv = s.driver(system)
        if drv is None:
            return
        for policy, path, capacity in plan[system]:
            try:
                got = drv.call("hit_ratio", OP_TIMEOUT_S, trace=path, capacity=capacity,
                               policy=policy)
            except DriverError as e:
                errors[system] = str(e)
                return
            ratios[(system, policy, path, capacity)] = got["hit_ratio"]

    for system in plan:  # start them here: a driver's start is not thread-safe
        s.driver(system)
    t0 = time.monotonic()
    threads = [threading.Thread(target=replay, args=(system,)) for system in plan]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    s.part.note(f"policies: {len(traces)} traces replayed by the three drivers at once in "
                f"{time.monotonic() - t0:.0f} s")
    labels = {"vllm": f"vLLM {s.env.versions.get('vllm', '0.33.0')}",
              "lmcache": f"LMCache {s.env.versions.get('lmcache', '0.5.6')}"}
    for name, path, capacities in traces:
        for capacity in capacities:
            peers = []
            for system, policies in theirs.items():
                skip = s.skip_reason(system)
                for p in policies:
                    got = ratios.get((system, p, str(path), capacity))
                    peers.append(result(
                        f"{labels[system]} {p}", None if got is None else [got],
                        key=f"{system}:{p}", skipped=skip,
                        error=None if skip or got is not None else errors.get(system,
                                                                               "missing")))
            for p in ours:
                got = ratios.get(("tierkv", p, str(path), capacity))
                mark = " (default)" if p == default else ""
                s.comparisons.append(comparison(
                    f"policy.{name}.{capacity}.{'default.' if p == default else ''}{p}",
                    "policies",
                    f"hit ratio, {name} @ {capacity:,} blocks, tierkv {p}{mark}", "", HIGHER,
                    result(f"tierkv {p}{mark}", None if got is None else [got], key="tierkv",
                           error=None if got is not None else errors.get("tierkv", "missing")),
                    peers, paired=False,
                    headline=p == default and name == "conversation" and capacity == 4000,
                    column=f"{name}@{capacity}"))


# -- 5. CPU tier ----------------------------------------------------------------------------


def run_cpu(s: Session) -> None:
    count = 64 if s.opts.quick else 1000
    repeats = s.opts.pick(2, 3)
    size = 256 * KIB
    got: dict[str, dict[str, Any]] = {}
    for system in ("tierkv", "lmcache"):
        drv = s.driver(system)
        if drv is None:
            continue
        try:
            got[system] = drv.call("cpu_tier", OP_TIMEOUT_S, block_bytes=size, count=count,
                                   repeats=repeats, seed=5)
        except DriverError as e:
            got[system] = {"error": str(e)}
    nbytes = size * count
    lm = s.env.versions.get("lmcache", "0.5.6")
    for what, attr, our_label, their_label in (
            ("store", "store_s", "tierkv CPU tier via broker + CPU worker",
             f"LMCache {lm} CPU backend (allocate, copy in, batched_put)"),
            ("retrieve", "load_s", "tierkv CPU tier via broker + CPU worker",
             f"LMCache {lm} CPU backend (batched_get, copy out)")):

        def side(system: str, label: str, attr: str = attr) -> dict[str, Any]:
            skip = s.skip_reason(system)
            run = got.get(system, {})
            samples = [nbytes / x / 1e9 for x in run.get(attr, [])] or None
            return result(label, samples, key=system if system == "tierkv" else "lmcache:cpu",
                          skipped=skip, error=None if skip or samples else run.get(
                              "error", "not measured"))

        s.comparisons.append(comparison(
            f"cpu.{what}", "cpu", f"CPU tier {what} {human(size)} x {count}", "GB/s", HIGHER,
            side("tierkv", our_label), [side("lmcache", their_label)], paired=False))


# -- 6. bound -------------------------------------------------------------------------------


def _allocated(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def run_bound(s: Session) -> None:
    bound = 16 if s.opts.quick else 100
    size = 256 * KIB
    systems = disk_systems(s.env.versions)
    used: dict[str, float | str] = {}
    for ds in systems:
        drv = s.driver(ds.system)
        if drv is None:
            continue
        d = s.fresh_dir(f"bound-{ds.system}-{ds.kind}")
        try:
            drv.call("disk_open", OP_TIMEOUT_S, system=ds.kind, dir=str(d), block_bytes=size,
                     capacity_blocks=bound, pool_blocks=bound)
            for batch in range(3):
                drv.call("disk_store", OP_TIMEOUT_S, tag="bound", count=bound, seed=3,
                         first=batch * bound)
            drv.call("disk_close", OP_TIMEOUT_S)
            used[ds.label] = _allocated(d) / (bound * size)
        except DriverError as e:
            used[ds.label] = str(e)
        shutil.rmtree(d, ignore_errors=True)

    def entry(ds: DiskSystem) -> dict[str, Any]:
        key = "tierkv" if ds.system == "tierkv" else f"{ds.system}:{ds.kind}"
        skip = s.skip_reason(ds.system)
        got = used.get(ds.label)
        if skip or not isinstance(got, float):
            return result(ds.label, key=key, skipped=skip,
                          error=None if skip else str(got or "not measured"))
        note = "no size bound to configure" if ds.system == "vllm" else ""
        return result(ds.label, [got], key=key, note=note)

    s.comparisons.append(comparison(
        "disk.bound", "disk", f"disk use after storing 3x a bound of {bound} blocks' bytes "
        f"({human(size)})", "x bound", LOWER, entry(systems[0]),
        [entry(ds) for ds in systems[1:]], paired=False))


# -- the part -------------------------------------------------------------------------------

SECTIONS: list[tuple[str, Callable[[Session], None]]] = [
    ("disk", run_disk), ("integrity", run_integrity), ("manager", run_manager),
    ("policies", run_policies), ("cpu", run_cpu), ("bound", run_bound),
]


@contextmanager
def _scratch(parent: Path) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="tierkv-peers-", dir=parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_part(part: Part, opts: Options) -> None:
    t0 = time.monotonic()
    try:
        env = peer_env.ensure(echo=part.out)
    except peer_env.EnvError as e:
        part.note(f"the peers' environment could not be built: {e}")
        env = peer_env.PeerEnv(peer_env.cache_root(), Path("/nonexistent"),
                               skipped={p: str(e) for p in peer_env.PINS})
    part.note(f"peers' environment {env.python.parent.parent}: "
              + (f"built and checked in {env.built_s:.0f} s" if env.built_s else
                 f"reused ({time.monotonic() - t0:.0f} s)"))
    for peer in peer_env.PINS:
        part.note(f"{peer}: " + (env.versions.get(peer) or f"skipped: {env.skipped[peer]}"))
    logs = env.root / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    with _scratch(opts.disk_dir) as work:
        session = Session(part, opts, env, work, logs)
        try:
            for name, section in SECTIONS:
                if part.over_budget(name):
                    continue
                done = len(session.comparisons)
                started = time.monotonic()
                section(session)
                part.note(f"{name}: {time.monotonic() - started:.0f} s")
                for item in session.comparisons[done:]:  # rows as they are measured
                    for row in comparison_rows(item):
                        part.add(row)
        finally:
            session.close()
    record = {"versions": {**env.versions, "tierkv": _tierkv_version()},
              "skipped": env.skipped, "load_avg_end": [round(x, 2) for x in os.getloadavg()],
              "comparisons": session.comparisons}
    path = env.root / "last-run.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    part.note(f"record of this run: {path}; driver logs: {logs}")
    table = policy_table(record)
    if table:
        part.note("hit ratios (trace@capacity):\n" + table)


def _tierkv_version() -> str:
    import tierkv

    return getattr(tierkv, "__version__", "?")


__all__ = ["Unsupported", "run_part"]
