"""A gpu worker: `tierkv-gpu-worker --rank R -c tierkv.toml` (one per GPU / TP rank).

Maps the shared region, opens the engine's KV cache when the broker forwards its
registration, and runs transfer jobs on a `TransferEngine` (CUDA streams on a
GPU, numpy on a CPU cache), reporting completions in batches. The loop never
waits on a copy and never polls: it sleeps until a message arrives or the engine's
copy / completion threads say a job finished (`wakeup`).

On CUDA the worker works on one device: ``--device cuda:N``, else GPU ``rank mod
visible GPUs`` (one worker per TP rank, rank r on GPU r). It makes that device
current before any CUDA call, so it never creates a context (0.3-0.5 GiB) on
another GPU, creates its context and pins the CPU tier before it says hello
(pinning tens of GiB takes seconds, which inside the serve loop would miss
heartbeats and get the worker fenced), and reports the pinned state in its hello.
A region that cannot be pinned stops the worker with the reason, unless the config
says ``[gpu] allow_unpinned = true``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

from tierkv.core.shm import RegionLayout, SharedRegion, process_start_time
from tierkv.node.config import Config, ConfigError
from tierkv.node.process import process_parser, start_process
from tierkv.wire.protocol import (
    TO_WORKER_OPS,
    AttachedKV,
    AttachKV,
    DetachKV,
    TransferBatch,
    TransferDoneBatch,
    WorkerHello,
)
from tierkv.wire.sockets import CurveError
from tierkv.wire.wakeup import Wakeup
from workers.link import BrokerLink, LinkRefused, PeerService

log = logging.getLogger("tierkv.worker")


class UnpinnedRefused(Exception):
    """The CPU tier cannot be pinned and the config does not allow unpinned copies."""


class WorkerService(PeerService):
    component = "worker"

    def __init__(self, config: Config, rank: int, device: str,
                 cuda_index: int | None = None) -> None:
        super().__init__(config.instance, config.connect_address("worker"),
                         config.broker.heartbeat_s, config.supervisor.ready_timeout_s)
        self.config = config
        self.rank = rank
        self.device = device
        self.cuda_index = cuda_index  # this worker's GPU (None: a CPU worker)
        self.component = f"worker:{rank}"
        self.engine: Any = None
        self.kv: Any = None  # the engine's KV cache: outlives broker sessions
        self.registration: dict[str, Any] | None = None
        self.registration_token = ""  # the engine's right to it (`AttachKV.token`)
        self.wakeup = Wakeup()
        self.pinned: Any = None  # this session's `workers.gpu.pinning.Pinned`
        self._pin_view: Any = None  # the region's bytes, held while pinned

    def _attach_region(self) -> SharedRegion:
        """Attach the broker's region and, on CUDA, pin it: before the hello."""
        region = super()._attach_region()
        if self.cuda_index is not None:
            try:
                self._pin(region)
            except BaseException:
                region.close()
                raise
        return region

    def _pin(self, region: SharedRegion) -> None:
        from workers.gpu.pinning import pin_host, refuse_message, unpin_host

        view = region.torch_view()
        pinned = pin_host(view.data_ptr(), view.numel(), self.cuda_index)
        if not pinned.pinned and not self.config.gpu.allow_unpinned:
            unpin_host(view.data_ptr(), self.cuda_index)
            del view
            raise UnpinnedRefused(refuse_message(pinned))
        self.pinned, self._pin_view = pinned, view
        log.info("rank %d: CPU tier %.1f GiB %s in %.2f s on cuda:%d", self.rank,
                 view.numel() / 2**30, "pinned" if pinned.pinned else
                 f"NOT pinned ({pinned.error}; allowed by [gpu] allow_unpinned)",
                 pinned.seconds, self.cuda_index)

    def _unpin(self) -> None:
        if self._pin_view is not None:
            from workers.gpu.pinning import unpin_host

            seconds = unpin_host(self._pin_view.data_ptr(), self.cuda_index)
            log.info("rank %d: CPU tier unpinned in %.2f s", self.rank, seconds)
            self._pin_view = None

    def open_session(self, region: SharedRegion) -> BrokerLink:
        from workers.gpu.transfer import TransferEngine  # torch: only in this process

        self.engine = TransferEngine(region, self.rank, device=self.device, wakeup=self.wakeup,
                                     allow_unpinned=self.config.gpu.allow_unpinned)
        if self.kv is not None:
            try:
                self.engine.attach(self.kv)
            except Exception as e:  # the new broker's region no longer fits it
                log.error("dropping the KV cache of the last session: %s", e)
                self._drop_kv()
        pid = os.getpid()
        device = "cpu" if self.cuda_index is None else f"cuda:{self.cuda_index}"
        hello = WorkerHello(self.rank, self.config.cpu.world_size, pid,
                            process_start_time(pid) or 0, device, self.registration,
                            None if self.pinned is None else self.pinned.pinned,
                            token=self.token, registration_token=self.registration_token)
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
            # Finished copies wake the loop (CPU copy thread, CUDA completion threads).
            for msg in link.receive(self.heartbeat_s / 2, self.wakeup):
                if isinstance(msg, TransferBatch):
                    for job in msg.jobs:
                        engine.submit(job)
                elif isinstance(msg, AttachKV):
                    link.send(self._attach(msg))
                elif isinstance(msg, DetachKV):
                    self._detach(msg.token)
            done = engine.poll()
            if done:
                link.send(TransferDoneBatch(done))
            link.keep_alive()
            self.parent_died(0)

    def _attach(self, msg: AttachKV) -> AttachedKV:
        from tierkv.engine import open_kv_cache

        try:
            registration = msg.registration
            if (self.cuda_index is None and isinstance(registration, dict)
                    and registration.get("device") == "cuda"):
                # Refused before opening: that would import torch inside the loop.
                raise ValueError("this worker copies on the CPU (it sees no GPU or was "
                                 "started with --device cpu): it cannot open a CUDA KV cache")
            kv = open_kv_cache(registration)
            try:
                self.engine.attach(kv)
            except Exception:
                kv.close()
                raise
        except Exception as e:  # any failure is the engine's to read, not a crash here
            log.error("cannot attach the KV cache of rank %d: %s", self.rank, e)
            self._clear_cuda_error()
            return AttachedKV(msg.reg_id, False, error=str(e))
        if self.cuda_index is not None and kv.device.index not in (None, self.cuda_index):
            log.warning("rank %d works on cuda:%d but the engine's KV cache is on %s: a "
                        "context exists on both GPUs (start it with --device %s)", self.rank,
                        self.cuda_index, kv.device, kv.device)
        self._drop_kv()  # an engine restart re-registered: drop the old handles
        self.kv, self.registration = kv, msg.registration
        self.registration_token = msg.token
        log.info("rank %d attached the KV cache (page %d bytes)", self.rank, kv.layout.page_size)
        return AttachedKV(msg.reg_id, True, page_size=kv.layout.page_size)

    def _clear_cuda_error(self) -> None:
        """A failed open or pin may leave CUDA's "last error" set; torch would blame
        the next kernel launch for it. The KV cache that works stays attached."""
        if self.cuda_index is not None:
            from workers.gpu.cudart import cuda_runtime

            runtime = cuda_runtime()
            if runtime is not None:
                runtime.clear_error()

    def end_session(self, region: SharedRegion) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self._unpin()
        region.close()

    def _detach(self, token: str) -> None:
        """The engine's registration ended: unmap its KV cache, so an exited engine's
        memory is freed. `detach` first waits for the jobs in flight on it."""
        if self.kv is None or not token or token != self.registration_token:
            return  # a newer registration replaced it: that one stays
        self.engine.detach()
        self._drop_kv()
        log.info("rank %d let go of the KV cache of an ended registration", self.rank)

    def _drop_kv(self) -> None:
        if self.kv is not None:
            self.kv.close()
        self.kv, self.registration = None, None
        self.registration_token = ""


