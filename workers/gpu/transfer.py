"""The gpu worker's copy engine: moves KV blocks between the engine's KV cache and
this rank's pages of the CPU tier. It knows no sockets; `workers/gpu_worker.py`
feeds it jobs and ships its outcomes.

Threads: every public method is called from the worker's main (socket) thread and
never blocks for long, except `attach`, `close` and `wait`, which wait for the jobs
in flight (bounded). Copies run elsewhere: on a background thread for CPU KV caches
(`copy_cpu`), on the worker's own CUDA streams for CUDA KV caches (`copy_cuda`),
whose completions a waiting thread reports. Either way a finished job notifies
`wakeup`, so the worker's loop sleeps until there is something to report.

A job copies ``gpu_block_ids[j] <-> cpu_block_ids[j]`` for every j; "store" is KV
cache -> CPU tier, "load" is CPU tier -> KV cache. Only page `rank` of each CPU-tier
row is touched, so the workers of all ranks share one region. The bytes of a block
inside a page follow `tierkv.engine` (the page layout is defined there only).

The engine contract (the client, the broker and the engine rely on it; the README
says it for users):

* Load only into GPU blocks the engine has allocated for the request and not yet
  computed, and do not read them before the client saw the load finish (a `step`
  result; the worker reports it after the copy's CUDA event completed). No
  cross-process CUDA event is shared: a step boundary is already a host
  synchronization in every engine we target.
* Store only blocks whose engine step finished on the host (the sampled tokens
  reached the CPU), so every write to the block is complete and visible to another
  stream or process; do not overwrite or free a stored block before the client saw
  the store finish.
* Inside the engine's own process (`tierkv.vllm`) the store rule relaxes to stream
  order, as for vLLM's own offloading: a CUDA job is ordered after the work queued
  so far on the submitting thread's current stream, so a store submitted right
  after the forward pass was launched reads the finished KV, and a load is not
  overwritten by a write (a zeroing) queued before it. Submit from the thread that
  queued those writes, with their stream current. A CPU KV cache has no stream: a
  job is ordered after the fence the engine's `order` returns when it is submitted
  (`workers.gpu.streams.HostOrder`; none: the writes launched so far are done, as
  when the model computes on the submitting thread). A loaded block is still read
  only once the load was seen finished. Another process's streams are not seen:
  for the gpu worker the host rules hold.
* What can be checked here is: a load into a GPU block that a store in flight still
  reads, or a store of a GPU block that a load in flight is still writing, is
  refused (``bad_request``) and copies nothing. Such a pair would race: loads and
  stores run on separate streams.

Ordering: jobs of one direction run in submission order; loads and stores may
overlap each other (the broker never lets a load read a CPU block that is being
written). The CPU backend runs waiting loads before waiting stores.

Invalid jobs — ids out of range, lengths that differ, a duplicate destination id,
no KV cache attached, a deadline already passed, a broken contract — fail with a
`TransferOutcome` (codes from `tierkv.core.errors.ErrorCode`) and copy nothing;
submit and poll never raise for a bad job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tierkv.core.errors import ErrorCode
from tierkv.wire.protocol import TransferJob, TransferOutcome
from tierkv.wire.wakeup import Wakeup
from workers.gpu.jobs import JobError, TransferError, failed, validate
from workers.gpu.reservations import BlockUse

if TYPE_CHECKING:
    from tierkv.core.shm import SharedRegion
    from tierkv.engine import OpenedKV
    from workers.gpu.streams import HostFence, HostOrder, StreamOps

log = logging.getLogger("tierkv.transfer")


class Backend(Protocol):
    """One device kind's copy machinery. Methods run on the worker's main thread."""

    kind: str
    device: Any  # CUDA: the torch.device it copies on; CPU: None (any CPU cache)

    def attach(self, kv: OpenedKV | None) -> None:
        """Wait for the jobs in flight, then use `kv` (None: let go of the old one)."""

    def submit(self, job: TransferJob, gpu: np.ndarray, cpu: np.ndarray) -> None:
        """Queue a validated job; never blocks for its copy."""

    def poll(self) -> list[TransferOutcome]:
        """Finished jobs, each once; never blocks."""

    def close(self) -> None:
        """Stop; jobs not started are reported as failed by the next poll."""


class TransferEngine:
    """Copies blocks for one rank between an attached KV cache and `region`.

    `device`: "auto" (the backend follows the attached KV cache's device), "cpu",
    or "cuda"/"cuda:N" (refuse KV caches elsewhere). `staging_bytes` bounds the
    device staging buffers of each direction (CUDA only). `allow_unpinned`: accept
    a region that cannot be pinned for DMA (CUDA; otherwise attach fails).
    `streams`: the CUDA backend's stream calls (None: torch's; gpu-check passes its
    own to show the race the ordering prevents). `order`: what a CPU backend's job
    waits for before it touches the KV cache (the engine's model writing it on
    another thread; None, or an `order` that returns None: nothing). It may be set
    later (`order` attribute); it is asked on the thread that calls `submit`."""

    def __init__(
        self,
        region: SharedRegion,
        rank: int,
        device: str = "auto",
        *,
        staging_bytes: int = 64 << 20,
        wakeup: Wakeup | None = None,
        allow_unpinned: bool = False,
        streams: StreamOps | None = None,
        order: HostOrder | None = None,
    ) -> None:
        if not 0 <= rank < region.layout.world_size:
            raise TransferError(f"rank {rank} out of range [0, {region.layout.world_size})")
        if device != "auto" and device.split(":")[0] not in ("cpu", "cuda"):
            raise TransferError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
        self.region = region
        self.rank = rank
        self.device = device
        self.staging_bytes = staging_bytes
        self.allow_unpinned = allow_unpinned
        self.streams = streams
        self.order = order
        self.wakeup = wakeup  # notified from the copy threads when a job finished
        self._finished = threading.Event()  # the same, for `wait`
        self._kv: OpenedKV | None = None
        self._backend: Backend | None = None
        self._use: BlockUse | None = None
        self._early: deque[TransferOutcome] = deque()
        self._in_flight = 0
        self._closed = False

    @property
    def kv(self) -> OpenedKV | None:
        return self._kv

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet returned by `poll` (failed ones included)."""
        return self._in_flight

    @property
    def pinned(self) -> bool | None:
        """Whether the CUDA backend's region is pinned; None without a CUDA backend."""
        pinned = getattr(self._backend, "pinned", None)
        return None if pinned is None else bool(pinned.pinned)

    def describe(self) -> dict[str, Any]:
        """The backend's facts (pinned, DMA path, word, chunk) for logs and gpu-check."""
        describe = getattr(self._backend, "describe", None)
        return {"backend": getattr(self._backend, "kind", None),
                **(describe() if describe else {})}

    def _notify(self) -> None:
        """Called on a copy or waiting thread each time a job finished."""
        self._finished.set()
        if self.wakeup is not None:
            self.wakeup.notify()

    def attach(self, kv: OpenedKV) -> None:
        """Use `kv` for the next jobs, replacing the previous KV cache. Blocks until
        the jobs in flight finish on the old one; the caller closes the old
        `OpenedKV` afterwards. Raises TransferError if `kv` does not fit."""
        if self._closed:
            raise TransferError("the transfer engine is closed")
        page = self.region.layout.page_size
        if kv.layout.page_size != page:
            raise TransferError(
                f"KV cache page_size {kv.layout.page_size} (one block, all tensors) does not "
                f"match the CPU tier's page_size {page}"
            )
        kind = kv.kind
        if self.device != "auto" and self.device.split(":")[0] != kind:
            raise TransferError(f"this engine copies for {self.device}, the KV cache is on {kind}")
        old = self._backend
        if old is None or old.kind != kind or (kind == "cuda" and old.device != kv.device):
            # A new backend is made and attached before the old one is let go: if
            # that fails, the KV cache that works stays attached.
            new = self._make_backend(kind, kv)
            try:
                new.attach(kv)
            except BaseException:
                new.close()
                self._early.extend(new.poll())
                raise
            if old is not None:
                old.attach(None)
                self._drain_backend()
            self._backend = new
        else:
            old.attach(kv)
        self._kv = kv
        # The backend waited for every job in flight: nothing holds a block any more.
        self._use = BlockUse(kv.layout.num_blocks)
        log.info("rank %d: attached %r (page %d B)", self.rank, kv, page)

    def detach(self) -> None:
        """Let go of the KV cache (after the jobs in flight), e.g. before closing it."""
        if self._backend is not None:
            self._backend.attach(None)
        self._kv = None

    def _make_backend(self, kind: str, kv: OpenedKV) -> Backend:
        if kind == "cuda":
            from workers.gpu.copy_cuda import CudaBackend

            return CudaBackend(self.region, self.rank, self.staging_bytes, device=kv.device,
                               allow_unpinned=self.allow_unpinned, notify=self._notify,
                               streams=self.streams)
        if kind == "cpu":
            from workers.gpu.copy_cpu import CpuBackend

            return CpuBackend(self.region, self.rank, self._notify, self._fence)
        raise TransferError(f"no transfer backend for device type {kind!r}")

    def _fence(self) -> HostFence | None:
        """The CPU backend's `order`: this engine's current one, so setting `order`
        after the backend was made takes effect at the next submit."""
        return None if self.order is None else self.order()

    def _drain_backend(self) -> None:
        assert self._backend is not None
        self._backend.close()
        self._early.extend(self._backend.poll())
        self._backend = None

    def submit(self, job: TransferJob) -> None:
        """Queue `job`. Never raises for a bad job: it fails through `poll`."""
        self._in_flight += 1
        if self._closed:
            self._early.append(failed(job.job_id, ErrorCode.UNAVAILABLE, "engine closed"))
            return
        try:
            gpu, cpu = validate(job, self._kv, self.region.layout.num_blocks)
            assert self._use is not None
            self._use.check(job.job_id, job.direction, gpu)
        except JobError as e:
            self._early.append(failed(job.job_id, e.code, str(e)))
            return
        if len(gpu) == 0:
            self._early.append(TransferOutcome(job_id=job.job_id, success=True))
            return
        assert self._backend is not None
        self._use.hold(job.job_id, job.direction, gpu)
        try:
            self._backend.submit(job, gpu, cpu)
        except Exception as e:  # a device error while queueing: this job only
            log.exception("rank %d: job %d could not be queued", self.rank, job.job_id)
            self._early.append(failed(job.job_id, ErrorCode.FATAL, f"{type(e).__name__}: {e}"))

    def poll(self) -> list[TransferOutcome]:
        """Outcomes of finished jobs, each reported exactly once. Never blocks."""
        self._finished.clear()
        out = list(self._early)
        self._early.clear()
        if self._backend is not None:
            out += self._backend.poll()
        if self._use is not None:
            for outcome in out:
                self._use.release(outcome.job_id)
        self._in_flight -= len(out)
        return out

    def wait(self, timeout: float = 60.0) -> list[TransferOutcome]:
        """Collect outcomes until nothing is in flight or `timeout` passes (tests,
        benchmarks and shutdown; the worker's loop sleeps on `wakeup` instead)."""
        out: list[TransferOutcome] = []
        end = time.monotonic() + timeout
        while True:
            out += self.poll()
            left = end - time.monotonic()
            if self._in_flight == 0 or left <= 0:
                return out
            # Woken by the next finished job; the cap bounds a missed wakeup.
            self._finished.wait(min(left, 0.05))

    def close(self) -> None:
        """Wait for the job running, fail those not started (reported by a last
        `poll`), release the device resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._backend is not None:
            self._drain_backend()
        self._kv = None

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
