#!/usr/bin/env python3
"""Disk tier figures: durable write and cold read throughput of the tier, as ratios
of plain `os.pwrite` + `fdatasync` and `os.preadv` of the same bytes into one
preallocated file on the same filesystem, in the same run (and `dd` for reference).

    python -m tierkv.bench.disk_io [--dir /var/tmp] [--total-mib 1024] [--sizes 256K,2M]
                                 [--threads 8] [--repeat 3]

The tier runs as in its process: a `DiskBackend` behind a `JobRunner` of I/O
threads, moving bytes straight between the slab files and rows of a real shared
memory region. Reads are cold: the page cache is dropped before each read pass
(`/proc/sys/vm/drop_caches`, root only; else `posix_fadvise(DONTNEED)` on the
files, and the table says which). Goal: >= 0.85 of the baseline for 2 MiB
blocks, >= 0.7 for 256 KiB.

`measure_size` is also what `tierkv bench disk` runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from tierkv.bench.common import human, parse_size, work_dir
from tierkv.core.shm import SharedRegion
from tierkv.tiers.base import Job, JobKind
from tierkv.tiers.runner import JobRunner
from workers.disk import DiskBackend, slot_bytes_for

GOAL = {256 * 1024: 0.7, 2 * 1024 * 1024: 0.85}
KEYS_PER_JOB = 32


@dataclass
class Row:
    size: int
    what: str
    gbps: float  # median over rounds
    base: float | None = None  # ratio to its baseline (median of per-round ratios)
    note: str = ""
    samples: list[float] = field(default_factory=list)  # GB/s, one per round
    ratios: list[float] = field(default_factory=list)  # to the baseline, one per round
    baseline: str = ""  # the `what` of the row this one is a ratio of


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, typ, *_ = line.split()
            if str(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


def drop_caches(files: list[Path]) -> str:
    """Empty the page cache before a read pass; says how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError as e:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return f"fadvise DONTNEED (drop_caches failed: {e.strerror})"


# -- baseline: one preallocated file, plain syscalls --------------------------------------


def baseline_write(path: Path, region: SharedRegion, count: int, fresh: bool) -> float:
    """Every block with one `pwrite`, then one `fdatasync`: the most a file can take.
    `fresh`: into a newly preallocated file (else over the blocks written before)."""
    size = region.block_bytes
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if fresh else 0), 0o600)
    try:
        if fresh:
            os.posix_fallocate(fd, 0, size * count)
            os.fdatasync(fd)
        t0 = time.perf_counter()
        for i in range(count):
            os.pwrite(fd, region.block(i), i * size)
        os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def baseline_read(path: Path, region: SharedRegion, count: int) -> float:
    size = region.block_bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        for i in range(count):
            os.preadv(fd, [region.block(i)], i * size)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


# -- the tier -----------------------------------------------------------------------------


def tier_pass(runner: JobRunner, count: int, kind: JobKind, tag: bytes) -> float:
    t0 = time.perf_counter()
    for start in range(0, count, KEYS_PER_JOB):
        rows = tuple(range(start, min(count, start + KEYS_PER_JOB)))
        runner.submit(Job(start, tuple(tag + r.to_bytes(4, "big") for r in rows), rows, kind))
    if not runner.drain(600):
        raise TimeoutError("tier jobs did not finish in 600 s")
    took = time.perf_counter() - t0
    failed = [r for r in runner.take_finished() if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} tier jobs failed: {failed[0].error}")
    return took


class Tier:
    """A fresh disk tier of exactly `count` slots, run as the tier process runs it."""

    def __init__(self, root: Path, region: SharedRegion, count: int, threads: int,
                 **options: object) -> None:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        self.backend = DiskBackend(str(root), count * slot_bytes_for(region.block_bytes),
                                   block_bytes=region.block_bytes, namespace="bench",
                                   **options)
        self.runner = JobRunner(self.backend, region, threads=threads)
        self.count = count

    def store(self, tag: bytes) -> float:
        return tier_pass(self.runner, self.count, JobKind.STORE, tag)

    def load(self, tag: bytes) -> float:
        return tier_pass(self.runner, self.count, JobKind.PROMOTION, tag)

    def close(self) -> None:
        self.runner.close()
        self.runner.rows = None
        self.backend.close()


