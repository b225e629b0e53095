"""The CUDA path's logic, on CPU: the batched-call builder against real host buffers,
the choice of DMA path (and its fallbacks) against runtimes that lack calls, the
completion threads driven by real threads, and the whole CUDA backend with its
CUDA calls turned into host copies and its stream calls into a host model of
stream order (which checks that copies wait for the caller's stream)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import select
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tierkv.core.shm import SharedRegion
from tierkv.engine import KVLayout, OpenedKV
from tierkv.wire.protocol import TransferJob
from tierkv.wire.wakeup import Wakeup
from workers.gpu.completion import CompletionWaiter, PendingJob
from workers.gpu.cudart import (
    BATCH_MIN_RUNTIME,
    CudaCallError,
    Runtime,
    choose_dma_path,
    loaded_cudart_paths,
)
from workers.gpu.dma_plan import Copies1D, Copies2D, HostSide, copies_1d, copies_2d
from workers.gpu.jobs import TransferError
from workers.gpu.pinning import Pinned

# -- the batched-call builder, checked by doing its copies with memmove -----------------------


def run_1d(c: Copies1D) -> None:
    for d, s, n in zip(c.dst.tolist(), c.src.tolist(), c.size.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def run_2d(c: Copies2D) -> None:
    for dst, dpitch, src, spitch, width, height in c.rows():
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)


PLANS = {"1d": (copies_1d, run_1d), "2d": (copies_2d, run_2d)}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("world_size,rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("page", [4096, 1536, 24])  # aligned, padded rows, odd tiny pages
def test_copies_move_each_page_between_its_staging_row_and_its_cpu_row(plan, world_size,
                                                                      rank, page):
    rows, row = 40, -(-world_size * page // 4096) * 4096
    rng = np.random.default_rng(page + world_size + rank)
    cpu = np.sort(rng.permutation(rows)[:17])
    cpu[:5] = np.arange(10, 15)  # one long run among short ones
    cpu = np.unique(cpu)
    host = rng.integers(0, 256, rows * row, dtype=np.uint8)
    stage = rng.integers(0, 256, len(cpu) * page, dtype=np.uint8)
    side = HostSide(host.ctypes.data, row, rank * page, page)
    build, run = PLANS[plan]
    # store: staging -> host
    want = host.copy()
    for i, c in enumerate(cpu):
        want[c * row + rank * page : c * row + (rank + 1) * page] = stage[i * page : (i + 1) * page]
    copies = build(cpu, side, stage.ctypes.data, True)
    assert copies.nbytes == len(cpu) * page
    run(copies)
    assert (host == want).all()
    # load: host -> staging
    stage[:] = 0
    run(build(cpu, side, stage.ctypes.data, False))
    for i, c in enumerate(cpu):
        assert (stage[i * page : (i + 1) * page] == want[c * row + rank * page :][:page]).all()


def test_copies_coalesce_runs_when_the_rows_allow_it():
    cpu = np.array([0, 1, 2, 3, 7, 9, 10])  # runs: 4, 1, 2
    contiguous = HostSide(1 << 20, 4096, 0, 4096)
    strided = HostSide(1 << 20, 8192, 4096, 4096)  # rank 1 of 2
    assert len(copies_1d(cpu, contiguous, 0, True)) == 3  # one flat span per run
    assert len(copies_1d(cpu, strided, 0, True)) == 7  # the batch call is 1D: one per page
    plan = copies_2d(cpu, strided, 0, True)
    assert len(plan) == 3 and plan.height.tolist() == [4, 1, 2]
    assert copies_2d(cpu, contiguous, 0, False).height.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="sorted and distinct"):
        copies_1d(np.array([3, 2]), contiguous, 0, True)


# -- which DMA path, and why ---------------------------------------------------------------


def fake_runtime(version: int, batch: bool, has_2d: bool = True) -> SimpleNamespace:
    return SimpleNamespace(version=version, has_batch=batch and version >= BATCH_MIN_RUNTIME,
                           has_2d=has_2d, path="/opt/cuda/libcudart.so.12")


def test_dma_path_follows_what_the_runtime_has():
    assert choose_dma_path(fake_runtime(12080, True), {}).path == "batch"
    old = choose_dma_path(fake_runtime(12040, True), {})
    assert old.path == "2d" and "needs CUDA runtime 12.8+" in old.reason and "12.4" in old.reason
    bare = choose_dma_path(fake_runtime(12040, False, has_2d=False), {})
    assert bare.path == "copy" and "nor cudaMemcpy2DAsync" in bare.reason
    none = choose_dma_path(None, {})
    assert none.path == "copy" and "no libcudart" in none.reason


def test_dma_path_asked_for_is_granted_only_when_available():
    rt = fake_runtime(12090, True)
    assert choose_dma_path(rt, {"TIERKV_CUDA_DMA": "2d"}).path == "2d"
    assert choose_dma_path(rt, {"TIERKV_CUDA_NO_MEMCPY2D": "1"}).path == "copy"
    refused = choose_dma_path(fake_runtime(12020, True), {"TIERKV_CUDA_DMA": "batch"})
    assert refused.path == "2d" and "asked for" in refused.reason
    assert choose_dma_path(rt, {"TIERKV_CUDA_DMA": "warp"}).path == "batch"  # ignored


def test_a_library_without_the_cuda_calls_fails_soft():
    """libc stands for a runtime that lacks every call: the wrapper says so instead
    of crashing, and the choice falls back to torch's copies."""
    rt = Runtime(ctypes.CDLL(None), "libc")
    assert (rt.version, rt.has_batch, rt.has_2d, rt.has_last_error) == (0, False, False, False)
    rt.clear_error()  # nothing to clear, and no crash
    assert rt.error_name(2) == "unknown"
    with pytest.raises(CudaCallError, match=r"cudaMemcpy2DAsync failed: cudaError 2"):
        rt.check("cudaMemcpy2DAsync", 2)
    choice = choose_dma_path(rt, {})
    assert choice.path == "copy" and "is unknown" in choice.reason


