"""CUDA backend of the transfer engine: KV cache on the GPU, CPU tier in pinned
shared memory.

Design, and why:

* The region's data area is pinned (`workers.gpu.pinning`) when the backend starts,
  normally already by the worker before its hello. An unpinned region makes every
  copy synchronous: it is refused unless ``allow_unpinned`` (``[gpu]
  allow_unpinned`` in the config).
* Per direction, a kernel stream runs the gathers/scatters between the KV cache and
  a device staging buffer laid out like the CPU-tier pages, and a copy stream runs
  the DMA between staging and the pinned rows. Staging is double buffered: chunk k
  uses buffer k % 2, so the gather of a chunk overlaps the DMA of the previous one;
  a pair of events per buffer orders its reuse across streams, chunks and jobs. The
  two directions have their own streams and buffers: a load never waits behind a
  store, and both DMA directions use separate copy engines.
* The host side of a chunk is built as arrays by `workers.gpu.dma_plan` and issued in
  one ``cudaMemcpyBatchAsync`` (CUDA 12.8+), else one ``cudaMemcpy2DAsync`` per run
  of consecutive CPU ids, else (no libcudart reachable) one torch ``copy_`` per run;
  `workers.gpu.cudart.choose_dma_path` picks and says why. The job's pairs are sorted
  by CPU id first so runs are as long as the ids allow.
* Completion: the job's end event (``blocking=True``) is waited for by a thread
  (`workers.gpu.completion`), which wakes the worker's loop; nothing here polls or
  spins. A CUDA error is sticky for the context: that job and every later one fail
  as "fatal" and the worker should be restarted.
* Every CUDA call runs under the KV cache's device (and the waiting threads make it
  current), so a worker of GPU 3 never creates a context on GPU 0.
* Block ids travel to the device once per job through a pinned host tensor, so
  queueing a job never waits for earlier work on the stream.
* Ordered after the caller: at submit, an event is recorded on the submitting
  thread's current stream and the job's kernel stream (the one that reads or writes
  the KV cache) waits for it, as vLLM's own offloading handler does. Inside the
  engine's process a step's transfers are submitted after its forward pass was
  launched: a store must not read KV the model is still writing, and a load must not
  be overwritten by a write queued before it (the zeroing of newly allocated
  blocks). A load's DMA into staging does not wait: it overlaps the model. In the
  gpu worker process the current stream is its idle default stream, so the wait
  costs one event record.
* Every stream, event and device call goes through `workers.gpu.streams.StreamOps`
  (torch in production; the CPU tests record the calls and check their order).

The engine's kernels and this worker's gather/scatter kernels run in different
processes; without MPS the GPU time-slices between the two contexts. The kernels
are short (device bandwidth is ~100x the DMA bandwidth); the DMA itself runs on the
copy engines and overlaps the engine's compute.

Import cost: importing this module imports torch but does not initialize CUDA.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tierkv.core.errors import ErrorCode
from tierkv.wire.protocol import TransferJob, TransferOutcome
from workers.gpu.completion import CompletionWaiter, PendingJob
from workers.gpu.cudart import CudaCallError, Runtime, choose_dma_path, cuda_runtime
from workers.gpu.dma_plan import HostSide, copies_1d, copies_2d
from workers.gpu.jobs import DIRECTIONS, TransferError, failed
from workers.gpu.pinning import pin_host, refuse_message, unpin_host
from workers.gpu.streams import StreamOps, TorchStreams

if TYPE_CHECKING:
    from tierkv.core.shm import SharedRegion
    from tierkv.engine import KVLayout, OpenedKV

log = logging.getLogger("tierkv.transfer_cuda")

#: How long attach/close wait for the copies in flight before failing them.
DRAIN_TIMEOUT_S = 60.0

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_DEFAULT = object()


def word_size(layout: KVLayout) -> int:
    """The widest element that divides every piece and offset of a page: gathers
    move 8-byte words instead of bytes when the layout allows."""
    sizes = [layout.page_size, *layout.page_offsets]
    sizes += [layout.geometry(i)[1] for i in range(len(layout.tensor_shapes))]
    return next(w for w in (8, 4, 2, 1) if all(s % w == 0 for s in sizes))


@dataclass
class _Lane:
    """One direction's streams, double staging buffer and the events ordering it."""

    kernels: Any  # stream: gather / scatter, the only one touching the KV cache
    copies: Any  # stream: DMA
    staging: list[torch.Tensor]  # 2 x (capacity, page/word), word dtype
    ready: list[Any]  # per buffer: filled (by the gather, or by the DMA of a load)
    free: list[Any]  # per buffer: emptied (by the DMA of a store, or the scatter)
    caller: Any  # recorded on the submitter's current stream at each submit
    next_buffer: int = 0


