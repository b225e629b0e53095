#!/usr/bin/env python3
"""S3 tier figures: PUT and GET throughput of the tier against a local moto server,
as ratios of two baselines moving the same objects in the same run:

- naive: one thread, a `put_object(Body=bytes)` / `get_object().read()` loop;
- boto3 concurrent: boto3's own transfer manager (s3transfer), all objects
  submitted at once, `max_concurrency` = the tier's threads.

    python -m tierkv.bench.s3_io [--sizes 256K,2M] [--total-mib 64] [--threads 8]
                               [--repeat 3] [--endpoint-url URL]

The tier runs as in its process: an `S3Backend` behind a `JobRunner` of I/O
threads, streaming straight from and into rows of a real shared-memory region.
moto is a Python emulator (here on this machine's cores, sharing them with the
client), so these figures say how well the tier uses concurrency, not what a real
S3 delivers. Without --endpoint-url a moto server is started on loopback.

`run` is also what `tierkv bench s3` runs.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierkv.bench.common import human, parse_size  # noqa: E402
from tierkv.core.shm import SharedRegion  # noqa: E402
from tierkv.node.s3server import S3Server  # noqa: E402
from tierkv.tiers.base import Job, JobKind  # noqa: E402
from tierkv.tiers.runner import JobRunner  # noqa: E402

KEYS_PER_JOB = 32
ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "tierkv-bench-placeholder",
       "AWS_EC2_METADATA_DISABLED": "true"}


@dataclass
class Row:
    size: int
    op: str
    what: str
    mbps: float  # median over repeats
    naive: float
    concurrent: float | None = None
    samples: list[float] = field(default_factory=list)  # MB/s, one per repeat
    # Per repeat, this method's throughput over the naive loop's and over boto3's
    # transfer manager's, measured in the same repeat.
    vs_naive: list[float] = field(default_factory=list)
    vs_boto3: list[float] = field(default_factory=list)


def timed(fn: Callable[[str], Any], tag: str) -> float:
    t0 = time.perf_counter()
    fn(tag)
    return time.perf_counter() - t0


class Bench:
    """One block size: the same `count` objects moved by each method."""

    def __init__(self, endpoint: str, bucket: str, size: int, count: int, threads: int) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig, create_transfer_manager
        from botocore.config import Config

        from workers.s3 import S3Backend

        self.size, self.count, self.threads = size, count, threads
        self.bucket = bucket
        self.client = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            config=Config(max_pool_connections=threads, s3={"addressing_style": "path"}))
        # Above the block size: one PUT/GET per object, as the tier does.
        transfer = TransferConfig(max_concurrency=threads, multipart_threshold=4 * size,
                                  use_threads=True)
        self.manager = create_transfer_manager(self.client, transfer)
        self.region = SharedRegion.create(f"bench{uuid.uuid4().hex[:8]}", count, size)
        self.datas = [os.urandom(size) for _ in range(count)]
        for i, data in enumerate(self.datas):
            self.region.block(i)[:] = data
        self.backend = S3Backend(bucket=bucket, endpoint_url=endpoint, create_bucket=True,
                                 max_concurrency=threads, block_bytes=self.region.block_bytes,
                                 namespace=f"bench-{size}", inventory_limit=0)
        self.runner = JobRunner(self.backend, self.region, threads=threads)
        self.keys = [f"obj-{i:06d}".encode() for i in range(count)]
        self._job = 0

    def close(self) -> None:
        self.runner.close()
        self.runner.rows = None
        self.backend.close()
        self.manager.shutdown()
        self.region.close()
        self.region.unlink()

    # -- the three ways ------------------------------------------------------------

    def naive_put(self, tag: str) -> None:
        for i, data in enumerate(self.datas):
            self.client.put_object(Bucket=self.bucket, Key=f"naive/{tag}/{i}", Body=data)

    def naive_get(self, tag: str) -> None:
        for i in range(self.count):
            body = self.client.get_object(Bucket=self.bucket, Key=f"naive/{tag}/{i}")["Body"]
            assert len(body.read()) == self.size

    def boto3_put(self, tag: str) -> None:
        futures = [self.manager.upload(io.BytesIO(data), self.bucket, f"tm/{tag}/{i}")
                   for i, data in enumerate(self.datas)]
        for f in futures:
            f.result()

    def boto3_get(self, tag: str) -> None:
        sinks = [io.BytesIO() for _ in range(self.count)]
        futures = [self.manager.download(self.bucket, f"tm/{tag}/{i}", sink)
                   for i, sink in enumerate(sinks)]
        for f in futures:
            f.result()
        assert all(len(s.getvalue()) == self.size for s in sinks)

    def tier(self, kind: JobKind) -> None:
        for start in range(0, self.count, KEYS_PER_JOB):
            self._job += 1
            ids = tuple(range(start, min(start + KEYS_PER_JOB, self.count)))
            self.runner.submit(Job(self._job, tuple(self.keys[i] for i in ids), ids, kind))
        assert self.runner.drain(600)
        results = self.runner.take_finished()
        failed = [r for r in results if not r.success]
        if failed:
            raise RuntimeError(f"tier {kind.value} failed: {failed[0].error}")

    def tier_put(self, tag: str) -> None:
        self.tier(JobKind.STORE)

    def tier_get(self, tag: str) -> None:
        for i in range(self.count):  # so that a GET that did nothing cannot pass
            self.region.block(i)[:8] = b"\0" * 8
        self.tier(JobKind.PROMOTION)
        for i in (0, self.count - 1):
            assert bytes(self.region.block(i)) == self.datas[i], "tier GET returned wrong bytes"


def run(endpoint: str, sizes: list[int], total: int, threads: int, repeat: int,
        deadline: float | None = None) -> list[Row]:
    """Every method, `repeat` times per size (fewer once `time.monotonic()` passes
    `deadline`; at least once), interleaved."""
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    rows: list[Row] = []
    for size in sizes:
        count = max(threads, total // size)
        bench = Bench(endpoint, bucket, size, count, threads)
        try:
            seconds: dict[str, list[float]] = {}
            for r in range(repeat):
                if r and deadline is not None and time.monotonic() > deadline:
                    break
                tag = f"r{r}"
                # Interleaved, so drift in the machine's load hits every method alike.
                for what in ("naive", "boto3", "tier"):
                    for op in ("put", "get"):
                        fn = getattr(bench, f"{what}_{op}")
                        seconds.setdefault(f"{what}_{op}", []).append(timed(fn, tag))
            mb = size * count / 1e6
            for op in ("put", "get"):
                rows += _rows(size, op, {w: [mb / s for s in seconds[f"{w}_{op}"]]
                                         for w in ("naive", "boto3", "tier")})
        finally:
            bench.close()
    return rows


def _rows(size: int, op: str, mbps: dict[str, list[float]]) -> list[Row]:
    """The three methods' rows of one size and op, from MB/s per repeat."""
    best = {w: statistics.median(v) for w, v in mbps.items()}

    def per_repeat(what: str, base: str) -> list[float]:
        return [m / b for m, b in zip(mbps[what], mbps[base], strict=True)]

    return [
        Row(size, op, "naive loop", best["naive"], best["naive"], samples=mbps["naive"]),
        Row(size, op, "boto3 transfer mgr", best["boto3"], best["naive"], samples=mbps["boto3"],
            vs_naive=per_repeat("boto3", "naive")),
        Row(size, op, "tier", best["tier"], best["naive"], best["boto3"], samples=mbps["tier"],
            vs_naive=per_repeat("tier", "naive"), vs_boto3=per_repeat("tier", "boto3")),
    ]


