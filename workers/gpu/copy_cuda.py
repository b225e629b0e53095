"""CUDA backend of the transfer engine (issue 5): KV cache on the GPU, CPU tier in
pinned shared memory.

Design, and why:

* The region's data area is registered with ``cudaHostRegister`` once per process
  (reference counted, so several engines of one process can share a mapping), so a
  copy to or from it is real DMA that does not block the host. If registration
  fails, one warning is logged and copies still work, synchronously, through
  CUDA's pageable staging.
* Each direction has its own CUDA stream (stores: device -> host, loads: host ->
  device), so jobs of a direction run in submission order and a load never waits
  behind a store; the two DMA directions use separate copy engines.
* A job is a few large DMA transfers, not one per layer and block: on the stream,
  the blocks' pieces (one per tensor and K/V) are gathered with ``index_select``
  into a device staging buffer laid out exactly like the CPU-tier pages (block
  after block), and each run of consecutive CPU block ids is then one DMA transfer
  from staging into the pinned rows. Loads do the reverse (DMA into staging, then
  ``index_copy_``). The job's pairs are sorted by CPU id first so runs are as long
  as the ids allow; the staging buffer (``staging_bytes`` per direction) bounds a
  chunk, and the stream orders the reuse of the buffer between chunks and jobs.
* When this rank's page is not the whole row (world_size > 1, or a page that is not
  a multiple of 4 KiB), a run of rows is strided on the host: one
  ``cudaMemcpy2DAsync`` (called through the CUDA runtime that torch loaded) moves
  it. Without it (runtime not found, or ``TIERKV_CUDA_NO_MEMCPY2D=1``) the run is
  copied row by row.
* Completion is tracked with a CUDA event per job, polled with ``event.query()``;
  nothing here synchronizes a stream except `attach`/`close`, which must wait for
  the jobs in flight. A CUDA error is sticky for the context: the job that
  observes it and every later job fail as "fatal", and the worker process should
  be restarted.
* Block ids travel to the device through a pinned host tensor, so queueing a job
  never waits for earlier work on the stream.

The engine's kernels and this worker's gather/scatter kernels run in different
processes; without MPS the GPU time-slices between the two contexts. The kernels
are short (device bandwidth is ~100x the DMA bandwidth); the DMA itself overlaps
with the engine's compute.

Import cost: importing this module imports torch but does not initialize CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tierkv.core.errors import ErrorCode
from tierkv.wire.protocol import TransferJob, TransferOutcome
from workers.gpu.jobs import DIRECTIONS, TransferError, failed, runs

if TYPE_CHECKING:
    from tierkv.core.shm import SharedRegion
    from tierkv.engine import KVLayout, OpenedKV

log = logging.getLogger("tierkv.transfer_cuda")

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (UVA)

# -- pinning the region (process-wide, reference counted) -------------------------------

_PIN_LOCK = threading.Lock()
_PINNED: dict[int, list[int]] = {}  # address -> [references, size, registered 0/1]
_PIN_WARNED = False


def pin_host(ptr: int, size: int) -> bool:
    """cudaHostRegister [ptr, ptr+size) unless this process already did. Returns
    whether the memory is pinned; on failure warns once and returns False."""
    global _PIN_WARNED
    with _PIN_LOCK:
        entry = _PINNED.get(ptr)
        if entry is not None:
            entry[0] += 1
            return bool(entry[2])
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
        ok = rc == 0
        if not ok:
            _clear_last_error()
            if not _PIN_WARNED:
                _PIN_WARNED = True
                log.warning(
                    "cudaHostRegister of the CPU tier (%.1f MiB) failed with cudaError %d: "
                    "copies fall back to pageable, synchronous transfers (check the locked "
                    "memory limit, ulimit -l)", size / 2**20, rc,
                )
        _PINNED[ptr] = [1, size, int(ok)]
        return ok


def unpin_host(ptr: int) -> None:
    """Drop one reference; the last one unregisters (after the copies finished)."""
    with _PIN_LOCK:
        entry = _PINNED.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] > 0:
            return
        del _PINNED[ptr]
        if entry[2]:
            rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
            if rc != 0:
                _clear_last_error()
                log.warning("cudaHostUnregister failed with cudaError %d", rc)


# -- the CUDA runtime, for the one call torch does not expose ---------------------------

_RUNTIME: Any = None
_RUNTIME_LOOKED = False


def cuda_runtime() -> ctypes.CDLL | None:
    """The libcudart torch loaded (found in /proc/self/maps), else any libcudart on
    the loader path. None if there is none (statically linked torch)."""
    global _RUNTIME, _RUNTIME_LOOKED
    if _RUNTIME_LOOKED:
        return _RUNTIME
    _RUNTIME_LOOKED = True
    torch.cuda.init()
    candidates = []
    try:
        with open("/proc/self/maps") as f:
            candidates += sorted({
                line.split()[-1] for line in f if "libcudart.so" in line.split()[-1]
            })
    except OSError:
        pass
    candidates += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetLastError.restype = ctypes.c_int
        log.debug("using %s for cudaMemcpy2DAsync", name)
        _RUNTIME = lib
        break
    return _RUNTIME


def _clear_last_error() -> None:
    """A failed cudaHostRegister leaves a 'last error' that torch would report at
    its next kernel launch check; reset it if we can reach the runtime."""
    lib = cuda_runtime()
    if lib is not None:
        lib.cudaGetLastError()


def memcpy2d_async(
    dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int
) -> None:
    lib = cuda_runtime()
    assert lib is not None
    rc = lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                               CUDA_MEMCPY_DEFAULT, stream)
    if rc != 0:
        lib.cudaGetLastError()
        msg = lib.cudaGetErrorString(rc).decode(errors="replace")
        raise RuntimeError(f"cudaMemcpy2DAsync failed: cudaError {rc} ({msg})")


# -- the backend ---------------------------------------------------------------------------


@dataclass
class _Pending:
    job_id: int
    start: torch.cuda.Event
    end: torch.cuda.Event
    nbytes: int
    keep: list[torch.Tensor] = field(default_factory=list)  # alive until the job is done


@dataclass
class _Attached:
    """Everything that depends on the attached KV cache."""

    device: torch.device
    views: list[torch.Tensor]  # per tensor (outer, num_blocks, inner/word), word dtype
    geometry: list[tuple[int, int, int]]  # per tensor (page offset, outer, inner) in words
    streams: dict[str, torch.cuda.Stream]
    staging: dict[str, torch.Tensor]  # per direction (capacity, page/word), word dtype
    capacity: int  # blocks per chunk


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_size(layout: KVLayout) -> int:
    """The widest element that divides every piece and offset of a page: gathers
    move 8-byte words instead of bytes when the layout allows."""
    sizes = [layout.page_size, *layout.page_offsets]
    sizes += [layout.geometry(i)[1] for i in range(len(layout.tensor_shapes))]
    return next(w for w in (8, 4, 2, 1) if all(s % w == 0 for s in sizes))


class CudaBackend:
    """Queues jobs on this worker's CUDA streams. All methods run on the worker's
    main thread; only `attach` and `close` block (for the jobs in flight)."""

    kind = "cuda"

    def __init__(self, region: SharedRegion, rank: int, staging_bytes: int = 64 << 20) -> None:
        if not torch.cuda.is_available():
            raise TransferError("the KV cache is on CUDA but this process has no CUDA device")
        self._region = region
        self._rank = rank
        self._page = region.layout.page_size
        self._row = region.layout.row_stride
        self._staging_bytes = staging_bytes
        self._host = region.torch_view()  # (num_blocks, row_stride) uint8, the whole data area
        self._host_ptr = self._host.data_ptr()
        self._host_flat = self._host.view(-1)
        self._pinned = pin_host(self._host_ptr, self._host.numel())
        self._unpinned = False
        strided = self._row != self._page
        use_2d = os.environ.get("TIERKV_CUDA_NO_MEMCPY2D", "") in ("", "0")
        self._use_2d = strided and use_2d and cuda_runtime() is not None
        if strided and not self._use_2d:
            log.warning("rank %d: strided CPU-tier rows are copied row by row "
                        "(no cudaMemcpy2DAsync)", rank)
        self._at: _Attached | None = None
        self._pending: dict[str, deque[_Pending]] = {d: deque() for d in DIRECTIONS}
        self._done: deque[TransferOutcome] = deque()
        self._broken: str | None = None

    # -- attach / close ---------------------------------------------------------------

    def attach(self, kv: OpenedKV | None) -> None:
        self._drain()
        if kv is None:
            self._at = None
            return
        device = kv.device
        with torch.cuda.device(device):
            word = word_size(kv.layout)
            try:
                views = [v.view(_WORDS[word]) for v in kv.block_views()]
            except RuntimeError:  # a tensor not aligned to the word: move bytes
                word = 1
                views = kv.block_views()
            wdtype = _WORDS[word]
            geometry = [
                (off // word, outer, inner // word)
                for off, (outer, inner) in zip(
                    kv.layout.page_offsets,
                    (kv.layout.geometry(i) for i in range(len(views))),
                    strict=True,
                )
            ]
            capacity = max(1, min(self._staging_bytes // self._page, kv.layout.num_blocks,
                                  self._region.layout.num_blocks))
            old = self._at
            reuse = old is not None and old.device == device and old.capacity == capacity \
                and old.staging["store"].dtype == wdtype
            if reuse and old is not None:
                streams, staging = old.streams, old.staging
            else:
                streams = {d: torch.cuda.Stream(device) for d in DIRECTIONS}
                staging = {}
                for d in DIRECTIONS:
                    with torch.cuda.stream(streams[d]):
                        staging[d] = torch.empty(
                            (capacity, self._page // word), dtype=wdtype, device=device
                        )
        self._at = _Attached(device, views, geometry, streams, staging, capacity)
        log.info("rank %d: cuda backend on %s, %d-byte words, %d blocks per chunk%s",
                 self._rank, device, word, capacity, "" if self._pinned else " (NOT pinned)")

    def close(self) -> None:
        try:
            self._drain()
        finally:
            self._at = None
            if not self._unpinned:
                self._unpinned = True
                unpin_host(self._host_ptr)
                del self._host, self._host_flat  # release the region's map

    def _drain(self) -> None:
        """Wait for the jobs in flight (blocks), collecting their outcomes."""
        at = self._at
        if at is None:
            return
        for d in DIRECTIONS:
            try:
                at.streams[d].synchronize()
            except RuntimeError as e:
                self._fail_all(f"CUDA error: {e}")
        self._collect()

    # -- jobs ------------------------------------------------------------------------------

    def submit(self, job: TransferJob, gpu: np.ndarray, cpu: np.ndarray) -> None:
        if self._broken is not None:
            self._done.append(failed(job.job_id, ErrorCode.FATAL, self._broken))
            return
        at = self._at
        if at is None:
            self._done.append(failed(job.job_id, ErrorCode.UNAVAILABLE, "no KV cache attached"))
            return
        order = np.argsort(cpu, kind="stable")
        cpu, gpu = cpu[order], gpu[order]
        stream = at.streams[job.direction]
        pending = _Pending(job.job_id, torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True), len(cpu) * self._page)
        with torch.cuda.device(at.device), torch.cuda.stream(stream):
            pending.start.record(stream)
            for lo in range(0, len(cpu), at.capacity):
                cc, gg = cpu[lo : lo + at.capacity], gpu[lo : lo + at.capacity]
                index = torch.from_numpy(gg).pin_memory().to(at.device, non_blocking=True)
                pending.keep.append(index)
                if job.direction == "store":
                    self._gather(at, index)
                    self._dma(at, cc, to_host=True)
                else:
                    self._dma(at, cc, to_host=False)
                    self._scatter(at, index)
            pending.end.record(stream)
        self._pending[job.direction].append(pending)

    def _stage_view(self, at: _Attached, direction: str, i: int, k: int) -> torch.Tensor:
        """Tensor i's pieces of the first k staged pages, as (outer, k, inner) words."""
        off, outer, inner = at.geometry[i]
        rows = at.staging[direction][:k, off : off + outer * inner]
        return rows.unflatten(1, (outer, inner)).permute(1, 0, 2)

    def _gather(self, at: _Attached, index: torch.Tensor) -> None:
        k = len(index)
        for i, view in enumerate(at.views):
            torch.index_select(view, 1, index, out=self._stage_view(at, "store", i, k))

    def _scatter(self, at: _Attached, index: torch.Tensor) -> None:
        k = len(index)
        for i, view in enumerate(at.views):
            view.index_copy_(1, index, self._stage_view(at, "load", i, k))

    def _dma(self, at: _Attached, cpu: np.ndarray, to_host: bool) -> None:
        """One transfer per run of consecutive CPU ids between staging rows and this
        rank's pages; runs on the current (direction's) stream."""
        staging = at.staging["store" if to_host else "load"]
        stage_flat = staging.view(torch.uint8).view(-1)
        stage_ptr = staging.data_ptr()
        page, row, base = self._page, self._row, self._rank * self._page
        stream = torch.cuda.current_stream().cuda_stream
        starts, lengths = runs(cpu)
        for a, n in zip(starts.tolist(), lengths.tolist(), strict=True):
            c0 = int(cpu[a])
            if row == page:
                host = self._host_flat[c0 * row : (c0 + n) * row]
                dev = stage_flat[a * page : (a + n) * page]
                _copy(host, dev, to_host)
            elif self._use_2d:
                host_ptr = self._host_ptr + c0 * row + base
                dev_ptr = stage_ptr + a * page
                if to_host:
                    memcpy2d_async(host_ptr, row, dev_ptr, page, page, n, stream)
                else:
                    memcpy2d_async(dev_ptr, page, host_ptr, row, page, n, stream)
            else:
                for r in range(n):
                    host = self._host[c0 + r, base : base + page]
                    _copy(host, stage_flat[(a + r) * page : (a + r + 1) * page], to_host)

    def poll(self) -> list[TransferOutcome]:
        self._collect()
        out = list(self._done)
        self._done.clear()
        return out

    def _collect(self) -> None:
        """Move finished jobs (events complete, in stream order) to the outcomes."""
        for d in DIRECTIONS:
            queue = self._pending[d]
            while queue:
                p = queue[0]
                try:
                    if not p.end.query():
                        break
                    seconds = p.start.elapsed_time(p.end) / 1000.0
                except RuntimeError as e:
                    self._fail_all(f"CUDA error: {e}")
                    return
                queue.popleft()
                self._done.append(TransferOutcome(
                    job_id=p.job_id, success=True, bytes_moved=p.nbytes, seconds=seconds,
                ))

    def _fail_all(self, reason: str) -> None:
        """A sticky CUDA error: every job in flight and every later one fails."""
        if self._broken is None:
            log.error("rank %d: %s; failing every job until the worker restarts",
                      self._rank, reason)
        self._broken = reason
        for d in DIRECTIONS:
            while self._pending[d]:
                p = self._pending[d].popleft()
                self._done.append(failed(p.job_id, ErrorCode.FATAL, reason))


def _copy(host: torch.Tensor, dev: torch.Tensor, to_host: bool) -> None:
    if to_host:
        host.copy_(dev, non_blocking=True)
    else:
        dev.copy_(host, non_blocking=True)