@dataclass
class _Attached:
    """Everything that depends on the attached KV cache."""

    device: torch.device
    views: list[torch.Tensor]  # per tensor (outer, num_blocks, inner/word), word dtype
    geometry: list[tuple[int, int, int]]  # per tensor (page offset, outer, inner) in words
    lanes: dict[str, _Lane]
    capacity: int  # blocks per chunk (per staging buffer)
    word: int


class CudaBackend:
    """Queues jobs on this worker's CUDA streams. Methods run on the worker's main
    thread; only `attach` and `close` block (for the jobs in flight, bounded by
    `DRAIN_TIMEOUT_S`). `runtime` is the CUDA runtime seam and `streams` the stream
    seam (tests pass host ones)."""

    kind = "cuda"

    def __init__(self, region: SharedRegion, rank: int, staging_bytes: int = 64 << 20, *,
                 device: torch.device | None = None, allow_unpinned: bool = False,
                 notify: Callable[[], None] = lambda: None,
                 runtime: Runtime | None | object = _DEFAULT,
                 streams: StreamOps | None = None) -> None:
        self._ops: StreamOps = streams if streams is not None else TorchStreams()
        if not self._ops.available():
            raise TransferError("the KV cache is on CUDA but this process has no CUDA device")
        self.device = device if device is not None else self._ops.current_device()
        self._region = region
        self._rank = rank
        self._page = region.layout.page_size
        self._staging_bytes = staging_bytes
        self._host = region.torch_view()  # (num_blocks, row_stride) uint8, the whole data area
        self._host_ptr = self._host.data_ptr()
        self._host_flat = self._host.view(-1)
        self._hostside = HostSide(self._host_ptr, region.layout.row_stride, rank * self._page,
                                  self._page)
        self.pinned = pin_host(self._host_ptr, self._host.numel(), self.device.index)
        self._unpinned = False
        if not self.pinned.pinned and not allow_unpinned:
            self._release_host()
            raise TransferError(refuse_message(self.pinned))
        if not self.pinned.pinned:
            log.warning("rank %d: %s (allowed by [gpu] allow_unpinned)", rank,
                        refuse_message(self.pinned).split(". Raise")[0])
        self._runtime = cuda_runtime() if runtime is _DEFAULT else runtime
        choice = choose_dma_path(self._runtime)  # type: ignore[arg-type]
        self.dma_path, self.dma_reason = choice.path, choice.reason
        if choice.reason:
            log.info("rank %d: DMA by %s (%s)", rank, choice.path, choice.reason)
        self._at: _Attached | None = None
        self._done: deque[TransferOutcome] = deque()
        self.stats = {"jobs": 0, "dma_calls": 0, "submit_cpu_s": 0.0}
        self._waiter = CompletionWaiter(f"tierkv-cuda-r{rank}", notify,
                                        bind_thread=lambda: self._ops.bind(self.device))

    def describe(self) -> dict[str, Any]:
        """What gpu-check and the logs report about this backend."""
        at = self._at
        return {"device": str(self.device), "pinned": self.pinned.pinned,
                "pin_seconds": self.pinned.seconds, "pin_error": self.pinned.error,
                "dma_path": self.dma_path, "dma_reason": self.dma_reason,
                "word": at.word if at else 0, "chunk_blocks": at.capacity if at else 0,
                "staging_buffers": 2}

    # -- attach / close ---------------------------------------------------------------

    def attach(self, kv: OpenedKV | None) -> None:
        self._drain()
        if kv is None:
            self._at = None
            return
        if kv.device != self.device:
            raise TransferError(f"this backend copies for {self.device}, the KV cache is on "
                                f"{kv.device}")
        with self._ops.on_device(self.device):
            self._at = self._attached(kv)
        at = self._at
        log.info("rank %d: cuda backend on %s, %d-byte words, %d blocks per chunk x 2 "
                 "buffers, DMA by %s, %s", self._rank, self.device, at.word, at.capacity,
                 self.dma_path, "pinned" if self.pinned.pinned else "NOT pinned")

    def _attached(self, kv: OpenedKV) -> _Attached:
        word = word_size(kv.layout)
        try:
            views = [v.view(_WORDS[word]) for v in kv.block_views()]
        except RuntimeError:  # a tensor not aligned to the word: move bytes
            word = 1
            views = kv.block_views()
        geometry = [
            (off // word, outer, inner // word)
            for off, (outer, inner) in zip(
                kv.layout.page_offsets,
                (kv.layout.geometry(i) for i in range(len(views))), strict=True)
        ]
        capacity = max(1, min(self._staging_bytes // 2 // self._page, kv.layout.num_blocks,
                              self._region.layout.num_blocks))
        old = self._at
        if (old is not None and old.capacity == capacity and old.word == word
                and old.device == kv.device):
            lanes = old.lanes
        else:
            lanes = {d: self._lane(capacity, word) for d in DIRECTIONS}
        return _Attached(kv.device, views, geometry, lanes, capacity, word)

    def _lane(self, capacity: int, word: int) -> _Lane:
        ops = self._ops
        kernels, copies = ops.new_stream(self.device), ops.new_stream(self.device)
        staging = []
        for _ in range(2):
            with ops.issue_on(kernels):
                staging.append(torch.empty((capacity, self._page // word), dtype=_WORDS[word],
                                           device=self.device))
        return _Lane(kernels, copies, staging, [ops.new_event() for _ in range(2)],
                     [ops.new_event() for _ in range(2)], ops.new_event())

    def close(self) -> None:
        try:
            self._waiter.close(DRAIN_TIMEOUT_S)
            self._done.extend(self._waiter.poll())
        finally:
            self._at = None
            self._release_host()

    def _release_host(self) -> None:
        if not self._unpinned:
            self._unpinned = True
            unpin_host(self._host_ptr, self.device.index)
            del self._host, self._host_flat  # release the region's map

    def _drain(self) -> None:
        """Wait for the jobs in flight (blocks, bounded), collecting their outcomes."""
        if not self._waiter.wait_idle(DRAIN_TIMEOUT_S):
            self._waiter.fail_all(f"copies did not finish within {DRAIN_TIMEOUT_S:.0f} s")
        self._done.extend(self._waiter.poll())

    # -- jobs ------------------------------------------------------------------------------

    def submit(self, job: TransferJob, gpu: np.ndarray, cpu: np.ndarray) -> None:
        cpu_start = time.thread_time()
        broken = self._waiter.broken
        at = self._at
        if broken is not None or at is None:
            self._done.append(failed(job.job_id, ErrorCode.FATAL if broken else
                                     ErrorCode.UNAVAILABLE, broken or "no KV cache attached"))
            return
        order = np.argsort(cpu, kind="stable")
        cpu, gpu = cpu[order], gpu[order]
        lane = at.lanes[job.direction]
        store = job.direction == "store"
        ops = self._ops
        start = ops.new_event(timing=True)
        end = ops.new_event(timing=True, blocking=True)
        calls = 0
        with ops.on_device(at.device):
            self._after_caller(at, lane)
            ops.record(start, lane.kernels if store else lane.copies)
            index_host = ops.pinned(torch.from_numpy(gpu))
            with ops.issue_on(lane.kernels):
                index = index_host.to(at.device, non_blocking=True)
            for lo in range(0, len(cpu), at.capacity):
                calls += self._chunk(at, lane, store, cpu[lo : lo + at.capacity],
                                     index[lo : lo + at.capacity])
            ops.record(end, lane.copies if store else lane.kernels)
        self.stats["jobs"] += 1
        self.stats["dma_calls"] += calls
        self.stats["submit_cpu_s"] += time.thread_time() - cpu_start
        self._waiter.add(job.direction, PendingJob(
            job.job_id, len(cpu) * self._page, end,
            lambda: ops.seconds(start, end), keep=[index_host, index]))

    def _after_caller(self, at: _Attached, lane: _Lane) -> None:
        """Make the job's kernel stream wait for the work queued so far on the
        submitting thread's current stream (see the module docstring: the model's
        writes, or a zeroing, still running when the engine submits). The wait is
        queued before anything of the job, so every chunk's gather or scatter is
        behind it; the one event per lane is recorded again at each submit (a wait
        takes the record current when it is queued)."""
        self._ops.record(lane.caller, self._ops.current_stream(at.device))
        self._ops.wait(lane.kernels, lane.caller)

    def _chunk(self, at: _Attached, lane: _Lane, store: bool, cpu: np.ndarray,
               index: torch.Tensor) -> int:
        """One chunk through staging buffer `lane.next_buffer`; returns its DMA calls."""
        b = lane.next_buffer
        lane.next_buffer ^= 1
        buf = lane.staging[b]
        ops = self._ops
        if store:
            ops.wait(lane.kernels, lane.free[b])
            with ops.issue_on(lane.kernels):
                self._gather(at, buf, index)
            ops.record(lane.ready[b], lane.kernels)
            ops.wait(lane.copies, lane.ready[b])
            calls = self._dma(buf, cpu, True, lane.copies)
            ops.record(lane.free[b], lane.copies)
        else:
            ops.wait(lane.copies, lane.free[b])
            calls = self._dma(buf, cpu, False, lane.copies)
            ops.record(lane.ready[b], lane.copies)
            ops.wait(lane.kernels, lane.ready[b])
            with ops.issue_on(lane.kernels):
                self._scatter(at, buf, index)
            ops.record(lane.free[b], lane.kernels)
        return calls

    def _stage_view(self, at: _Attached, buf: torch.Tensor, i: int, k: int) -> torch.Tensor:
        """Tensor i's pieces of the first k staged pages, as (outer, k, inner) words."""
        off, outer, inner = at.geometry[i]
        return buf[:k, off : off + outer * inner].unflatten(1, (outer, inner)).permute(1, 0, 2)

    def _gather(self, at: _Attached, buf: torch.Tensor, index: torch.Tensor) -> None:
        k = len(index)
        for i, view in enumerate(at.views):
            torch.index_select(view, 1, index, out=self._stage_view(at, buf, i, k))

    def _scatter(self, at: _Attached, buf: torch.Tensor, index: torch.Tensor) -> None:
        k = len(index)
        for i, view in enumerate(at.views):
            view.index_copy_(1, index, self._stage_view(at, buf, i, k))

    def _dma(self, buf: torch.Tensor, cpu: np.ndarray, to_host: bool, stream: Any) -> int:
        """Move the chunk between staging `buf` and this rank's pages on `stream`, by
        the chosen path; returns the number of DMA calls it took."""
        handle = self._ops.handle(stream)
        if self.dma_path == "batch":
            copies = copies_1d(cpu, self._hostside, buf.data_ptr(), to_host)
            try:
                self._runtime.memcpy_batch(copies.dst, copies.src, copies.size, handle)  # type: ignore[attr-defined]
                return 1
            except CudaCallError as e:  # e.g. a driver older than the runtime
                fallback = "2d" if self._runtime.has_2d else "copy"  # type: ignore[attr-defined]
                self.dma_path, self.dma_reason = fallback, str(e)
                log.warning("rank %d: %s; DMA by %s from now on", self._rank, e, fallback)
        if self.dma_path == "2d":
            plan = copies_2d(cpu, self._hostside, buf.data_ptr(), to_host)
            memcpy_2d = self._runtime.memcpy_2d  # type: ignore[attr-defined]
            for dst, dpitch, src, spitch, width, height in plan.rows():
                memcpy_2d(dst, dpitch, src, spitch, width, height, handle)
            return len(plan)
        return self._dma_by_torch(buf, cpu, to_host, stream)

    def _dma_by_torch(self, buf: torch.Tensor, cpu: np.ndarray, to_host: bool,
                      stream: Any) -> int:
        """No runtime reachable: torch copy_ per run (contiguous rows) or per row."""
        stage = buf.view(torch.uint8).view(-1)
        plan = copies_2d(cpu, self._hostside, buf.data_ptr(), to_host)
        host_addr, stage_addr = (plan.dst, plan.src) if to_host else (plan.src, plan.dst)
        calls = 0
        with self._ops.issue_on(stream):
            for h, s, w, n in zip(host_addr.tolist(), stage_addr.tolist(),
                                  plan.width.tolist(), plan.height.tolist(), strict=True):
                h0, s0 = h - self._host_ptr, s - buf.data_ptr()
                pitch = self._hostside.row if n > 1 else w
                for r in range(n):
                    host = self._host_flat[h0 + r * pitch : h0 + r * pitch + w]
                    dev = stage[s0 + r * w : s0 + (r + 1) * w]
                    if to_host:
                        host.copy_(dev, non_blocking=True)
                    else:
                        dev.copy_(host, non_blocking=True)
                    calls += 1
        return calls

    def poll(self) -> list[TransferOutcome]:
        out = list(self._done)
        self._done.clear()
        return out + self._waiter.poll()