def table(rows: list[Row], threads: int, repeat: int) -> str:
    lines = [f"{'block':>8} {'op':>4} {'method':<20} {'MB/s':>8} {'x naive':>8} "
             f"{'x boto3 tm':>10}"]
    for row in rows:
        vs_tm = f"{row.mbps / row.concurrent:10.2f}" if row.concurrent else f"{'':>10}"
        lines.append(f"{human(row.size):>8} {row.op:>4} {row.what:<20} {row.mbps:8.1f} "
                     f"{row.mbps / row.naive:8.2f} {vs_tm}")
    lines.append(f"(median of {repeat}; {threads} threads for the tier and boto3's transfer "
                 f"manager; local moto server, {os.cpu_count()} cores shared with the client)")
    return "\n".join(lines)


def use_placeholder_credentials() -> None:
    """boto3 wants credentials, and a local endpoint started here admits the ones in
    the environment (`S3Server`). Real ones set in the environment are left as they
    are."""
    for name, value in ENV.items():
        os.environ.setdefault(name, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256K,2M")
    parser.add_argument("--total-mib", type=int, default=64, help="bytes per method and size")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--endpoint-url", help="an S3 endpoint on loopback (default: start moto)")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    use_placeholder_credentials()
    if args.endpoint_url:
        rows = run(args.endpoint_url, sizes, args.total_mib << 20, args.threads, args.repeat)
    else:
        with S3Server() as server:
            rows = run(server.endpoint_url, sizes, args.total_mib << 20, args.threads,
                       args.repeat)
    print(table(rows, args.threads, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
