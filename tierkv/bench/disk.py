"""`tierkv bench disk`: the disk tier against plain syscalls and `dd` on the same
filesystem.

Measured by `tierkv/bench/disk_io.py` (`measure_size`): the tier as its process runs
it (a `DiskBackend` behind a `JobRunner` of I/O threads, bytes straight between
slab files and rows of a real shared-memory region) against `pwrite` +
`fdatasync` and `preadv` of the same bytes into one preallocated file, all timed
back to back in each round; reads are cold (page cache dropped first). `dd` with
O_DIRECT runs once per size as a second reference. On a virtual disk these
figures drift within minutes: the per-round ratio is what to read.
"""

from __future__ import annotations

from typing import Any

from tierkv.bench.common import Options, Part, Row, Stat, human, parse_size, work_dir

THREADS = 8  # the tier's I/O threads (its default)
# The rows of bench_disk that are headlines here, and the dd row each is also
# compared with (dd runs once: that ratio is of medians).
HEADLINES = {
    "tier store, one flush per job": "dd oflag=direct conv=fdatasync",
    "tier load, cold": "dd iflag=direct, cold",
}


def _rows(part: Part, label: str, rows: list[Any]) -> None:
    by_what = {r.what: r for r in rows}
    for r in rows:
        if not r.ratios:
            continue  # a baseline: it appears as the reference of the rows below
        base = by_what[r.baseline]
        part.add(Row("disk", f"{label} {r.what}", Stat.of(r.samples), "GB/s", r.baseline,
                     Stat.of(r.ratios), Stat.of(base.samples),
                     headline=r.what in HEADLINES, note=r.note))
        dd = by_what.get(HEADLINES.get(r.what, ""))
        if dd is not None:
            part.add(Row("disk", f"{label} {r.what}", Stat.of(r.samples), "GB/s", dd.what,
                         Stat.one(r.gbps / dd.gbps), Stat.of(dd.samples), paired=False,
                         note="dd ran once"))


def run(part: Part, opts: Options) -> None:
    from tierkv.bench import disk_io

    repeat = opts.pick(1, 3)
    total = (16 if opts.quick else 256) << 20
    sizes = ["256K"] if opts.quick else ["256K", "2M"]
    how: set[str] = set()
    with work_dir(opts.disk_dir) as work:
        part.note(f"in {work} ({disk_io.fs_type(work)}), {total >> 20} MiB per pass, "
                  f"{THREADS} tier threads, {repeat} rounds")
        for text in sizes:
            size = parse_size(text)
            label = human(size)
            if part.over_budget(f"{label} blocks"):
                break
            rows, methods = disk_io.measure_size(work, size, total, THREADS, repeat, True,
                                                    "auto", part.budget.deadline())
            how.update(methods)
            _rows(part, label, rows)
            if len(rows[0].samples) < repeat:
                part.skip(f"{label}: rounds {len(rows[0].samples) + 1}-{repeat}")
    if how:
        part.note("page cache dropped before reads with: " + "; ".join(sorted(how)))