def test_loaded_cudart_paths_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n"
        "7f10-7f20 r-xp 0 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f20-7f30 r--p 0 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
        "7f30-7f40 r-xp 0 08:01 3 /venv/torch/lib/libcudart_shim.so\n")
    assert loaded_cudart_paths(str(maps)) == ["/venv/nvidia/cuda_runtime/lib/libcudart.so.12"]
    assert loaded_cudart_paths(str(tmp_path / "none")) == []


# -- the completion threads ----------------------------------------------------------------


class Marker:
    """A job's end, released by the test (a CUDA event in production)."""

    def __init__(self, error: str = "") -> None:
        self.done = threading.Event()
        self.error = error

    def synchronize(self) -> None:
        assert self.done.wait(30)
        if self.error:
            raise RuntimeError(self.error)


def readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_finished_jobs_wake_the_loop_in_order_per_direction():
    wakeup = Wakeup()
    bound = []
    waiter = CompletionWaiter("t", wakeup.notify, bind_thread=lambda: bound.append(1))
    try:
        markers = {j: Marker() for j in (1, 2, 3)}
        waiter.add("store", PendingJob(1, 100, markers[1], lambda: 0.25))
        waiter.add("store", PendingJob(2, 200, markers[2], lambda: 0.5))
        waiter.add("load", PendingJob(3, 300, markers[3], lambda: 0.75))
        assert not readable(wakeup.fd, 0.2)  # nothing finished: the loop sleeps
        assert waiter.poll() == [] and waiter.in_flight == 3
        markers[2].done.set()  # job 2 is done on the GPU, but job 1 runs first on its stream
        markers[3].done.set()
        assert readable(wakeup.fd, 10)
        wakeup.drain()
        deadline = time.monotonic() + 10
        got = []
        while not got and time.monotonic() < deadline:
            got = waiter.poll()
        assert [(o.job_id, o.success, o.bytes_moved, o.seconds) for o in got] == [
            (3, True, 300, 0.75)]
        markers[1].done.set()
        assert waiter.wait_idle(10)
        assert [o.job_id for o in waiter.poll()] == [1, 2]
        assert bound == [1, 1]  # each thread bound its device once
    finally:
        assert waiter.close(5)
        wakeup.close()