def resolve_device(device: str, rank: int) -> tuple[str, int | None]:
    """(engine device, CUDA index) for ``--device``: "cpu"; "auto" (CUDA when this
    process sees a GPU); "cuda" (GPU rank mod visible GPUs); "cuda:N". Only counts
    devices: no CUDA context is created here. Imports torch (seconds) only where a
    GPU may be: a CPU worker copies with numpy and never loads it."""
    if device == "cpu" or (device == "auto" and not _gpu_device_files()):
        return "cpu", None
    import torch

    if not torch.cuda.is_available():
        if device == "auto":
            return "cpu", None
        raise ConfigError(f"--device {device}: this process sees no CUDA device")
    count = torch.cuda.device_count()
    index = int(device.split(":", 1)[1]) if ":" in device else rank % count
    if not 0 <= index < count:
        raise ConfigError(f"--device {device}: this process sees {count} CUDA devices")
    return ("auto" if device == "auto" else "cuda"), index


def _gpu_device_files() -> bool:
    """Whether this machine has the device files a CUDA driver works through (Linux:
    /dev/nvidiactl, /dev/nvidiaN; WSL: /dev/dxg). Without them torch sees no GPU."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"))


def _device_arg(value: str) -> str:
    kind, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = process_parser("tierkv-gpu-worker", "a tierkv gpu worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--device", type=_device_arg, default=None,
                        help="auto, cpu, cuda (GPU rank mod visible GPUs) or cuda:N")
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
    # torch (seconds to import, where a GPU may be) is imported here, before saying
    # ready, never inside the loop, where it would look like a hang to the broker's
    # heartbeat check.
    import tierkv.engine  # noqa: F401
    try:
        device, cuda_index = resolve_device(args.device or config.worker.device, args.rank)
    except ConfigError as e:
        log.error("cannot start: %s", e)
        return 1
    if cuda_index is not None:
        import torch

        # Before any other CUDA call: every call of this process, and the threads
        # that bind this device, run on this GPU. cudaSetDevice creates its context.
        t0 = time.perf_counter()
        torch.cuda.set_device(cuda_index)
        log.info("rank %d: CUDA context on cuda:%d (%s) in %.2f s", args.rank, cuda_index,
                 torch.cuda.get_device_name(cuda_index), time.perf_counter() - t0)
    service = WorkerService(config, args.rank, device, cuda_index)
    service.install_signals()
    try:
        return service.run()
    except (CurveError, UnpinnedRefused) as e:
        log.error("cannot start: %s", e)
        return 1
    finally:
        service._drop_kv()


if __name__ == "__main__":
    sys.exit(main())
