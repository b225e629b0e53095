"""A gpu worker: `tierkv-gpu-worker --rank R -c tierkv.toml` (one per GPU / TP rank).

Maps the shared region, opens the engine's KV cache when the broker forwards its
registration, and runs transfer jobs on a `TransferEngine` (CUDA streams on a
GPU, CPU tensors otherwise), reporting completions in batches. The loop never
waits on a copy: it polls the engine for finished jobs between messages.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from tierkv.core.shm import RegionLayout, SharedRegion, process_start_time
from tierkv.node.config import Config, ConfigError
from tierkv.node.process import process_parser, start_process
from tierkv.wire.protocol import (
    TO_WORKER_OPS,
    AttachedKV,
    AttachKV,
    TransferBatch,
    TransferDoneBatch,
    WorkerHello,
)
from tierkv.wire.sockets import CurveError
from tierkv.wire.wakeup import Wakeup
from workers.link import BrokerLink, LinkRefused, PeerService

log = logging.getLogger("tierkv.worker")

CUDA_POLL_S = 0.0002  # how often CUDA events are queried while copies are in flight


class WorkerService(PeerService):
    component = "worker"

    def __init__(self, config: Config, rank: int, device: str) -> None:
        super().__init__(config.instance, config.connect_address("worker"),
                         config.broker.heartbeat_s, config.supervisor.ready_timeout_s)
        self.config = config
        self.rank = rank
        self.device = device
        self.component = f"worker:{rank}"
        self.engine: Any = None
        self.kv: Any = None  # the engine's KV cache: outlives broker sessions
        self.registration: dict[str, Any] | None = None
        self.wakeup = Wakeup()

    def open_session(self, region: SharedRegion) -> BrokerLink:
        from workers.gpu.transfer import TransferEngine  # torch: only in this process

        self.engine = TransferEngine(region, self.rank, device=self.device, wakeup=self.wakeup)
        if self.kv is not None:
            try:
                self.engine.attach(self.kv)
            except Exception as e:  # the new broker's region no longer fits it
                log.error("dropping the KV cache of the last session: %s", e)
                self._drop_kv()
        pid = os.getpid()
        hello = WorkerHello(self.rank, self.config.cpu.world_size, pid,
                            process_start_time(pid) or 0, _device_kind(self.device),
                            self.registration, token=self.token)
        link = BrokerLink(self.address, self.identity(), self.heartbeat_s, TO_WORKER_OPS,
                          self.config.client.curve_keys())
        try:
            welcome = link.handshake(hello, self.connect_timeout_s,
                                     stopping=lambda: self.stopping or self.parent_died(0))
            layout = RegionLayout(welcome.num_blocks, welcome.page_size, welcome.world_size)
            if layout != region.layout:
                raise LinkRefused(f"the broker's layout {layout} is not the region's "
                                  f"{region.layout}")
        except BaseException:
            link.close()
            raise
        log.info("rank %d serving %s on %s", self.rank, self.instance, self.engine.device)
        return link

    def serve(self, link: BrokerLink) -> None:
        engine = self.engine
        while not self.stopping:
            # CPU copies wake the loop when they finish; CUDA events are polled.
            polled = engine.in_flight and not engine.notifies
            wait = CUDA_POLL_S if polled else self.heartbeat_s / 2
            for msg in link.receive(wait, self.wakeup):
                if isinstance(msg, TransferBatch):
                    for job in msg.jobs:
                        engine.submit(job)
                elif isinstance(msg, AttachKV):
                    link.send(self._attach(msg))
            done = engine.poll()
            if done:
                link.send(TransferDoneBatch(done))
            link.keep_alive()
            self.parent_died(0)

    def _attach(self, msg: AttachKV) -> AttachedKV:
        from tierkv.engine import open_kv_cache

        try:
            kv = open_kv_cache(msg.registration)
            try:
                self.engine.attach(kv)
            except Exception:
                kv.close()
                raise
        except Exception as e:  # any failure is the engine's to read, not a crash here
            log.error("cannot attach the KV cache of rank %d: %s", self.rank, e)
            return AttachedKV(msg.reg_id, False, error=str(e))
        self._drop_kv()  # an engine restart re-registered: drop the old handles
        self.kv, self.registration = kv, msg.registration
        log.info("rank %d attached the KV cache (page %d bytes)", self.rank, kv.layout.page_size)
        return AttachedKV(msg.reg_id, True, page_size=kv.layout.page_size)

    def end_session(self, region: SharedRegion) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        region.close()

    def _drop_kv(self) -> None:
        if self.kv is not None:
            self.kv.close()
        self.kv, self.registration = None, None


def _device_kind(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_parser() -> argparse.ArgumentParser:
    parser = process_parser("tierkv-gpu-worker", "a tierkv gpu worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    return parser


def _check_rank(args: argparse.Namespace, config: Config) -> None:
    if not 0 <= args.rank < config.cpu.world_size:
        raise ConfigError(f"--rank {args.rank} is outside cpu.world_size "
                          f"{config.cpu.world_size}")


def main(argv: list[str] | None = None) -> int:
    started = start_process(build_parser(), argv, lambda a: f"worker:{a.rank}", _check_rank)
    if isinstance(started, int):
        return started
    args, config = started
    # torch takes seconds to import: do it before saying ready, never inside the
    # loop, where it would look like a hang to the broker's heartbeat check.
    import torch  # noqa: F401

    import tierkv.engine  # noqa: F401
    service = WorkerService(config, args.rank, args.device or config.worker.device)
    service.install_signals()
    try:
        return service.run()
    except CurveError as e:
        log.error("cannot start: %s", e)
        return 1
    finally:
        service._drop_kv()


if __name__ == "__main__":
    sys.exit(main())