@dataclass
class Round:
    """One measurement of everything, back to back, so that a disk whose speed drifts
    (shared or throttled virtual disks do) is compared with itself: ratios are taken
    within a round, then the median over rounds."""

    seconds: dict[str, float]
    syncs: dict[str, int]


def tier_store_once(work: Path, region: SharedRegion, count: int, threads: int,
                    o_direct: str | bool, **options: object) -> tuple[float, int]:
    """Seconds to fill a fresh tier, and the fdatasync calls it took."""
    tier = Tier(work / "tier", region, count, threads, o_direct=o_direct, **options)
    try:
        return tier.store(b"a-"), tier.backend.commit.syncs
    finally:
        tier.close()


def one_round(work: Path, region: SharedRegion, count: int, threads: int,
              o_direct: str | bool, cold: Callable[[list[Path], Callable[[], float]], float],
              per_key_first: bool) -> tuple[Round, bool]:
    """A flush per job (the default) and a flush per store take turns going first
    (the disk may favour whoever writes first into new slabs)."""
    t: dict[str, float] = {}
    syncs: dict[str, int] = {}
    plain = work / "baseline.dat"
    t["base_fresh"] = baseline_write(plain, region, count, fresh=True)
    t["base_over"] = baseline_write(plain, region, count, fresh=False)
    t["base_read"] = cold([plain], lambda: baseline_read(plain, region, count))
    plain.unlink()

    if not per_key_first:
        t["grouped"], syncs["grouped"] = tier_store_once(work, region, count, threads, o_direct)
    t["per_key"], syncs["per_key"] = tier_store_once(work, region, count, threads, o_direct,
                                                     sync_per="store")
    tier = Tier(work / "tier", region, count, threads, o_direct=o_direct)
    try:
        if per_key_first:
            t["grouped"] = tier.store(b"a-")
            syncs["grouped"] = tier.backend.commit.syncs
        else:
            tier.store(b"a-")
        t["grouped_full"] = tier.store(b"b-")  # evicts every block: slots are reused
        assert tier.backend.stats()["evictions"] == count
        slabs = sorted(tier.backend.directory.glob("slab-*.dat"))
        t["tier_read"] = cold(slabs, lambda: tier.load(b"b-"))
        direct = tier.backend.direct
    finally:
        tier.close()
    shutil.rmtree(work / "tier")
    return Round(t, syncs), direct


def bench_size(work: Path, region: SharedRegion, count: int, threads: int, repeat: int,
               dd: bool, o_direct: str | bool,
               deadline: float | None = None) -> tuple[list[Row], list[str]]:
    """`repeat` rounds (fewer once `time.monotonic()` passes `deadline`; at least
    one), then `dd` once."""
    size = region.block_bytes
    nbytes = size * count
    how: list[str] = []
    expected = [xxhash.xxh3_64_intdigest(region.block(i)) for i in range(count)]

    def cold(files: list[Path], read: Callable[[], float]) -> float:
        region.numpy()[:count] = 0
        how.append(drop_caches(files))
        took = read()
        bad = sum(xxhash.xxh3_64_intdigest(region.block(i)) != expected[i] for i in range(count))
        if bad:
            raise RuntimeError(f"{bad} blocks read back wrong")
        return took

    rounds: list[Round] = []
    direct = False
    for i in range(repeat):
        if rounds and deadline is not None and time.monotonic() > deadline:
            break
        rnd, direct = one_round(work, region, count, threads, o_direct, cold, i % 2 == 1)
        rounds.append(rnd)

    def row(what: str, name: str, base: str | None = None, base_what: str = "",
            note: str = "") -> Row:
        samples = [nbytes / r.seconds[name] / 1e9 for r in rounds]
        ratios = [r.seconds[base] / r.seconds[name] for r in rounds] if base else []
        return Row(size, what, statistics.median(samples),
                   statistics.median(ratios) if ratios else None, note, samples, ratios,
                   base_what)

    def syncs(name: str) -> str:
        return f"{statistics.median(r.syncs[name] for r in rounds):.0f} fdatasyncs"

    mode = "O_DIRECT" if direct else "buffered"
    fresh, over, read = ("baseline pwrite+fdatasync, new", "baseline pwrite+fdatasync, over",
                         "baseline preadv, cold")
    rows = [
        row(fresh, "base_fresh"),
        row("tier store, one flush per job", "grouped", "base_fresh", fresh,
            f"{mode}, {syncs('grouped')} for {count} blocks, new slabs"),
        row("tier store, flush per store", "per_key", "base_fresh", fresh,
            f"{mode}, {syncs('per_key')} (grouped), new slabs"),
        row(over, "base_over"),
        row("tier store, full tier", "grouped_full", "base_over", over,
            "flush per job, every store evicts"),
        row(read, "base_read"),
        row("tier load, cold", "tier_read", "base_read", read, f"{mode}, {threads} threads"),
    ]
    if dd:
        rows += run_dd(work / "dd.dat", size, count, how)
    return rows, how