def test_a_device_error_fails_that_job_and_every_later_one():
    calls = []
    waiter = CompletionWaiter("t", lambda: calls.append(1))
    try:
        bad, queued = Marker("CUDA error: an illegal memory access"), Marker()
        waiter.add("load", PendingJob(1, 10, bad, lambda: 0.0))
        waiter.add("load", PendingJob(2, 10, queued, lambda: 0.0))
        bad.done.set()
        assert waiter.wait_idle(10)
        out = waiter.poll()
        assert [(o.job_id, o.success, o.error_code) for o in out] == [
            (1, False, "fatal"), (2, False, "fatal")]
        assert "illegal memory access" in out[0].error
        waiter.add("store", PendingJob(3, 10, Marker(), lambda: 0.0))  # never waited for
        assert [(o.job_id, o.error_code) for o in waiter.poll()] == [(3, "fatal")]
        assert calls
    finally:
        queued.done.set()
        waiter.close(5)


def test_close_fails_what_did_not_finish_in_time():
    waiter = CompletionWaiter("t", lambda: None)
    stuck = Marker()
    waiter.add("store", PendingJob(1, 10, stuck, lambda: 0.0))
    assert not waiter.close(0.2)
    (out,) = waiter.poll()
    assert out.error_code == "fatal" and "did not finish within" in out.error
    stuck.done.set()


# -- the whole CUDA backend, its CUDA calls turned into host copies --------------------------


class HostRuntime:
    """A CUDA runtime whose copies are memmoves (addresses are host addresses); each
    call is noted on `streams` with the stream it was queued on."""

    path = "host"
    version = 12080

    def __init__(self, batch: bool, fail_batch: bool = False,
                 streams: HostStreams | None = None) -> None:
        self.has_batch, self.has_2d, self.fail_batch = batch, True, fail_batch
        self.calls = {"batch": 0, "2d": 0}
        self.streams = streams

    def memcpy_batch(self, dsts, srcs, sizes, stream) -> None:  # noqa: ANN001
        if self.fail_batch:
            raise CudaCallError("cudaMemcpyBatchAsync", 801, "cudaErrorNotSupported")
        self.calls["batch"] += 1
        self._note(stream)
        run_1d(Copies1D(dsts, srcs, sizes))

    def memcpy_2d(self, dst, dpitch, src, spitch, width, height, stream) -> None:  # noqa: ANN001
        self.calls["2d"] += 1
        self._note(stream)
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    def _note(self, handle: int) -> None:
        if self.streams is not None:
            self.streams.note("dma", self.streams.by_handle[handle])


@dataclass(eq=False)
class HostStream:
    """A stream on the host. `after`: the newest piece of the caller's work that
    what is queued on it from now on would run after, on a device."""

    name: str
    handle: int
    after: int = 0


@dataclass(eq=False)
class HostEvent:
    after: int = -1  # the `after` of the stream it was last recorded on; -1: never

    def synchronize(self) -> None:
        assert self.after >= 0, "a job's end event was never recorded"


class HostStreams:
    """The copy path's `StreamOps` on the host: torch ops run at once on CPU tensors,
    and the order a device would enforce is tracked instead. The caller's stream
    counts the pieces of work queued on it (`caller_queues`); a record copies a
    stream's count into the event, a wait raises the stream's to the event's, as
    CUDA's stream order and ``cudaStreamWaitEvent`` do. Each op queued (torch ops
    inside `issue_on`, the runtime's DMA calls) is noted with its stream's count."""

    def __init__(self) -> None:
        self.by_handle: dict[int, HostStream] = {}
        self.caller = self.new_stream(torch.device("cpu"), "caller")
        self.queued: list[tuple[str, str, int]] = []  # (what, stream, after)

    def caller_queues(self) -> int:
        """The caller queues work on its current stream (the forward pass writing the
        KV cache, a zeroing of blocks); returns its number."""
        self.caller.after += 1
        return self.caller.after

    def note(self, what: str, stream: HostStream) -> None:
        self.queued.append((what, stream.name, stream.after))

    # -- StreamOps --------------------------------------------------------------------

    def available(self) -> bool:
        return True

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def bind(self, device: torch.device) -> None:
        pass

    def on_device(self, device: torch.device) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_stream(self, device: torch.device, name: str = "") -> HostStream:
        stream = HostStream(name or f"stream{len(self.by_handle)}", len(self.by_handle) + 1)
        self.by_handle[stream.handle] = stream
        return stream

    def current_stream(self, device: torch.device) -> HostStream:
        return self.caller

    def new_event(self, *, timing: bool = False, blocking: bool = False) -> HostEvent:
        return HostEvent()

    def record(self, event: HostEvent, stream: HostStream) -> None:
        event.after = stream.after

    def wait(self, stream: HostStream, event: HostEvent) -> None:
        stream.after = max(stream.after, event.after)

    @contextlib.contextmanager
    def issue_on(self, stream: HostStream) -> Iterator[None]:
        self.note("torch", stream)
        yield

    def handle(self, stream: HostStream) -> int:
        return stream.handle

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def seconds(self, start: HostEvent, end: HostEvent) -> float:
        assert start.after >= 0 and end.after >= 0
        return 0.0005


