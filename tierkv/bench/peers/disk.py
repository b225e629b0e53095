"""The disk sections of `tierkv bench peers`: store and cold load, restart
recovery, integrity, and disk use against the bound.

Every system writes into a fresh directory under `--disk-dir`, one after another,
the order rotating from repeat to repeat. Cold reads are made cold the same way
for all, by this process between a store and its load:
`tierkv.bench.disk_io.drop_caches` (sync, then `/proc/sys/vm/drop_caches`, or
`posix_fadvise(DONTNEED)` on every file).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.bench.common import human
from tierkv.bench.peers.procs import DriverError
from tierkv.bench.peers.rows import HIGHER, LOWER
from tierkv.bench.peers.session import (
    KIB,
    MIB,
    OP_TIMEOUT_S,
    DiskSystem,
    Session,
    comparison,
    disk_systems,
    result,
)

# -- store and cold load, restart ----------------------------------------------------------


@dataclass
class DiskSamples:
    store_durable: list[float] = field(default_factory=list)
    store_plain: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    error: str | None = None


def _cold(directory: Path) -> str:
    from tierkv.bench.disk_io import drop_caches

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
    from tierkv.bench.disk_io import fs_type

    return fs_type(path)


# -- integrity ------------------------------------------------------------------------------


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


# -- disk use against the bound -------------------------------------------------------------


def _allocated(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def run_bound(s: Session) -> None:
    # More blocks than one job of 32 keys: a job cannot evict its own keys.
    bound = 40 if s.opts.quick else 100
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


