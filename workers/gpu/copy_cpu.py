"""CPU backend of the transfer engine: the KV cache is CPU tensors in shared memory.

One background thread runs the copies (numpy releases the GIL while it copies, so
the worker's socket loop keeps running), one job at a time: loads first when both
directions wait, each direction in submission order.

Ordering after the model: the CUDA path orders a job after the work queued on the
submitting thread's current stream; here there is no stream, so the submitter may
hand an `order` (`workers.gpu.streams.HostOrder`): called on the submitting thread
at `submit`, it returns a fence for the KV writes launched so far (a CPU model
running on a thread of its own), and the copy thread waits for that fence before it
touches the job's blocks. A store submitted while the model still writes reads the
finished KV; a load is not overwritten by a write launched before it.

How a job is copied (measured on CPU; see tierkv/bench/copy_engine.py):
every tensor is seen as bytes ``(blocks, outer, inner)`` on both sides (the KV
cache and this rank's pages of the region), so a block is `outer` pieces of
`inner` bytes. The job's pairs are sorted by *source* id and cut into runs of
consecutive source ids:

* a run whose destination ids are consecutive too is one strided slice copy
  (``np.copyto``) per tensor;
* a long run with scattered destinations is one ``dst[ids] = src[a:b]`` per tensor:
  numpy's fancy assignment reads the source view in place, one pass over memory;
* short runs (fewer than `MIN_RUN_BYTES` per tensor) are gathered in chunks that
  stay in cache (``src[ids]``, a small temporary) and scattered from there.
  (``np.take(..., out=)`` would avoid the temporary, but it first copies a
  non-contiguous source whole: 30x slower here.)

Loads into a KV cache whose blocks lie inside its pieces (``per_layer``: piece `o`
of every block is one stretch of the tensor) need another order. numpy walks a
copy in the destination's order, so a slice copy per tensor reads one piece from
every row of the run, rows a page apart, then the next piece the same way: ~1.0x
a chunked memcpy of the layout. When every tensor has the same geometry and the
tensors lie evenly spaced (as `allocate_kv_cache` places them) one view covers
them all (`SideViews.stacked`), and a run of consecutive blocks is copied
`GROUP_BLOCKS` blocks a call over every tensor: 1.3-1.4x the chunked memcpy with
256 KiB and 2 MiB pages (with 256 KiB pages 1, 3, 4, 6, 8, 16 or 32 blocks a call
made 0.95-1.25x; with 1 KiB pieces no order gained: `GROUP_MIN_PIECE`). Stores
from such a cache take the same stacked views the other way, the whole run in one
call: numpy then writes each row of the region front to back and reads the pieces
of every tensor in turn, as the chunked memcpy does. With 256 KiB pages it made
1.03-1.07x the chunked memcpy where the slice copy per tensor (two sequential
streams read per tensor, each row written a piece at a time across the run) made
0.93-1.00x; with 2 MiB pages both about 0.94x.

torch's CPU index_select/index_copy_ move bytes one element at a time and were
10-30x slower than numpy's memmove-based paths; torch intra-op threads made
copies slower on every machine we measured (memory bound). Hence numpy here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from tierkv.core.errors import ErrorCode
from tierkv.wire.protocol import TransferJob, TransferOutcome
from workers.gpu.jobs import JobError, check_deadline, failed, runs

if TYPE_CHECKING:
    from tierkv.core.shm import SharedRegion
    from tierkv.engine import OpenedKV
    from workers.gpu.streams import HostFence, HostOrder

log = logging.getLogger("tierkv.transfer_cpu")

#: A run shorter than this (bytes per tensor) goes through the gather path: below
#: it the per-call overhead of a slice copy outweighs the second pass over memory.
MIN_RUN_BYTES = 16 << 10
#: Gather chunk per tensor: small enough to stay in L2 between gather and scatter.
CHUNK_BYTES = 512 << 10
#: Blocks per call of a grouped copy (see the module's doc): 2 measured fastest.
GROUP_BLOCKS = 2
#: Grouped copies only for pieces at least this big: with 1 KiB pieces the extra
#: calls cost what the better order saves.
GROUP_MIN_PIECE = 4 << 10
#: How long a job waits for the model's writes it is ordered after before it fails
#: (a model that never finishes must not hold the copy thread, and attach/close, for ever).
FENCE_TIMEOUT_S = 60.0


class SideViews(list[np.ndarray]):
    """One side's byte views, ``(blocks, outer, inner)`` per tensor. `stacked`: the
    same bytes as one ``(blocks, tensors, outer, inner)`` view (element ``[b, t]``
    is ``self[t][b]``, same address), or None when the tensors' geometries differ
    or they are not evenly spaced."""

    def __init__(self, views: list[np.ndarray]) -> None:
        super().__init__(views)
        self.stacked = _stack(views)


_Views = tuple[SideViews, SideViews]  # (kv side, region side)
# A job waiting for the copy thread: its ids, and the fence it is ordered after.
_Queued = tuple[TransferJob, np.ndarray, np.ndarray, "HostFence | None"]


class CpuBackend:
    """Runs jobs on one thread; `submit`/`poll` are called from the worker's main
    thread and only touch queues under a lock."""

    kind = "cpu"
    device = None  # follows any CPU KV cache

    def __init__(self, region: SharedRegion, rank: int,
                 notify: Callable[[], None] = lambda: None,
                 order: HostOrder | None = None) -> None:
        self._region = region
        self._rank = rank
        self._notify = notify  # called on the copy thread each time a job finished
        self._order = order  # called on the submitting thread: what a job waits for
        self._views: _Views | None = None
        self._queues: dict[str, deque[_Queued]] = {
            "load": deque(), "store": deque(),
        }
        self._done: deque[TransferOutcome] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"tierkv-transfer-cpu-r{rank}", daemon=True
        )
        self._thread.start()

    # -- main thread -----------------------------------------------------------------

    def attach(self, kv: OpenedKV | None) -> None:
        """Wait until the queues are empty, then swap the views (None: drop them)."""
        views = None if kv is None else _views(kv, self._region, self._rank)
        with self._cond:
            self._cond.wait_for(lambda: self._idle() or self._stopping)
            self._views = views

    def submit(self, job: TransferJob, gpu: np.ndarray, cpu: np.ndarray) -> None:
        # Asked here, on the submitting thread: the fence covers the writes this
        # thread launched before the job, not those launched after.
        fence = None if self._order is None else self._order()
        with self._cond:
            if self._stopping:
                self._done.append(failed(job.job_id, ErrorCode.UNAVAILABLE, "engine closing"))
                return
            self._queues[job.direction].append((job, gpu, cpu, fence))
            self._cond.notify_all()

    def poll(self) -> list[TransferOutcome]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        """Finish the running job, fail the queued ones, stop the thread."""
        with self._cond:
            self._stopping = True
            for q in self._queues.values():
                while q:
                    job = q.popleft()[0]
                    self._done.append(failed(job.job_id, ErrorCode.UNAVAILABLE, "engine closed"))
            self._cond.notify_all()
        self._thread.join()
        self._views = None

    def _idle(self) -> bool:
        return not self._busy and not any(self._queues.values())

    # -- copy thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or any(self._queues.values()))
                if self._stopping:
                    self._cond.notify_all()
                    return
                queue = self._queues["load"] or self._queues["store"]
                job, gpu, cpu, fence = queue.popleft()
                self._busy = True
                views = self._views
            try:
                self._done.append(self._execute(job, gpu, cpu, views, fence))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                self._notify()

    def _execute(
        self,
        job: TransferJob,
        gpu: np.ndarray,
        cpu: np.ndarray,
        views: _Views | None,
        fence: HostFence | None = None,
    ) -> TransferOutcome:
        try:
            if fence is not None and not fence.wait(FENCE_TIMEOUT_S):
                raise JobError(ErrorCode.TIMEOUT, f"job {job.job_id}: the KV writes it is "
                               f"ordered after did not finish within {FENCE_TIMEOUT_S:.0f} s")
            start = time.monotonic()
            check_deadline(job, start)
            if views is None:
                raise JobError(ErrorCode.UNAVAILABLE, f"job {job.job_id}: no KV cache attached")
            kv_side, region_side = views
            if job.direction == "store":
                copy_blocks(kv_side, region_side, gpu, cpu)
            else:
                copy_blocks(region_side, kv_side, cpu, gpu)
        except JobError as e:
            return failed(job.job_id, e.code, str(e))
        except Exception as e:  # a bug or a vanished mapping: report, keep serving
            log.exception("rank %d: job %d failed", self._rank, job.job_id)
            return failed(job.job_id, ErrorCode.FATAL, f"{type(e).__name__}: {e}")
        moved = len(gpu) * self._region.layout.page_size
        return TransferOutcome(
            job_id=job.job_id, success=True, bytes_moved=moved,
            seconds=time.monotonic() - start,
        )


def _views(kv: OpenedKV, region: SharedRegion, rank: int) -> _Views:
    """numpy byte views ``(blocks, outer, inner)`` of each tensor on both sides."""
    layout = kv.layout
    rows = region.numpy()
    stride = region.layout.row_stride
    base = rank * region.layout.page_size
    kv_side, region_side = [], []
    for i, bv in enumerate(kv.byte_block_views()):
        outer, inner = layout.geometry(i)
        kv_side.append(bv.transpose(1, 0, 2))
        start = base + layout.page_offsets[i]
        region_side.append(np.lib.stride_tricks.as_strided(
            rows[:, start:], (region.layout.num_blocks, outer, inner), (stride, inner, 1)
        ))
    return SideViews(kv_side), SideViews(region_side)


def _stack(views: list[np.ndarray]) -> np.ndarray | None:
    """All tensors as one view, when they share shape and strides and their starts
    are evenly spaced; every element is the same byte as in its tensor's view, so
    the view reaches no memory the tensors do not."""
    if not views:
        return None
    first = views[0]
    if any(v.shape != first.shape or v.strides != first.strides for v in views):
        return None
    starts = [v.__array_interface__["data"][0] for v in views]
    step = starts[1] - starts[0] if len(starts) > 1 else 0
    if any(b - a != step for a, b in zip(starts, starts[1:], strict=False)):
        return None
    blocks, outer, inner = first.shape
    sb, so, si = first.strides
    return np.lib.stride_tricks.as_strided(
        first, (blocks, len(views), outer, inner), (sb, step, so, si))


def _grouped(src: list[np.ndarray], dst: list[np.ndarray]
             ) -> tuple[np.ndarray, np.ndarray, int | None] | None:
    """(src, dst, blocks per call; None: the whole run) stacked views when runs copy
    faster over all tensors at once: the destination keeps blocks inside its pieces
    (a load into a KV cache), or the source does and the destination holds each
    block in one stretch (a store into the region's rows); and the pieces are big
    enough. Else None."""
    s = getattr(src, "stacked", None)
    d = getattr(dst, "stacked", None)
    if s is None or d is None or d.shape[3] * d.itemsize < GROUP_MIN_PIECE:
        return None
    if _blocks_inner(d):
        return s, d, GROUP_BLOCKS
    if _blocks_inner(s) and _block_whole(d):
        return s, d, None
    return None


def _blocks_inner(v: np.ndarray) -> bool:
    """A stacked view whose blocks lie inside its pieces (a per-layer KV cache)."""
    return any(n > 1 and abs(st) > abs(v.strides[0])
               for n, st in zip(v.shape[1:3], v.strides[1:3], strict=True))


def _block_whole(v: np.ndarray) -> bool:
    """A stacked view each of whose blocks is one stretch of bytes, front to back."""
    _, tensors, outer, inner = v.shape
    return (v.strides[3] == v.itemsize and v.strides[2] == inner * v.itemsize
            and (tensors == 1 or v.strides[1] == outer * inner * v.itemsize))


def _copy_grouped(src: np.ndarray, dst: np.ndarray, s0: int, d0: int, n: int,
                  group: int | None) -> None:
    """Blocks ``s0..s0+n`` of `src` to ``d0..`` of `dst`, `group` per call."""
    group = group or n
    for k in range(0, n, group):
        m = min(group, n - k)
        np.copyto(dst[d0 + k : d0 + k + m], src[s0 + k : s0 + k + m])


def copy_blocks(
    src: list[np.ndarray],
    dst: list[np.ndarray],
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
) -> None:
    """``dst[t][dst_ids[j]] = src[t][src_ids[j]]`` for every tensor t and pair j;
    the arrays are ``(blocks, outer, inner)`` byte views (`SideViews` also offer
    the grouped copy of consecutive runs). Runs on the copy thread."""
    order = np.argsort(src_ids, kind="stable")
    s, d = src_ids[order], dst_ids[order]
    starts, lengths = runs(s)
    smallest = min(v[0].nbytes for v in src)
    long_run = lengths >= max(1, -(-MIN_RUN_BYTES // smallest))
    # breaks[k]: how many times d fails to step by one before pair k
    breaks = np.concatenate(([0], np.cumsum(np.diff(d) != 1)))
    plan = [
        (int(s[a]), a, n, breaks[a + n - 1] == breaks[a])
        for a, n in zip(starts[long_run].tolist(), lengths[long_run].tolist(), strict=True)
    ]
    grouped = _grouped(src, dst)
    if grouped is not None:
        sg, dg, group = grouped
        for s0, a, n, _ in (p for p in plan if p[3]):
            _copy_grouped(sg, dg, s0, int(d[a]), n, group)
        plan = [p for p in plan if not p[3]]
    for sv, dv in zip(src, dst, strict=True):
        for s0, a, n, consecutive in plan:
            if consecutive:
                d0 = int(d[a])
                np.copyto(dv[d0 : d0 + n], sv[s0 : s0 + n])
            else:
                dv[d[a : a + n]] = sv[s0 : s0 + n]
    if not long_run.all():
        short = np.repeat(~long_run, lengths)
        _gather_scatter(src, dst, s[short], d[short])


def _gather_scatter(
    src: list[np.ndarray], dst: list[np.ndarray], s: np.ndarray, d: np.ndarray
) -> None:
    """Scattered pairs: gather a chunk (it stays in cache), scatter it."""
    for sv, dv in zip(src, dst, strict=True):
        k = max(1, CHUNK_BYTES // sv[0].nbytes)
        for lo in range(0, len(s), k):
            dv[d[lo : lo + k]] = sv[s[lo : lo + k]]