@pytest.fixture
def host_cuda(monkeypatch):
    """CudaBackend on CPU tensors: its stream calls go to `HostStreams`, DMA is memmove,
    pinning is noted."""
    import workers.gpu.copy_cuda as cc

    ns = SimpleNamespace(pinned=True, pins={"pin": [], "unpin": []}, streams=HostStreams())
    ns.CudaBackend = functools.partial(cc.CudaBackend, streams=ns.streams)

    def pin(ptr: int, size: int, device: int | None = None) -> Pinned:
        ns.pins["pin"].append(device)
        return Pinned(ptr, size, ns.pinned, error="" if ns.pinned else "cudaError 2")

    monkeypatch.setattr(cc, "pin_host", pin)
    monkeypatch.setattr(cc, "unpin_host", lambda ptr, device=None: ns.pins["unpin"].append(ptr))
    return ns


LAYOUTS = {
    "per_layer": KVLayout.per_layer(3, 24, 4, 2, 8, "float16"),  # 768 B pages, padded rows
    "per_layer_4k": KVLayout.per_layer(4, 24, 4, 4, 8, "float16"),  # 4 KiB: contiguous rows
    "blocks_outer": KVLayout.blocks_outer(24, 3, 2, 4, 16, "bfloat16"),
    "odd": KVLayout.per_layer(2, 24, 3, 1, 5, "int8"),  # 30-byte pieces: 2-byte words
}


def page_of(kv: OpenedKV, block: int) -> bytes:
    d = kv.layout.block_dim
    return b"".join(t.select(d, block).contiguous().view(torch.uint8).numpy().tobytes()
                    for t in kv.tensors)


