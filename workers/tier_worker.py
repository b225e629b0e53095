"""A tier process: `tierkv-tier --type disk -c tierkv.toml` (or `python -m workers.tier_worker`).

The generic loop of every secondary tier: hello with the backend's inventory,
then credit-based pull of job batches, run on a pool of threads by `JobRunner`
against zero-copy views of the shared region, completions pushed back in
batches, heartbeats, clean shutdown. Only the backend knows the medium.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

from tierkv.core.errors import ErrorCode, TierError
from tierkv.core.shm import RegionLayout, SharedRegion, process_start_time
from tierkv.node.children import tier_secret
from tierkv.node.config import Config, ConfigError, tier_name
from tierkv.node.process import process_parser, start_process
from tierkv.tiers.backend import TierBackend
from tierkv.tiers.base import JobResult
from tierkv.tiers.registry import TierConfigError, create_backend
from tierkv.tiers.runner import JobRunner
from tierkv.wire.protocol import (
    TO_TIER_OPS,
    Inventory,
    Ready,
    TierDoneBatch,
    TierHello,
    TierJobBatch,
    TierStats,
)
from tierkv.wire.sockets import CurveError
from tierkv.wire.wakeup import Wakeup
from workers.link import BrokerLink, LinkRefused, PeerService
from workers.listing import Refresher

log = logging.getLogger("tierkv.tier")

INVENTORY_CHUNK = 50_000
STATS_S = 1.0  # how often the backend's own figures go to the broker


class TierService(PeerService):
    component = "tier"

    def __init__(self, config: Config, entry: dict[str, Any], threads: int, credit: int) -> None:
        super().__init__(config.instance, config.connect_address("tier"), config.broker.heartbeat_s,
                         config.supervisor.ready_timeout_s)
        self.config = config
        self.entry = entry
        self.name = tier_name(entry)
        self.component = f"tier:{self.name}"
        self.threads = threads
        self.credit = credit
        self.backend: TierBackend | None = None
        self.runner: JobRunner | None = None
        self.wakeup = Wakeup()
        self.refresher: Refresher | None = None  # a shared tier's background listing
        self._block_bytes = 0

    def _backend(self, region: SharedRegion) -> TierBackend:
        """Created once, at the first session: the medium outlives broker restarts."""
        if self.backend is not None and self._block_bytes != region.block_bytes:
            raise TierConfigError(
                f"the broker's blocks are now {region.block_bytes} bytes, this tier holds "
                f"{self._block_bytes}-byte blocks: restart the tier"
            )
        if self.backend is None:
            self.backend = create_backend(
                self.entry, block_bytes=region.block_bytes, namespace=self.config.namespace,
                instance=self.config.instance, name=self.name,
            )
            self._block_bytes = region.block_bytes
        return self.backend

    def open_session(self, region: SharedRegion) -> BrokerLink:
        backend = self._backend(region)
        inventory = backend.inventory()
        pid = os.getpid()
        refresh_s = float(self.entry.get("refresh_s", 5.0)) if backend.shared else 0.0
        hello = TierHello(
            self.name, backend.type_name, pid, process_start_time(pid) or 0,
            shared=backend.shared, capacity_bytes=backend.capacity(),
            namespace=self.config.namespace, inventory_total=len(inventory),
            # Started by the supervisor: its token; by hand: the node's tier secret.
            token=self.token or tier_secret(self.config.tier_secret_path, create=False),
            refresh_s=refresh_s,
        )
        chunks = [Inventory(inventory[i : i + INVENTORY_CHUNK],
                            last=i + INVENTORY_CHUNK >= len(inventory))
                  for i in range(0, len(inventory), INVENTORY_CHUNK)] or [Inventory([], True)]
        link = BrokerLink(self.address, self.identity(), self.heartbeat_s, TO_TIER_OPS,
                          self.config.client.curve_keys())
        try:
            welcome = link.handshake(hello, self.connect_timeout_s, *chunks,
                                     stopping=lambda: self.stopping or self.parent_died(0))
            layout = RegionLayout(welcome.num_blocks, welcome.page_size, welcome.world_size)
            if layout != region.layout:
                raise LinkRefused(f"the broker's layout {layout} is not the region's "
                                      f"{region.layout}")
            self.runner = JobRunner(backend, region, threads=self.threads, wakeup=self.wakeup)
            if refresh_s > 0:
                self.refresher = Refresher(backend, refresh_s, inventory, self.wakeup)
            link.send(Ready(self.credit))
        except BaseException:
            link.close()
            raise
        log.info("serving tier %s (%s) for %s with %d threads, %d blocks held", self.name,
                 backend.type_name, self.instance, self.threads, len(inventory))
        return link

    def serve(self, link: BrokerLink) -> None:
        runner = self.runner
        assert runner is not None
        next_stats = 0.0
        while not self.stopping:
            if time.monotonic() >= next_stats:
                link.send(TierStats(self._stats(runner)))
                next_stats = time.monotonic() + STATS_S
            for msg in link.receive(min(STATS_S, self.heartbeat_s / 2), self.wakeup):
                if isinstance(msg, TierJobBatch):
                    self._accept(msg, runner)
            self._push(link, runner)
            if self.refresher is not None:
                self._announce(link, self.refresher.take())
            link.keep_alive()
            self.parent_died(0)
        # Stopping: finish what we hold and report it, then say goodbye.
        runner.drain(self.config.broker.drain_timeout_s)
        self._push(link, runner)

    def _announce(self, link: BrokerLink, keys: list[bytes]) -> None:
        """Keys the listing found that other nodes stored: more inventory."""
        for i in range(0, len(keys), INVENTORY_CHUNK):
            link.send(Inventory(keys[i : i + INVENTORY_CHUNK], last=True))

    def _stats(self, runner: JobRunner) -> dict[str, Any]:
        assert self.backend is not None
        return {**self.backend.stats(), "pid": os.getpid(), "type": self.backend.type_name,
                "in_flight": runner.in_flight}

    def _accept(self, batch: TierJobBatch, runner: JobRunner) -> None:
        for i, job in enumerate(batch.jobs):
            deadline = batch.deadlines[i] if i < len(batch.deadlines) else 0.0
            try:
                runner.submit(job, deadline)
            except ValueError as e:
                runner.report(JobResult(job.job_id, False, error_code=ErrorCode.BAD_REQUEST,
                                        error=str(e)))

    def _push(self, link: BrokerLink, runner: JobRunner) -> None:
        results = runner.take_finished()
        if results:
            link.send(TierDoneBatch(results, credit=len(results)))

    def end_session(self, region: SharedRegion) -> None:
        if self.refresher is not None:
            self.refresher.close()
            self.refresher = None
        if self.runner is not None:
            self.runner.drain(self.config.broker.drain_timeout_s)
            self.runner.close()
            self.runner.rows = None
            self.runner = None
        region.close()

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        self.wakeup.close()


def build_parser() -> argparse.ArgumentParser:
    parser = process_parser("tierkv-tier", "a tierkv tier process")
    parser.add_argument("--type", help="tier type (memory, disk, s3, ...)")
    parser.add_argument("--name", help="the tier's name in the config (default: its type)")
    parser.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                        help="a backend option (repeatable); overrides the config entry")
    parser.add_argument("--threads", type=int, default=None, help="I/O threads (default 8)")
    parser.add_argument("--credit", type=int, default=None,
                        help="jobs the broker may send ahead (default 4 x threads)")
    return parser


def _parse_opt(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--opt {text!r} must be KEY=VALUE")
    for convert in (int, float):
        try:
            return key, convert(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, value


def resolve_entry(config: Config, name: str | None, type_: str | None,
                  opts: list[str]) -> dict[str, Any]:
    if name is None and type_ is None:
        raise ConfigError("give --type or --name")
    entry: dict[str, Any] | None = None
    for candidate in config.tiers:
        if (name and tier_name(candidate) == name) or (not name and candidate["type"] == type_):
            entry = dict(candidate)
            break
    if entry is None:
        if type_ is None:
            raise ConfigError(f"{config.source}: no tier named {name!r}")
        entry = {"type": type_, "name": name or type_}
    if type_ is not None and entry["type"] != type_:
        raise ConfigError(f"tier {name!r} is of type {entry['type']!r}, not {type_!r}")
    entry.update(_parse_opt(o) for o in opts)
    return entry


def _check_tier(args: argparse.Namespace, config: Config) -> None:
    args.entry = resolve_entry(config, args.name, args.type, args.opt)
    args.threads = args.threads or int(args.entry.get("threads", 8))
    args.credit = args.credit or 4 * args.threads
    if args.threads < 1 or args.credit < 1:
        raise ConfigError("--threads and --credit must be positive")


def main(argv: list[str] | None = None) -> int:
    started = start_process(build_parser(), argv, lambda a: f"tier:{tier_name(a.entry)}",
                            _check_tier)
    if isinstance(started, int):
        return started
    args, config = started
    entry, threads, credit = args.entry, args.threads, args.credit
    service = TierService(config, entry, threads, credit)
    service.install_signals()
    try:
        return service.run()
    except (TierConfigError, TierError, CurveError, OSError) as e:
        log.error("cannot start: %s", e)
        return 1
    finally:
        service.close()


if __name__ == "__main__":
    sys.exit(main())