def run_dd(path: Path, size: int, count: int, how: list[str]) -> list[Row]:
    if shutil.which("dd") is None:
        return []

    def dd(*args: str) -> float:
        out = subprocess.run(["dd", f"bs={size}", f"count={count}", *args],
                             capture_output=True, text=True, check=True).stderr
        m = re.search(r"copied, ([\d.,]+) s", out)
        if not m:
            raise RuntimeError(f"cannot read dd's output: {out!r}")
        return size * count / float(m.group(1).replace(",", ".")) / 1e9

    write = dd("if=/dev/zero", f"of={path}", "oflag=direct", "conv=fdatasync")
    rows = [Row(size, "dd oflag=direct conv=fdatasync", write, samples=[write])]
    how.append(drop_caches([path]))
    read = dd(f"if={path}", "of=/dev/null", "iflag=direct")
    rows.append(Row(size, "dd iflag=direct, cold", read, samples=[read]))
    path.unlink()
    return rows



def measure_size(work: Path, size: int, total: int, threads: int, repeat: int, dd: bool,
                 o_direct: str | bool,
                 deadline: float | None = None) -> tuple[list[Row], list[str]]:
    """Every figure for blocks of `size` bytes, `total` bytes per pass, in `work`:
    the rows, and how the page cache was dropped before each read pass."""
    count = total // size
    instance = f"bench{uuid.uuid4().hex[:8]}"
    with SharedRegion.create(instance, num_blocks=count, page_size=size) as region:
        try:
            data = region.numpy()
            for i in range(count):
                data[i, :size] = memoryview(os.urandom(size))
            del data  # no view may outlive the region
            return bench_size(work, region, count, threads, repeat, dd, o_direct, deadline)
        finally:
            region.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="a directory on the filesystem to measure")
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes moved per pass")
    parser.add_argument("--sizes", default="256K,2M", help="block sizes, comma separated")
    parser.add_argument("--threads", type=int, default=8, help="tier I/O threads")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--no-dd", action="store_true")
    parser.add_argument("--o-direct", choices=("auto", "true", "false"), default="auto",
                        help="the tier's o_direct option")
    args = parser.parse_args(argv)
    args.o_direct = {"auto": "auto", "true": True, "false": False}[args.o_direct]

    total = args.total_mib << 20
    all_how: list[str] = []
    verdicts: list[str] = []
    with work_dir(args.dir) as work:
        print(f"disk tier bench in {work} ({fs_type(work)}), {args.total_mib} MiB per pass, "
              f"tier threads {args.threads}, median of {args.repeat}")
        print(f"{'block':>8}  {'what':<32} {'GB/s':>6} {'ratio':>6}  notes")
        for size in (parse_size(s) for s in args.sizes.split(",")):
            rows, how = measure_size(work, size, total, args.threads, args.repeat,
                                     not args.no_dd, args.o_direct)
            all_how += how
            for row in rows:
                ratio = f"{row.base:6.2f}" if row.base is not None else f"{'':6}"
                print(f"{human(row.size):>8}  {row.what:<32} {row.gbps:6.2f} {ratio}  "
                      f"{row.note}", flush=True)
            goal = GOAL.get(size)
            if goal is not None:
                for row in rows:
                    if row.base is not None:
                        ok = row.base >= goal
                        verdicts.append(f"{human(size)} {row.what}: {row.base:.2f} of its "
                                        f"baseline, goal {goal}: {'met' if ok else 'NOT met'}")
    methods = sorted(set(all_how))
    worked = methods == ["drop_caches"]
    dropped = "/proc/sys/vm/drop_caches (worked)" if worked else "; ".join(methods)
    print(f"page cache dropped before reads with: {dropped}")
    for line in verdicts:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