@pytest.mark.parametrize("dma", ["batch", "2d", "copy", "batch_fails"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_cuda_backend_round_trip_on_host(instance, host_cuda, kind, world_size, dma):
    layout = LAYOUTS[kind]
    rng = np.random.default_rng(world_size)
    with SharedRegion.create(instance, 20, layout.page_size, world_size) as region:
        region.numpy()[:] = 0xAB
        for r in range(world_size):
            tensors = [torch.randint(0, 256, s, dtype=torch.uint8).view(layout.torch_dtype())
                       if layout.itemsize == 1 else
                       torch.randn(s).to(layout.torch_dtype()) for s in layout.tensor_shapes]
            kv = OpenedKV.local(tensors, layout)
            runtime = None if dma == "copy" else HostRuntime(dma != "2d",
                                                             fail_batch=dma == "batch_fails")
            backend = host_cuda.CudaBackend(region, r, staging_bytes=6 * layout.page_size,
                                            device=torch.device("cpu"), runtime=runtime)
            backend.attach(kv)
            assert backend.describe()["chunk_blocks"] == 3  # 2 buffers of 3 blocks
            gpu = rng.permutation(24)[:13].tolist()
            cpu = [2, 3, 4, 5, 6, 7, 0, 11, 10, 9, 15, 19, 18]
            want = [page_of(kv, g) for g in gpu]
            backend.submit(TransferJob(1, "store", gpu, cpu), np.array(gpu), np.array(cpu))
            backend.submit(TransferJob(2, "store", gpu[:2], [12, 13]), np.array(gpu[:2]),
                           np.array([12, 13]))
            assert backend._waiter.wait_idle(10)
            assert [o.success for o in backend.poll()] == [True, True]
            assert [bytes(region.page(c, r)) for c in cpu] == want
            assert [bytes(region.page(c, r)) for c in (12, 13)] == want[:2]
            for t in tensors:
                t.zero_()
            target = rng.permutation(24)[:13].tolist()
            backend.submit(TransferJob(3, "load", target, cpu), np.array(target), np.array(cpu))
            assert backend._waiter.wait_idle(10)
            (out,) = backend.poll()
            assert out.success and out.seconds == 0.0005
            assert out.bytes_moved == 13 * layout.page_size
            assert [page_of(kv, g) for g in target] == want
            facts = backend.describe()
            expected = {"batch": "batch", "2d": "2d", "copy": "copy", "batch_fails": "2d"}[dma]
            assert facts["dma_path"] == expected and facts["pinned"]
            assert backend.stats["jobs"] == 3 and backend.stats["dma_calls"] > 0
            if dma == "batch":  # one call per chunk: 5 + 1 + 5 chunks
                assert runtime.calls["batch"] == backend.stats["dma_calls"] == 11
            backend.close()
        if world_size == 2:
            assert host_cuda.pins["pin"] == [None, None]  # under the KV cache's device
        assert (region.numpy()[:, world_size * layout.page_size:] == 0xAB).all()


def test_an_unpinned_region_is_refused_unless_allowed(instance, host_cuda):
    host_cuda.pinned = False
    layout = LAYOUTS["per_layer"]
    with SharedRegion.create(instance, 8, layout.page_size) as region:
        with pytest.raises(TransferError, match=r"cannot pin .* allow_unpinned = true"):
            host_cuda.CudaBackend(region, 0, device=torch.device("cpu"), runtime=None)
        assert len(host_cuda.pins["unpin"]) == 1  # the failed registration is dropped
        backend = host_cuda.CudaBackend(region, 0, device=torch.device("cpu"), runtime=None,
                                        allow_unpinned=True)
        assert backend.describe()["pinned"] is False
        backend.close()


def test_copies_are_ordered_after_the_work_the_caller_queued(instance, host_cuda):
    """Inside vLLM a step's transfers are submitted right after its forward pass was
    launched on the same thread, while the model may still be writing the KV cache
    (and a zeroing of the blocks a load fills may still be queued). Every op of a job
    that reads or writes the KV cache, and a store's DMA, must be ordered after what
    the caller's current stream queued before the submit, whichever stream that is."""
    layout = LAYOUTS["per_layer"]
    streams = host_cuda.streams
    with SharedRegion.create(instance, 20, layout.page_size) as region:
        kv = OpenedKV.local([torch.randn(s).to(layout.torch_dtype())
                             for s in layout.tensor_shapes], layout)
        backend = host_cuda.CudaBackend(region, 0, staging_bytes=6 * layout.page_size,
                                        device=torch.device("cpu"),
                                        runtime=HostRuntime(True, streams=streams))
        backend.attach(kv)
        gpu, cpu = [5, 1, 9, 3, 7, 2, 11], [0, 1, 2, 3, 8, 9, 4]  # 3 chunks of 3 blocks
        for job_id, direction in enumerate(("store", "load", "store", "load"), 1):
            if job_id == 3:  # the engine's thread now runs on another stream
                streams.caller = streams.new_stream(torch.device("cpu"), "caller2")
            work = streams.caller_queues()  # the model writing, or a zeroing: still running
            streams.queued.clear()
            backend.submit(TransferJob(job_id, direction, gpu, cpu), np.array(gpu),
                           np.array(cpu))
            kernels = [after for what, _, after in streams.queued if what == "torch"]
            dma = [after for what, _, after in streams.queued if what == "dma"]
            assert len(kernels) == 4 and len(dma) == 3  # the index upload, 3 chunks each
            assert min(kernels) >= work, f"job {job_id} ({direction}) queues copy work " \
                "not ordered after the work the caller queued"
            if direction == "store":
                assert min(dma) >= work
        assert backend._waiter.wait_idle(10)
        assert [o.success for o in backend.poll()] == [True] * 4
        backend.close()
