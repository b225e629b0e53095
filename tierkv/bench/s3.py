"""`tierkv bench s3`: the S3 tier against naive and concurrent boto3 on the same
endpoint.

Measured by `tierkv/bench/s3_io.py` (`run`): the tier as its process runs it (an
`S3Backend` behind a `JobRunner`, streaming straight from and into a real
shared-memory region) against a one-thread `put_object`/`get_object` loop and
boto3's own transfer manager with as many threads, interleaved in each repeat.
Against a local moto server (the default) all three share this machine's cores
with the emulator: the ratios say how well the tier uses concurrency, not what a
real S3 delivers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tierkv.bench.common import Options, Part, Row, Stat, human, parse_size

THREADS = 8


@contextmanager
def endpoint(opts: Options) -> Iterator[str]:
    """The endpoint to measure: the one given, or a local moto server for the part."""
    if opts.s3_endpoint:
        yield opts.s3_endpoint
        return
    from tierkv.node.s3server import S3Server

    with S3Server() as server:
        yield server.endpoint_url


def _rows(part: Part, label: str, rows: list[Any]) -> None:
    by = {(r.op, r.what): r for r in rows}
    for r in rows:
        if r.what != "tier":
            continue
        naive, boto3 = by[(r.op, "naive loop")], by[(r.op, "boto3 transfer mgr")]
        name = f"{label} tier {r.op.upper()}"
        part.add(Row("s3", name, Stat.of(r.samples), "MB/s", "naive boto3 loop",
                     Stat.of(r.vs_naive), Stat.of(naive.samples)))
        part.add(Row("s3", name, Stat.of(r.samples), "MB/s",
                     f"boto3 transfer manager ({THREADS} threads)", Stat.of(r.vs_boto3),
                     Stat.of(boto3.samples)))
        part.add(Row("s3", f"{label} boto3 transfer manager {r.op.upper()}",
                     Stat.of(boto3.samples), "MB/s", "naive boto3 loop",
                     Stat.of(boto3.vs_naive), Stat.of(naive.samples), headline=False))


def run(part: Part, opts: Options) -> None:
    from tierkv.bench import s3_io

    repeat = opts.pick(1, 3)
    total = (2 if opts.quick else 32) << 20
    sizes = ["256K"] if opts.quick else ["256K", "2M"]
    s3_io.use_placeholder_credentials()
    with endpoint(opts) as url:
        where = "given endpoint" if opts.s3_endpoint else "local moto server"
        part.note(f"{where} {url}; {total >> 20} MiB per method, size and repeat; "
                  f"{os.cpu_count()} cores shared by client and server")
        for text in sizes:
            size = parse_size(text)
            label = human(size)
            if part.over_budget(f"{label} objects"):
                break
            rows = s3_io.run(url, [size], total, THREADS, repeat, part.budget.deadline())
            _rows(part, label, rows)
            if len(rows[0].samples) < repeat:
                part.skip(f"{label}: repeats {len(rows[0].samples) + 1}-{repeat}")
